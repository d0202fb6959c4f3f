"""FSDP2: parameters, gradients and optimizer state sharded across ranks (``torch.distributed.fsdp.fully_shard``).

Order inside ``prepare`` (getting it wrong silently trains the wrong tensors):

1. Activation checkpointing wraps each shard unit (so recomputation happens inside the unit).
2. ``fully_shard`` is applied to every unit, deepest first, then to the root: a unit must be
   sharded before any module that contains it, so each parameter belongs to exactly one unit.
3. Only then do optimizers learn their parameters: sharding replaces every parameter with a
   sharded DTensor, so an optimizer built from the model before ``prepare`` still points at the
   old tensors. ``prepare`` re-points it (matching parameters by name) when the model and its
   optimizer are prepared in the same call, and refuses an optimizer that already holds state.

Checkpoints: with ``SHARDED_STATE_DICT`` every rank writes its own shards of each model and
optimizer through torch.distributed.checkpoint (``checkpoint_format`` ``"dcp"``, loadable on any
number of processes); with ``FULL_STATE_DICT`` they are gathered to rank 0 and written in the
replicated format. Either loads into a sharded model (see :mod:`runner.engine.checkpoint.sharded_state`).

On an N-D mesh (a :class:`~runner.engine.parallel.mesh.ParallelismConfig`), tensor parallelism over
its ``tp`` dimension comes first (:mod:`runner.engine.parallel.tensor_parallel`), then ``fully_shard``
over ``dp_shard`` (HSDP: ``(dp_replicate, dp_shard)``), skipped when there is a single data-parallel
rank. The sharded checkpoints hold each tensor's global shape, so they reshard across mesh shapes:
saved with ``tp=2``, loaded with ``dp_shard=2``, on one process, and back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runner.engine.checkpoint import sharded_state
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.constants import MODEL_NAME, indexed_name
from runner.engine.distributed import DistributedEnvironment
from runner.engine.parallel.base import (
    CheckpointReader,
    CheckpointWriter,
    load_optimizer_file,
    load_sharded_state,
    refused_unless_it_fits,
    save_whole_state,
    unwrap_module,
)
from runner.engine.parallel.mesh import CONTEXT_DIM_NAME, SHARD_AND_CONTEXT_DIM_NAME, ParallelismConfig


@dataclass
class FullyShardedDataParallelPlugin:
    """FSDP2 settings (Accelerate's names where it has them).

    Args:
        transformer_cls_names_to_wrap: Class names of the modules that become shard units (a GPT's
            block, say); each unit's parameters are gathered just before it runs and freed after.
            Empty: the whole model is one unit.
        reshard_after_forward: Free the gathered parameters after each unit's forward (less memory,
            gathered again for backward) rather than keep them until backward.
        cpu_offload: Keep the sharded parameters, gradients and optimizer step on the CPU.
        activation_checkpointing: Recompute each unit's activations in backward instead of keeping them.
        state_dict_type: ``SHARDED_STATE_DICT``: ``save_state`` writes every rank's shards through
            torch.distributed.checkpoint (loads on any number of processes). ``FULL_STATE_DICT``:
            rank 0 gathers the full model and optimizer state on the CPU and writes them as without
            FSDP.
    """

    transformer_cls_names_to_wrap: list[str] = field(default_factory=list)
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    state_dict_type: str = "SHARDED_STATE_DICT"

    def __post_init__(self) -> None:
        if self.state_dict_type not in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            raise ValueError(
                f"state_dict_type={self.state_dict_type!r} is not supported; use 'SHARDED_STATE_DICT' or "
                "'FULL_STATE_DICT'."
            )


class FSDPStrategy:
    name = "fsdp"

    def __init__(
        self,
        env: DistributedEnvironment,
        plugin: FullyShardedDataParallelPlugin,
        param_dtype,
        parallelism: ParallelismConfig | None = None,
    ) -> None:
        """
        Args:
            parallelism: The N-D mesh (resolved against ``env``'s world size); None: FSDP over every process.
        """
        self.env = env
        self.plugin = plugin
        self.param_dtype = param_dtype  # from mixed_precision: the dtype units compute in, or None
        self.parallelism = parallelism
        # Shards through DCP, or whole states gathered to rank 0 (see runner.engine.checkpoint.sharded_state).
        self.checkpoint_format = "dcp" if plugin.state_dict_type == "SHARDED_STATE_DICT" else "safetensors"
        # Built now, while every process constructs its Accelerator: building it later, on first use, is a
        # collective that one process asking alone (for accelerator.torch_device_mesh, say) would hang in.
        self.device_mesh = self._build_mesh() if env.is_distributed else None

    def _build_mesh(self):
        """The run's ``DeviceMesh``: the parallelism config's, or FSDP's 1-D ``("dp_shard",)`` over every process."""
        if self.parallelism is not None:
            return self.parallelism.build_device_mesh(self.env.device.type)
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.env.device.type, (self.env.world_size,), mesh_dim_names=("dp_shard",))

    def _shard_mesh(self):
        if self.parallelism is None:
            return self.device_mesh
        names = self.parallelism.fsdp_dim_names
        if names == (SHARD_AND_CONTEXT_DIM_NAME,):  # looked up where it was made (torch deprecates slicing it)
            return self.device_mesh[("dp_shard", CONTEXT_DIM_NAME)]._flatten(SHARD_AND_CONTEXT_DIM_NAME)
        return self.device_mesh[names]

    @property
    def data_parallel_group(self):
        """The process group of the ranks that read different batches (None: every process does)."""
        config = self.parallelism
        if config is None or not (config.tp_enabled or config.cp_enabled) or not self.env.is_distributed:
            return None
        from runner.engine.parallel.mesh import data_parallel_mesh

        return data_parallel_mesh(self.device_mesh).get_group()

    def _tensor_parallel(self, model: nn.Module) -> None:
        from runner.engine.parallel.tensor_parallel import apply_tensor_parallel, default_tp_plan

        plan = self.parallelism.tp_plan or default_tp_plan(model)
        if not plan:
            raise ValueError(
                f"tp_size={self.parallelism.tp_size} (parallel.tp) needs a tensor-parallel plan, and "
                f"{type(model).__name__} has no tp_plan attribute; set parallel.tp_plan (module-name patterns to "
                "colwise, rowwise or sequence)."
            )
        apply_tensor_parallel(model, self.device_mesh["tp"], plan)

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._check_shard_units(model)
        if not self.env.is_distributed:
            return model  # one process: nothing to shard; checkpoints still use the sharded format
        return self._parallelize(model)

    def _check_shard_units(self, model: nn.Module) -> None:
        names = set(self.plugin.transformer_cls_names_to_wrap)
        found = {type(module).__name__ for module in model.modules()}
        missing = sorted(names - found)
        if missing:
            raise ValueError(
                f"No module of class {missing[0]} in the model to shard (its classes: "
                f"{', '.join(sorted(found)[:8])}); fix transformer_cls_names_to_wrap (parallel.shard_modules)."
            )

    def _parallelize(self, model: nn.Module) -> nn.Module:
        """Tensor parallelism over ``tp``, then FSDP2 over the data-parallel dimensions (each shard unit, then
        ``model`` as the root)."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        names = set(self.plugin.transformer_cls_names_to_wrap)
        if self.parallelism is not None and self.parallelism.tp_enabled:
            self._tensor_parallel(model)
        config = self.parallelism
        if config is not None and config.data_parallel_size == 1 and not config.cp_enabled:
            return model  # tensor parallelism or pipeline stages alone: no data-parallel rank to shard across
        units = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if self.plugin.activation_checkpointing:
            units = [_checkpoint_unit(model, unit) for unit in units]
        options: dict[str, Any] = {
            "mesh": self._shard_mesh(),
            "reshard_after_forward": self.plugin.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32),
            # Pinned host memory speeds the copies to the GPU; there is none to pin for a CPU run.
            "offload_policy": CPUOffloadPolicy(pin_memory=self.env.device.type == "cuda")
            if self.plugin.cpu_offload
            else OffloadPolicy(),
        }
        for unit in reversed(units):  # module order lists a parent before its children: reversed, deepest first
            fully_shard(unit, **options)
        fully_shard(model, **options)
        return model

    @contextlib.contextmanager
    def preparing_models(
        self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
    ) -> Iterator[None]:
        before = parameter_names(list(models))  # taken before sharding replaces the parameters
        yield
        for optimizer in optimizers:
            repoint_optimizer(optimizer, before)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return _no_gradient_sync(model)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state on rank 0's CPU, gathered from every rank (a collective; {} elsewhere).

        Names that share one parameter (a head tied to the embedding) share one tensor again, as in
        ``model.state_dict()``: gathering gives each name a copy of its own, which a save would store twice.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        model = unwrap_module(model)
        if not _is_sharded(model) and not _holds_dtensors(model):
            return model.state_dict()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)
        for names in _tied_names(model):
            kept = next((name for name in names if name in state), None)
            for name in names:
                if kept is not None and name in state:
                    state[name] = state[kept]
        return state

    @staticmethod
    def total_norm(norm: torch.Tensor) -> torch.Tensor:
        """clip_grad_norm_ over sharded gradients returns a DTensor: the norm across all shards."""
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.total_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))

    def checkpoint_weights(self, models: Sequence[nn.Module]) -> None:
        return None  # the weights are shards: written through DCP, or gathered during the save

    def check_save(self, *, mid_cycle: bool) -> None:
        if mid_cycle:
            raise CheckpointError(
                "save_state under FSDP needs a gradient accumulation cycle boundary (sharded gradients pending "
                "between syncs are not saved); save when accelerator.sync_gradients is True."
            )

    def save_model_state(
        self,
        folder: CheckpointWriter,
        models: Sequence[nn.Module],
        optimizers: Sequence[Any],
        *,
        weights: Sequence[dict[str, torch.Tensor]] | None,
        rank: int,
    ) -> None:
        """Every rank writes its shards (``"dcp"``), or sends them to rank 0, which writes whole states."""
        if self.checkpoint_format == "dcp":
            sharded_state.save_sharded(folder, models, optimizers, indexed_name)
            return
        whole_weights, optimizer_states = sharded_state.gather_full(models, optimizers)  # a collective
        if rank == 0:
            save_whole_state(folder, whole_weights, optimizer_states)

    def check_load(self, checkpoint: CheckpointReader) -> None:
        pass  # shards reshard onto this run's processes, and whole states are sharded as they load

    def load_model_state(
        self, checkpoint: CheckpointReader, models: Sequence[nn.Module], optimizers: Sequence[Any]
    ) -> None:
        if checkpoint.state_format == "dcp":
            load_sharded_state(checkpoint, models, optimizers)
            return
        for i, model in enumerate(models):
            with refused_unless_it_fits(checkpoint.path / indexed_name(MODEL_NAME, i, "")):
                sharded_state.load_model(checkpoint.load_tensors(indexed_name(MODEL_NAME, i, ".safetensors")), model)
        for i, optimizer in enumerate(optimizers):  # a whole optimizer state, keyed by parameter name
            sharded_state.load_optimizer(load_optimizer_file(checkpoint, i), optimizer, models)


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The groups of parameter and buffer names that are one tensor of ``model``."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _holds_dtensors(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (tensor parallelism without ``fully_shard``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module):
    model = unwrap_module(model)
    if not _is_sharded(model):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _checkpoint_unit(root: nn.Module, unit: nn.Module) -> nn.Module:
    """Wrap ``unit`` (in place of it inside ``root``) so its activations are recomputed in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = checkpoint_wrapper(unit)
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is unit:
                setattr(parent, name, wrapped)
                return wrapped
    return wrapped


def repoint_optimizer(optimizer: torch.optim.Optimizer, before: dict[int, tuple[nn.Module, str]]) -> None:
    """Make ``optimizer`` hold the sharded parameters in place of the ones it was built with.

    Args:
        before: :func:`parameter_names` of the models, taken before they were sharded.
    """
    owned = [p for group in optimizer.param_groups for p in group["params"] if id(p) in before]
    if not owned:
        return
    if optimizer.state:
        raise ValueError(
            "prepare() shards the model's parameters, but this optimizer has already stepped on the unsharded "
            "ones; build the optimizer fresh and prepare it together with the model."
        )
    models = {id(model): model for model, _ in before.values()}
    after = {key: dict(_named_parameters(model)) for key, model in models.items()}
    for group in optimizer.param_groups:
        group["params"] = [
            after[id(before[id(p)][0])][before[id(p)][1]] if id(p) in before else p for p in group["params"]
        ]


def parameter_names(models: list[nn.Module]) -> dict[int, tuple[nn.Module, str]]:
    """``id(parameter) -> (model, name)`` for every parameter of ``models``."""
    return {id(parameter): (model, name) for model in models for name, parameter in _named_parameters(model)}


def _named_parameters(model: nn.Module):
    # Activation checkpointing inserts "_checkpoint_wrapped_module." into names: compare without it.
    for name, parameter in unwrap_module(model).named_parameters():
        yield name.replace("_checkpoint_wrapped_module.", ""), parameter
