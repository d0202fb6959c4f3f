"""Pipeline parallelism as a strategy: each process holds the stages of a model cut by its plan, on the mesh's
``pp`` dimension, composed with FSDP2 over ``dp_shard`` (HSDP with ``dp_replicate``) and tensor parallelism over
``tp`` inside each stage.

What a process holds (:class:`PipelinedModel`): the model with every unit its stages do not hold removed, names
kept (the *rank module*; see :func:`runner.engine.parallel.pipeline.cut`), and a view of it per stage (one under
``gpipe`` and ``1f1b``, several under the looped and V-shaped schedules) that shares its modules and runs the plan's
stage forward. Optimizers, checkpoints and gradient clipping see the rank module, so parameter names are the
model's own everywhere; torch's ``PipelineStage`` and schedules see the views.

The training step is one schedule step (``Accelerator.forward_backward``): the process's batch is split into
``microbatches`` micro-batches, each stage runs their forwards and backwards in the schedule's order, and the loss
of each micro-batch is scaled by ``1 / microbatches`` (and the accumulation steps, and the fp16 loss scale), so the
gradients are those of the batch's mean loss, as without pipelining. Gradient accumulation is an outer loop of such
steps: micro-batches split one process's batch, accumulation adds batches. Tied weights whose ends sit on different
stages (a head tied to the embedding) are separate tensors there, kept equal: their gradients are summed on the
syncing step. Evaluation (a forward without gradients) runs the stages in order, one batch at a time, and every
process of the pipeline gets the last stage's output, so metrics gather over the data-parallel ranks as usual.

Checkpoints hold the rank modules' state under the model's own names, through torch.distributed.checkpoint,
the optimizer's flattened by parameter name (its parameter groups differ between stages): they load on any
layout (another number of stages, FSDP, DDP, one process), as a checkpoint of the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from runner.engine.checkpoint import sharded_state
from runner.engine.checkpoint.sharded_state import owner_of
from runner.engine.constants import MODEL_NAME, OPTIMIZER_NAME, indexed_name
from runner.engine.distributed import DistributedEnvironment
from runner.engine.parallel.base import (
    CheckpointReader,
    CheckpointWriter,
    load_optimizer_file,
    load_sharded_state,
    refused_unless_it_fits,
    unwrap_module,
)
from runner.engine.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin, _no_gradient_sync
from runner.engine.parallel.mesh import PIPELINE_DIM_NAME, ParallelismConfig
from runner.engine.parallel.pipeline import (
    PipelinePlan,
    cut,
    pipeline_plan,
    schedule_class,
    stage_indices,
    stage_units,
    sum_tied_gradients,
)


class PipelinedModel(nn.Module):
    """This process's stages of a model cut into a pipeline: ``module`` (the rank module, the model's names) and a
    view of it per stage.

    Call it without gradients (evaluation) for the model's output, on every process of the pipeline; a training
    step is :meth:`step`, which ``Accelerator.forward_backward`` calls.
    """

    holds_stages = True  # unwrap_module peels it to ``module``

    def __init__(
        self,
        module: nn.Module,
        views: dict[int, nn.Module],
        plan: PipelinePlan,
        *,
        schedule: str,
        microbatches: int,
        num_stages: int,
        stage_owner: Callable[[int], int],
        group,
        device: torch.device,
        whole: nn.Module,
        whole_buffers: dict[str, torch.Tensor],
        tied_group,
    ) -> None:
        super().__init__()
        self.module = module
        # Not submodules: they share the rank module's modules, whose names are the model's.
        self.__dict__["views"] = views
        self.__dict__["whole_on_meta"] = whole
        self.whole_buffers = whole_buffers  # its non-persistent buffers: to_empty gives them no values
        self.plan, self.schedule_name, self.microbatches = plan, schedule, microbatches
        self.num_stages, self.stage_owner, self.group, self.device = num_stages, stage_owner, group, device
        self.tied_group = tied_group
        # Tied weights held here by their alias alone (the other end on another stage): counted once in a norm.
        held = dict(module.named_parameters(remove_duplicate=False))
        self.alias_ids = frozenset(
            id(held[alias])
            for alias, canonical in plan.tied.items()
            if alias in held and (canonical not in held or held[canonical] is not held[alias])
        )
        self._schedules: dict[tuple, Any] = {}
        self._loss_fn: Callable | None = None
        self._loss_scale = 1.0
        self._losses: list[torch.Tensor] = []

    # ------------------------------------------------------------------------------------------ who holds what
    @property
    def holds_first(self) -> bool:
        return 0 in self.views

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.views

    def _global_rank(self, stage: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, self.stage_owner(stage))

    def train(self, mode: bool = True) -> PipelinedModel:
        super().train(mode)
        for view in self.views.values():
            view.training = mode
        return self

    # ------------------------------------------------------------------------------------------- training step
    def step(self, args: tuple, kwargs: dict, target: Any, loss_fn: Callable, *, scale: float) -> torch.Tensor:
        """One schedule step over the batch ``args``/``kwargs`` (read by the first stage) and ``target`` (by the
        last): forwards and backwards of every micro-batch, each micro-batch's ``loss_fn(output, target)`` scaled by
        ``scale / microbatches``. Returns the batch's mean loss (unscaled, detached) on every process of the
        pipeline.

        Raises:
            ValueError: The batch does not split into the micro-batches.
        """
        rows = _rows(args, kwargs)
        if rows % self.microbatches:
            raise ValueError(
                f"A batch of {rows} rows does not split into parallel.pp_microbatches={self.microbatches} equal "
                f"micro-batches; make the batch size per process a multiple of {self.microbatches}."
            )
        schedule = self._schedule(_shapes(args, kwargs, target))
        self._loss_fn, self._loss_scale, self._losses = loss_fn, scale / self.microbatches, []
        step_args = args if self.holds_first else ()
        step_kwargs = kwargs if self.holds_first else {}
        if self.holds_last:
            schedule.step(*step_args, target=target, losses=[], **step_kwargs)
        else:
            schedule.step(*step_args, **step_kwargs)
        # The micro-batches' losses: the last ones (the first step of a schedule runs the loss once more on
        # uninitialised outputs, to learn the shapes of its gradients).
        losses = self._losses[-self.microbatches :]
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        return self._from_last_stage(loss)

    def _scaled_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self._loss_fn(output, target)
        self._losses.append(loss.detach().float())
        return loss * self._loss_scale

    def _schedule(self, key: tuple):
        """torch's schedule for batches of these shapes (a stage fixes the shapes it passes at its first step)."""
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            schedule_type, layout = schedule_class(self.schedule_name)
            stages = [
                PipelineStage(view, index, self.num_stages, self.device, group=self.group)
                for index, view in sorted(self.views.items())
            ]
            self._schedules[key] = schedule_type(
                stages[0] if layout == "single" else stages, n_microbatches=self.microbatches,
                loss_fn=self._scaled_loss, scale_grads=False,
            )  # fmt: skip
        return self._schedules[key]

    def sum_tied_gradients(self) -> None:
        """Give both ends of each tied weight the gradient of the one weight (once per optimizer step)."""
        if self.plan.tied:
            sum_tied_gradients([self.module], self.plan, group=self.tied_group)

    # ---------------------------------------------------------------------------------------------- evaluation
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's output for a batch, on every process of the pipeline (without gradients: evaluation)."""
        if torch.is_grad_enabled() and self.training:
            raise RuntimeError(
                "Under pipeline parallelism a training forward runs inside the schedule with its backward; call "
                "accelerator.forward_backward(model, inputs, target=targets, loss_fn=...) instead of model(inputs), "
                "and model(inputs) under torch.no_grad() to evaluate."
            )
        output = None
        for index in range(self.num_stages):
            if index not in self.views:
                continue
            if index == 0:
                output = self.views[0](*args, **kwargs)
            else:
                if index - 1 not in self.views:
                    output = _receive(self._global_rank(index - 1), self.device)
                output = self.views[index](output)
            if index + 1 < self.num_stages and index + 1 not in self.views:
                _send(output, self._global_rank(index + 1))
        return self._from_last_stage(output)

    def _from_last_stage(self, value: torch.Tensor | None) -> torch.Tensor:
        """``value`` as the process holding the last stage has it, on every process of the pipeline."""
        import torch.distributed as dist

        source = self._global_rank(self.num_stages - 1)
        if self.holds_last:
            for rank in dist.get_process_group_ranks(self.group):
                if rank != source:
                    _send(value, rank)
            return value
        return _receive(source, self.device)

    # ------------------------------------------------------------------------------------------ the whole model
    def whole(self, state: dict[str, torch.Tensor]) -> nn.Module:
        """The whole model, built anew (on this process's device) with ``state`` (every weight)."""
        model = copy.deepcopy(self.whole_on_meta)
        model.to_empty(device=self.device)
        model.load_state_dict(state)
        for name, value in self.whole_buffers.items():
            _set_tensor(model, name, value.to(self.device))
        return model


def _rows(args: tuple, kwargs: dict) -> int:
    first = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
    return 0 if first is None else first.shape[0]


def _shapes(*values: Any) -> tuple:
    shapes = []
    for value in torch.utils._pytree.tree_leaves(values):
        shapes.append((tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__)
    return tuple(shapes)


# A tensor passed between stages outside the schedule (evaluation): its dtype, rank and shape first, then itself.
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool]


def _send(tensor: torch.Tensor, rank: int) -> None:
    import torch.distributed as dist

    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in _DTYPES:
        raise TypeError(
            f"A pipeline stage's output must be one tensor of a common dtype to pass to the next stage, not "
            f"{type(tensor).__name__}; make the model's stage forward return a tensor."
        )
    header = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], dtype=torch.int64)
    header = torch.cat([header, torch.zeros(10 - len(header), dtype=torch.int64)])
    dist.send(header.to(tensor.device), rank)
    dist.send(tensor.contiguous(), rank)


def _receive(rank: int, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist

    header = torch.zeros(10, dtype=torch.int64, device=device)
    dist.recv(header, rank)
    dtype, dims = _DTYPES[int(header[0])], int(header[1])
    tensor = torch.empty(tuple(int(size) for size in header[2 : 2 + dims]), dtype=dtype, device=device)
    dist.recv(tensor, rank)
    return tensor


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    module = model.get_submodule(".".join(path))
    module._buffers[leaf] = value


def stage_view(module: nn.Module, plan: PipelinePlan, units: Sequence[str]) -> nn.Module:
    """A view of ``module`` (a rank module) holding only ``units``: it shares their modules and parameters, and
    runs the plan's stage forward. The containers on the way to a removed unit are copied, never changed."""
    view = copy.copy(module)
    view._modules = dict(module._modules)
    kept = set(units)
    for unit in plan.units:
        if unit in kept:
            continue
        parent = view
        *path, name = unit.split(".")
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                break
            copied = copy.copy(child)
            copied._modules = dict(child._modules)
            parent._modules[part] = copied
            parent = copied
        else:
            if name in parent._modules:
                if isinstance(parent, (nn.ModuleList, nn.ModuleDict)):
                    del parent._modules[name]
                else:
                    parent._modules[name] = None
    view.forward = types.MethodType(plan.stage_forward, view)
    return view


class PipelineStrategy(FSDPStrategy):
    """Pipeline stages on the mesh's ``pp`` dimension, each sharded and split as :class:`FSDPStrategy` does a
    whole model (FSDP2 over the data-parallel dimensions, tensor parallelism over ``tp``)."""

    def __init__(
        self,
        env: DistributedEnvironment,
        plugin: FullyShardedDataParallelPlugin,
        param_dtype,
        parallelism: ParallelismConfig,
        precision=None,
    ) -> None:
        if not env.is_distributed:
            raise ValueError(
                f"parallel.pp={parallelism.pp_size} runs {parallelism.pp_size} pipeline stages on as many processes, "
                "but this is one process; launch with trainer.num_processes (or torchrun) to match the mesh."
            )
        super().__init__(env, plugin, param_dtype, parallelism)
        self.precision = precision  # each stage's forward runs under the run's autocast, as the model's did
        self._pipelined: dict[int, PipelinedModel] = {}
        # Each optimizer's parameters as the whole model's optimizer held them, in order, by their names: what the
        # index of a whole optimizer state (a one-process or DDP checkpoint's optimizer.bin) refers to.
        self._whole_order: dict[int, list[list[str]]] = {}

    @property
    def data_parallel_group(self):
        from runner.engine.parallel.mesh import data_parallel_mesh

        return data_parallel_mesh(self.device_mesh).get_group()

    @property
    def pp_mesh(self):
        return self.device_mesh[PIPELINE_DIM_NAME]

    def wrap_model(self, model: nn.Module) -> PipelinedModel:
        config = self.parallelism
        plan = pipeline_plan(model)
        _, layout = schedule_class(config.pp_schedule)
        stages = config.pp_stages
        units = stage_units(model, plan, stages, config.pp_split_points)
        pp_rank = self.pp_mesh.get_local_rank()
        held = stage_indices(pp_rank, config.pp_size, stages, layout=layout)
        self._check_shard_units(model)
        module = cut(model, plan, [unit for index in held for unit in units[index]])
        _untie_across_stages(module, plan, units, held)
        views = {index: stage_view(module, plan, units[index]) for index in held}
        for view in views.values():
            if self.precision is not None:
                self.precision.apply(view)
            self._parallelize(view)
        tied_group = self._tied_group(plan, units, layout, stages)

        def owner(stage: int) -> int:
            return next(
                r for r in range(config.pp_size) if stage in stage_indices(r, config.pp_size, stages, layout=layout)
            )

        whole, buffers = _to_meta(model)
        pipelined = PipelinedModel(
            module, views, plan, schedule=config.pp_schedule, microbatches=config.microbatches, num_stages=stages,
            stage_owner=owner, group=self.pp_mesh.get_group(), device=self.env.device, whole=whole,
            whole_buffers=buffers,
            tied_group=tied_group,
        )  # fmt: skip
        self._pipelined[id(model)] = pipelined
        return pipelined

    def _tensor_parallel(self, model: nn.Module) -> None:
        """The plan's patterns that name a module of this stage (a stage holds some blocks, or none)."""
        from runner.engine.parallel.tensor_parallel import _matches, apply_tensor_parallel, default_tp_plan

        plan = self.parallelism.tp_plan or default_tp_plan(model)
        if not plan:
            super()._tensor_parallel(model)  # its sentence: the model has no plan
        names = [name for name, _ in model.named_modules()]
        plan = {pattern: style for pattern, style in plan.items() if any(_matches(pattern, name) for name in names)}
        apply_tensor_parallel(model, self.device_mesh["tp"], plan)

    def _tied_group(self, plan: PipelinePlan, units, layout: str, stages: int):
        """The process group of this process and the one holding the other end of the model's tied weights, where
        the two ends sit on different processes (every process creates every such group, in the same order)."""
        import torch.distributed as dist

        if not plan.tied:
            return None
        pp = self.parallelism.pp_size
        first = next(r for r in range(pp) if 0 in stage_indices(r, pp, stages, layout=layout))
        last = next(r for r in range(pp) if stages - 1 in stage_indices(r, pp, stages, layout=layout))
        if first == last:
            return None
        ranks = self.device_mesh.mesh.reshape(pp, -1)
        mine = None
        for column in range(ranks.shape[1]):
            members = sorted({int(ranks[first, column]), int(ranks[last, column])})
            group = dist.new_group(members)
            if dist.get_rank() in members:
                mine = group
        return mine

    @contextlib.contextmanager
    def preparing_models(
        self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
    ) -> Iterator[None]:
        """After ``prepare`` cut the models, ``optimizers`` hold the parameters this process's stages hold (under
        any of the names a parameter had: a tied head's, on the stage without the embedding) and no others."""
        names: dict[int, list[str]] = {}  # every name of each parameter of the whole models
        owners: dict[int, int] = {}
        for model in models:
            for name, parameter in unwrap_module(model).named_parameters(remove_duplicate=False):
                names.setdefault(id(parameter), []).append(name)
                owners[id(parameter)] = id(model)
        yield
        held = {
            key: dict(pipelined.module.named_parameters(remove_duplicate=False))
            for key, pipelined in self._pipelined.items()
        }
        for optimizer in optimizers:
            if optimizer.state and any(id(p) in names for group in optimizer.param_groups for p in group["params"]):
                raise ValueError(
                    "prepare() cuts the model into pipeline stages, but this optimizer has already stepped on the "
                    "whole model's parameters; build the optimizer fresh and prepare it together with the model."
                )
            self._whole_order[id(optimizer)] = [
                names.get(id(parameter), []) for group in optimizer.param_groups for parameter in group["params"]
            ]
            for group in optimizer.param_groups:
                kept: dict[int, nn.Parameter] = {}
                for parameter in group["params"]:
                    if id(parameter) not in names:
                        kept[id(parameter)] = parameter  # not a prepared model's: left as it is
                        continue
                    stage = held[owners[id(parameter)]]
                    for name in names[id(parameter)]:
                        if name in stage:
                            kept.setdefault(id(stage[name]), stage[name])
                group["params"] = list(kept.values())

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for view in getattr(model, "views", {}).values():
            stack.enter_context(_no_gradient_sync(view))
        return stack

    # ------------------------------------------------------------------------------------------------ gradients
    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the whole model's gradients: this process's stages' norm, combined over the pipeline
        (each tied weight counted once, at its canonical end)."""
        import torch.distributed as dist

        parameters = [p for p in parameters if p.grad is not None]
        aliases = frozenset().union(*(pipelined.alias_ids for pipelined in self._pipelined.values()))
        counted = [p.grad for p in parameters if id(p) not in aliases]
        norm = torch.nn.utils.get_total_norm(counted, norm_type) if counted else torch.zeros((), device=self.env.device)
        norm = self.total_norm(norm).to(self.env.device, torch.float32)
        group = self.pp_mesh.get_group()
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        else:
            norm = norm**norm_type
            dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
            norm = norm ** (1.0 / norm_type)
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm

    # ---------------------------------------------------------------------------------------------- whole state
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state on rank 0's CPU, gathered from every stage (a collective; {} elsewhere)."""
        state = self._gather_whole(model, everywhere=False)
        return state if self.env.rank == 0 else {}

    def whole_model(self, model: PipelinedModel) -> nn.Module:
        """The whole model on every process (a collective): what ``unwrap_model`` returns under pipelining."""
        return model.whole(self._gather_whole(model, everywhere=True))

    def _gather_whole(self, model: nn.Module, *, everywhere: bool) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        pipelined = model if isinstance(model, PipelinedModel) else self._pipelined_of(model)
        local = {}
        for name, tensor in pipelined.module.state_dict().items():
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()  # a collective over the stage's data-parallel and tensor dimensions
            local[name] = tensor.detach().cpu()
        group = self.pp_mesh.get_group()
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        state: dict[str, torch.Tensor] = {}
        for part in parts:
            state.update(part)
        for alias, canonical in pipelined.plan.tied.items():
            if canonical in state:
                state[alias] = state[canonical]  # one tensor again, as in the whole model
        return state

    def _pipelined_of(self, module: nn.Module) -> PipelinedModel:
        for pipelined in self._pipelined.values():
            if pipelined.module is module:
                return pipelined
        raise ValueError("This model was not prepared under pipeline parallelism by this Accelerator.")

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_model_state(
        self,
        folder: CheckpointWriter,
        models: Sequence[nn.Module],
        optimizers: Sequence[Any],
        *,
        weights: Sequence[dict[str, torch.Tensor]] | None,
        rank: int,
    ) -> None:
        """Every process writes its stages' state under the model's names (DCP); optimizers flattened by name."""
        modules = [unwrap_module(model) for model in models]
        aliases = self._alias_names(modules)
        sharded_state.save_sharded(folder, modules, optimizers, indexed_name, flatten=True, aliases=aliases)

    def check_load(self, checkpoint: CheckpointReader) -> None:
        pass  # sharded states load by name; whole ones (one process's, DDP's) are cut to the stages as they load

    def load_model_state(
        self, checkpoint: CheckpointReader, models: Sequence[nn.Module], optimizers: Sequence[Any]
    ) -> None:
        modules = [unwrap_module(model) for model in models]
        if checkpoint.state_format == "dcp":
            load_sharded_state(checkpoint, modules, optimizers, aliases=self._alias_names(modules))
            return
        for i, module in enumerate(modules):
            name = indexed_name(MODEL_NAME, i, ".safetensors")
            with refused_unless_it_fits(checkpoint.path / name):
                sharded_state.load_model(self._stage_weights(checkpoint.load_tensors(name), module), module)
        for i, optimizer in enumerate(optimizers):
            saved = load_optimizer_file(checkpoint, i)
            with refused_unless_it_fits(checkpoint.path / indexed_name(OPTIMIZER_NAME, i, ".bin")):
                state = self._stage_optimizer_state(saved, optimizer.optimizer, owner_of(optimizer.optimizer, modules))
                sharded_state.load_optimizer(state, optimizer, modules)

    def _stage_weights(self, saved: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's ``saved`` weights this rank module holds (a tied weight stored once, under either
        name).

        Raises:
            KeyError: One of them is not saved.
        """
        tied = self._pipelined_of(module).plan.tied
        other = {**tied, **{canonical: alias for alias, canonical in tied.items()}}
        weights = {}
        for name in module.state_dict():
            key = name if name in saved else other.get(name)
            if key not in saved:
                raise KeyError(f"missing key {name}")
            weights[name] = saved[key]
        return weights

    def _stage_optimizer_state(self, saved: dict, optimizer: torch.optim.Optimizer, module: nn.Module) -> dict:
        """A whole optimizer state (its parameters by index over the whole model's optimizer, or by name) as the
        full state dict of this stage's optimizer, by the rank module's parameter names.

        Raises:
            ValueError: Its parameter groups are not the optimizer's.
        """
        order = self._whole_order[id(optimizer)]
        whole_index = {name: index for index, names in enumerate(order) for name in names}
        by_name = isinstance(next(iter(saved["state"]), 0), str)  # FSDP's full state keys by name
        fqn = {id(parameter): name for name, parameter in module.named_parameters()}
        if len(saved["param_groups"]) != len(optimizer.param_groups):
            raise ValueError(
                f"the saved optimizer has {len(saved['param_groups'])} parameter groups and this one "
                f"{len(optimizer.param_groups)}"
            )
        state, groups = {}, []
        for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
            names = [fqn[id(parameter)] for parameter in group["params"]]
            for name in names:
                whole = order[whole_index[name]]
                key = next((n for n in whole if n in saved["state"]), None) if by_name else whole_index[name]
                if key in saved["state"]:
                    state[name] = saved["state"][key]
            groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": names})
        return {"state": state, "param_groups": groups}

    def _alias_names(self, modules: Sequence[nn.Module]) -> dict[str, str]:
        """Tied parameters held here only by their alias: alias -> canonical name, the optimizer state's key."""
        aliases = {}
        for module in modules:
            pipelined = self._pipelined_of(module)
            held = dict(module.named_parameters(remove_duplicate=False))
            for alias, canonical in pipelined.plan.tied.items():
                if alias in held and canonical not in held:
                    aliases[alias] = canonical
        return aliases


def _untie_across_stages(module: nn.Module, plan: PipelinePlan, units, held: Sequence[int]) -> None:
    """Give a tied weight's alias its own tensor where its two ends are in different stages of this process (each
    stage's backward then fills its own gradient, summed on the syncing step as across processes)."""
    stage_of = {unit: index for index in held for unit in units[index]}
    params = dict(module.named_parameters(remove_duplicate=False))
    for alias, canonical in plan.tied.items():
        if alias not in params or canonical not in params or params[alias] is not params[canonical]:
            continue
        alias_unit = next(unit for unit in plan.units if alias.startswith(unit + "."))
        canonical_unit = next(unit for unit in plan.units if canonical.startswith(unit + "."))
        if stage_of.get(alias_unit) == stage_of.get(canonical_unit):
            continue
        *path, leaf = alias.split(".")
        owner = module.get_submodule(".".join(path))
        setattr(owner, leaf, nn.Parameter(params[canonical].detach().clone(), params[canonical].requires_grad))


def _to_meta(model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``model`` moved to the meta device in place (its memory freed: the stages hold copies of their parts), and its
    non-persistent buffers, kept aside (the whole model rebuilt from it needs their values)."""
    persistent = set(model.state_dict())
    buffers = {
        name: buffer.detach().cpu().clone()
        for name, buffer in model.named_buffers()
        if name not in persistent and buffer is not None
    }
    return model.to("meta"), buffers
