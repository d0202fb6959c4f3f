"""The Accelerator: Accelerate's small set of verbs, delegating to one module per concern."""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms import Join
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from runner.engine import ops
from runner.engine.checkpoint.checkpointer import Checkpointer, is_stateful
from runner.engine.checkpoint.folders import ProjectConfiguration
from runner.engine.checkpoint.serialization import save_model_files, save_safetensors
from runner.engine.constants import MIXED_PRECISION_ENV
from runner.engine.data import DataLoaderConfiguration, PreparedDataLoader
from runner.engine.data.loaders import prepare_data_loader
from runner.engine.distributed import AcceleratorState, DistributedType, barrier, init_process_group, read_environment
from runner.engine.memory import release_memory
from runner.engine.numerics import resolve_math_kernels
from runner.engine.optimizer import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    GradientAccumulationPlugin,
    GradientState,
)
from runner.engine.parallel import (
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
    select_strategy,
    sync_in_next_backward,
    unwrap_module,
)
from runner.engine.precision import (
    AutocastKwargs,
    GradScalerKwargs,
    Precision,
    PrecisionType,
    parse_mixed_precision,
    remove_autocast,
)
from runner.engine.prepared import PreparedObjects
from runner.engine.rng import synchronize_rng_states
from runner.engine.tracker_process import TrackerProcess
from runner.engine.tracker_process import available as tracker_process_available
from runner.engine.tracker_thread import TrackerThread
from runner.engine.tracking import GeneralTracker, _BlankTracker, build_trackers
from runner.files import write_atomically

_SCHEDULER_TYPES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_KWARGS_HANDLERS = (DistributedDataParallelKwargs, GradScalerKwargs, AutocastKwargs)


def _sort_kwargs_handlers(handlers: list | None) -> dict[type, Any]:
    found: dict[type, Any] = {}
    for handler in handlers or []:
        kind = next((k for k in _KWARGS_HANDLERS if isinstance(handler, k)), None)
        if kind is None:
            raise ValueError(
                f"kwargs_handlers got {type(handler).__name__}; pass DistributedDataParallelKwargs, "
                "GradScalerKwargs or AutocastKwargs."
            )
        if kind in found:
            raise ValueError(f"kwargs_handlers holds two {kind.__name__}; pass one.")
        found[kind] = handler
    return found


class Accelerator:
    """Runs a plain PyTorch training loop on one process, or many with DDP or FSDP, in mixed precision.

    Args:
        device_placement: Move prepared models and batches to ``self.device``.
        split_batches: Shortcut for ``DataLoaderConfiguration(split_batches=True)``.
        mixed_precision: ``"no"``, ``"fp16"`` (autocast and loss scaling), ``"bf16"``, or ``"fp8"``.
        gradient_accumulation_steps: Micro-steps per optimizer step inside ``accumulate``.
        cpu: Run on the CPU even when GPUs are visible.
        log_with: Tracker name(s): ``"tensorboard"``, ``"jsonl"``, ``"all"``, or tracker objects.
        project_dir: Folder for checkpoints and logs (shortcut for ``project_config.project_dir``).
        project_config: Checkpoint naming and rotation, see :class:`ProjectConfiguration`.
        dataloader_config: How loaders are sharded, see :class:`DataLoaderConfiguration`.
        step_scheduler_with_optimizer: Step prepared schedulers with the optimizer (see
            :class:`AcceleratedScheduler`); False steps them on every call.
        rng_types: Generators made identical on all ranks at the start of every epoch (rank 0's
            state wins): any of ``"torch"``, ``"cuda"``, ``"python"``, ``"numpy"``, ``"generator"``.
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``, ``AutocastKwargs``.
        gradient_accumulation_plugin: Accumulation settings; overrides ``gradient_accumulation_steps``.
        fsdp_plugin: Shard models with FSDP2 (see :class:`FullyShardedDataParallelPlugin`) instead of DDP.
        parallelism_config: Lay the processes out on an N-D mesh (see :class:`ParallelismConfig`): tensor
            parallelism over ``tp_size`` processes, then FSDP2 over ``dp_shard_size`` (HSDP with
            ``dp_replicate_size``). Loaders, ``gather``, ``gather_for_metrics`` and ``reduce`` then work over
            the data-parallel ranks: the processes of one tensor-parallel group see the same batches.
        tracker_process: Call the trackers in a helper process (on Linux) instead of a thread of this one: a
            logged step then costs the loop microseconds whatever the trackers do, but the library objects
            (``get_tracker(name, unwrap=True)``) live in that process.

    Example:
        >>> accelerator = Accelerator(mixed_precision="bf16")
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> for inputs, targets in loader:
        ...     loss = loss_fn(model(inputs), targets)
        ...     accelerator.backward(loss)
        ...     optimizer.step()
        ...     optimizer.zero_grad()
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = False,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        log_with: str | GeneralTracker | list | None = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        dataloader_config: DataLoaderConfiguration | None = None,
        step_scheduler_with_optimizer: bool = True,
        rng_types: list[str] | None = None,
        kwargs_handlers: list | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        parallelism_config: ParallelismConfig | None = None,
        tracker_process: bool = False,
    ) -> None:
        resolve_math_kernels()  # before any op this process runs on several threads (see runner.engine.numerics)
        env = read_environment(cpu=cpu)
        init_process_group(env)
        handlers = _sort_kwargs_handlers(kwargs_handlers)

        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches:
            self.dataloader_config.split_batches = True
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]
        self.log_with = log_with

        if mixed_precision is None:  # as set by notebook_launcher(mixed_precision=...)
            mixed_precision = os.environ.get(MIXED_PRECISION_ENV) or None
        precision = parse_mixed_precision(mixed_precision)
        self._precision = Precision(
            precision,
            env.device,
            scaler_kwargs=handlers.get(GradScalerKwargs),
            autocast_kwargs=handlers.get(AutocastKwargs),
        )
        self.scaler = self._precision.scaler
        plugin = gradient_accumulation_plugin or GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
        self.gradient_state = GradientState(plugin)
        self._strategy = select_strategy(
            env,
            ddp_kwargs=handlers.get(DistributedDataParallelKwargs),
            fsdp_plugin=fsdp_plugin,
            param_dtype={PrecisionType.BF16: torch.bfloat16, PrecisionType.FP16: torch.float16}.get(precision),
            parallelism_config=parallelism_config,
        )
        self.parallelism_config = None if parallelism_config is None else parallelism_config.resolve(env.world_size)
        # Built last: it reports the strategy and precision chosen above. Each Accelerator has its own.
        self.state = AcceleratorState.of(
            env, fsdp=self._strategy.name == "fsdp", mixed_precision=precision.value, debug=ops.is_debug_mode()
        )

        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list[Any] = []
        self.tracker_process = tracker_process
        self._tracker_thread: TrackerThread | TrackerProcess = TrackerThread([])
        self._checkpointer = Checkpointer()
        self._trigger_set = False

    # ----------------------------------------------------------------------------------- where we run
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def process_index(self) -> int:
        return self.state.rank

    @property
    def local_process_index(self) -> int:
        return self.state.local_rank

    @property
    def num_processes(self) -> int:
        return self.state.world_size

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def torch_device_mesh(self):
        """The ``DeviceMesh`` models are sharded or split on (FSDP2, tensor parallelism), else None.

        With a :class:`ParallelismConfig` its dimensions are ``("dp_replicate", "dp_shard", "tp")``, with the
        flattened ``"dp"`` (every data-parallel rank) among its submeshes; under plain FSDP, ``("dp_shard",)``.
        """
        return getattr(self._strategy, "device_mesh", None)

    @property
    def _data_parallel_size(self) -> int:
        """Processes that read different batches (all of them, unless tensor parallelism groups them)."""
        config = self.parallelism_config
        return self.num_processes if config is None else config.data_parallel_size

    @property
    def _data_parallel_rank(self) -> int:
        config = self.parallelism_config
        return self.process_index if config is None else config.data_parallel_rank(self.process_index)

    @property
    def _data_parallel_group(self):
        """The process group of the data-parallel ranks, where tensor parallelism groups processes; else None."""
        return getattr(self._strategy, "data_parallel_group", None)

    @property
    def use_distributed(self) -> bool:
        return self.state.is_distributed

    @property
    def mixed_precision(self) -> str:
        return self._precision.mode.value

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"gradient_accumulation_steps={steps} must be at least 1.")
        self.gradient_state.num_steps = steps

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether any prepared optimizer skipped its last step (inf/NaN gradients under fp16)."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    # ---------------------------------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Prepare models, optimizers, schedulers and dataloaders; return them in the order given.

        Models go to the device (and into DDP across processes), optimizers and schedulers learn
        about accumulation and loss scaling, dataloaders are sharded across processes. Anything
        else comes back unchanged. Schedulers are prepared after the optimizers they drive.
        """
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects.")
        prepared = list(args)
        # Models first: a strategy that replaces their parameters (FSDP shards them) makes the
        # optimizers built from them hold the new ones before the optimizers are prepared.
        models = [obj for obj in args if isinstance(obj, nn.Module)]
        optimizers = [
            obj for obj in args if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, AcceleratedOptimizer)
        ]
        with self._strategy.preparing_models(models, optimizers):
            for i, (obj, place) in enumerate(zip(args, device_placement, strict=True)):
                if isinstance(obj, nn.Module):
                    prepared[i] = self._prepare_one(obj, device_placement=place)
        for i, (obj, place) in enumerate(zip(args, device_placement, strict=True)):
            if not isinstance(obj, (nn.Module, *_SCHEDULER_TYPES)):
                prepared[i] = self._prepare_one(obj, device_placement=place)
        for i, obj in enumerate(args):
            if isinstance(obj, _SCHEDULER_TYPES):
                prepared[i] = self.prepare_scheduler(obj)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, obj: Any, *, device_placement: bool | None) -> Any:
        if isinstance(obj, nn.Module):
            return self.prepare_model(obj, device_placement=device_placement)
        if isinstance(obj, AcceleratedOptimizer):
            return obj
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj)
        if isinstance(obj, PreparedDataLoader):
            return obj
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj, device_placement=device_placement)
        return obj

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """Place ``model``, run its forward under autocast, and wrap it for the parallel strategy.

        Args:
            evaluation_mode: Inference only: skip the parallel wrapper.
        """
        if device_placement if device_placement is not None else self.device_placement:
            model.to(self.device)
        self._precision.apply(model)
        if not evaluation_mode:
            model = self._strategy.wrap_model(model)
        self._models.append(model)
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
        prepared = AcceleratedOptimizer(
            optimizer,
            gradient_state=self.gradient_state,
            scaler=self.scaler,
            sharded_gradients=self._strategy.name == "fsdp" and self.num_processes > 1,
        )
        self._optimizers.append(prepared)
        return prepared

    def prepare_scheduler(self, scheduler) -> AcceleratedScheduler:
        """Wrap ``scheduler`` so it steps only after its optimizer (prepared before it) really stepped."""
        driving = [opt for opt in self._optimizers if scheduler.optimizer in (opt, opt.optimizer)]
        prepared = AcceleratedScheduler(
            scheduler,
            optimizers=driving or self._optimizers,
            gradient_state=self.gradient_state,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
            num_processes=self._data_parallel_size,
        )
        self._schedulers.append(prepared)
        return prepared

    def prepare_data_loader(self, data_loader: DataLoader, device_placement: bool | None = None) -> PreparedDataLoader:
        place = device_placement if device_placement is not None else self.device_placement
        prepared = prepare_data_loader(
            data_loader,
            device=self.device if place else None,
            num_processes=self._data_parallel_size,
            process_index=self._data_parallel_rank,
            gradient_state=self.gradient_state,
            config=self.dataloader_config,
            broadcast_seed=_rank_zeros,
            share=_rank_zeros,
            on_epoch_start=self._on_epoch_start if self._syncs_rng() else None,
            comm_device=self.device if self.state.backend == "nccl" else torch.device("cpu"),
        )
        self._dataloaders.append(prepared)
        return prepared

    def _syncs_rng(self) -> bool:
        return self.use_distributed and any(kind != "generator" for kind in self.rng_types)

    def _on_epoch_start(self) -> None:
        synchronize_rng_states(self.rng_types)

    # ------------------------------------------------------------------------------- the training step
    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward()``, divided by the accumulation steps and scaled under fp16."""
        if self.gradient_state.num_steps > 1:
            loss = loss / self.gradient_state.num_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-step of gradient accumulation.

        Gradients sync (and prepared optimizers step) every ``gradient_accumulation_steps``
        micro-steps and at the last batch of the loader; in between, backward runs under the
        strategy's ``no_sync`` so nothing is communicated (unless the plugin's ``sync_each_batch``).
        """
        self.gradient_state.advance()
        if self.gradient_state.sync_gradients or self.gradient_state.sync_each_batch:
            yield
            return
        with contextlib.ExitStack() as stack:
            for model in models:
                stack.enter_context(self._strategy.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation for the backward passes inside (DDP's ``no_sync``)."""
        with self._strategy.no_sync(model):
            yield

    @staticmethod
    def trigger_sync_in_backward(model: nn.Module) -> contextlib.AbstractContextManager:
        """Make the backward inside sync a DDP model's gradients, though its forward ran under ``no_sync``.

        Gradients accumulated in ``.grad`` by earlier unsynced backwards are synced with it. For any
        other model (one process, FSDP) it does nothing, as in Accelerate.

        Example:
            >>> with accelerator.no_sync(model):
            ...     loss_a, loss_b = loss_fn(model(input_a)), loss_fn(model(input_b))
            >>> accelerator.backward(loss_a)  # accumulates locally
            >>> with accelerator.trigger_sync_in_backward(model):
            ...     accelerator.backward(loss_b)  # syncs both across processes
        """
        return sync_in_next_backward(model)

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Autocast for code outside the prepared model's forward (a no-op without mixed precision)."""
        if autocast_handler is not None and not autocast_handler.enabled:
            return contextlib.nullcontext()
        return self._precision.autocast()

    def unscale_gradients(self, optimizer: AcceleratedOptimizer | None = None) -> None:
        """Divide gradients by the fp16 loss scale (done for you by the clip methods)."""
        for opt in [optimizer] if optimizer is not None else self._optimizers:
            opt.unscale_gradients()

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor | None:
        """Clip the gradients' total norm, after unscaling under fp16.

        Clipping applies to the whole accumulated gradient, so on micro-steps that do not sync it
        does nothing and returns None.

        Returns:
            The total norm of the gradients before clipping.
        """
        if not self.sync_gradients:
            return None
        self.unscale_gradients()
        return self._strategy.total_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``, after unscaling under fp16."""
        if not self.sync_gradients:
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ------------------------------------------------------------------------------------ collectives
    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or a nest of them) from all processes along dim 0, detached from autograd.

        Example:
            >>> losses = accelerator.gather(loss)  # works on a loss that requires grad; the result does not
        """
        return ops.gather(tensor, group=self._data_parallel_group)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: like ``gather``, without the samples that padded the last batch.

        Over a full pass of a prepared loader, the results concatenate to exactly one entry per
        sample of the dataset. Non-tensor data (or ``use_gather_object=True``) is gathered as a
        list of picklable objects.
        """
        is_tensors = ops.is_tensor_nest(input_data)
        group = self._data_parallel_group
        if is_tensors and not use_gather_object:
            data = ops.gather(input_data, group=group)
        else:
            data = ops.gather_object(input_data, group=group)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder > 0:
            data = ops.truncate(data, remainder) if is_tensors and not use_gather_object else data[:remainder]
        return data

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return ops.pad_across_processes(
            tensor, dim=dim, pad_index=pad_index, pad_first=pad_first, group=self._data_parallel_group
        )

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce ``tensor`` (or a nest of them) over all processes; see :func:`runner.engine.ops.reduce`.

        Args:
            reduction: ``"sum"`` by default here (as ``Accelerator.reduce``; ``utils.reduce`` defaults to
                ``"mean"``), or ``"mean"``, ``"max"``, ``"min"``, ``"none"``.
            scale: A factor applied to the result.

        Raises:
            ValueError: ``reduction`` is not one of those names.
        """
        return ops.reduce(tensor, reduction=reduction, scale=scale, group=self._data_parallel_group)

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        barrier(self.state)

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` then returns True on every process.

        No collective: one rank may call it alone (say, on a NaN loss it alone sees).
        """
        self._trigger_set = True

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check; resets every flag if so.

        A collective (a sum over processes): every process must call it at the same point, and all
        get the same answer, so they can leave a loop together.

        Example:
            >>> if not torch.isfinite(loss):
            ...     accelerator.set_trigger()
            >>> if accelerator.check_trigger():
            ...     break
        """
        flag = torch.tensor(int(self._trigger_set), device=self.device)
        if ops.reduce(flag, reduction="sum").item() == 0:
            return False
        self._trigger_set = False
        return True

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None) -> Iterator[None]:
        """Let processes with fewer batches finish early without hanging the others (torch's ``Join``).

        A process that runs out of batches shadows the collectives of the DDP models in ``joinables``
        until every process has; then the last process to finish sends its weights to the others.
        Under DDP ``Join`` is always on, as in Accelerate (loaders it did not prepare may be uneven
        too). Without DDP (one process, FSDP) it does nothing and warns.

        Args:
            joinables: The prepared DDP models (any ``torch.distributed.algorithms.Joinable``).
            even_batches: Accelerate overrides the prepared loaders' ``even_batches`` with it inside the
                block. Prepared loaders here fix it when prepared, so they keep theirs (with a warning
                where it differs).

        Example:
            >>> accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
            >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            >>> with accelerator.join_uneven_inputs([model]):
            ...     for inputs, targets in loader:  # some ranks get one batch fewer
            ...         accelerator.backward(loss_fn(model(inputs), targets))
            ...         optimizer.step()
            ...         optimizer.zero_grad()
        """
        if self._strategy.name != "ddp":
            where = "FSDP" if self.distributed_type == DistributedType.FSDP else "a single process"
            warnings.warn(
                f"join_uneven_inputs does nothing on {where}: it joins DistributedDataParallel models only.",
                stacklevel=3,
            )
            yield
            return
        loader_settings = {loader.sharding.even_batches for loader in self._dataloaders}
        if even_batches is not None and loader_settings - {even_batches}:
            warnings.warn(
                f"join_uneven_inputs(even_batches={even_batches}) cannot change prepared loaders, which keep the "
                "even_batches they were prepared with; set DataLoaderConfiguration(even_batches=...) instead.",
                stacklevel=3,
            )
        # Always on under DDP, as in Accelerate: a loader this Accelerator did not prepare may be uneven too.
        with Join(joinables, enable=True, throw_on_early_termination=False):
            yield

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first (to download or cache), then on the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each node's main process first, then on the node's other processes."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of ``inputs`` (list, tuple, tensor, or dict of them).

        Example:
            >>> with accelerator.split_between_processes(prompts) as mine:
            ...     outputs = [generate(prompt) for prompt in mine]
        """
        yield ops.split_between_processes(
            inputs,
            num_processes=self._data_parallel_size,
            process_index=self._data_parallel_rank,
            apply_padding=apply_padding,
        )

    def on_main_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on the main process only (elsewhere it returns None)."""
        return _only_when(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on each node's main process only."""
        return _only_when(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on the last process only (the only one, without distribution)."""
        return _only_when(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorate ``function`` to run on process ``process_index`` only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _only_when(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        """Decorate ``function`` to run on local process ``local_process_index`` of each node only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _only_when(function, lambda: self.local_process_index == local_process_index)

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` on the main process only, atomically: a crash leaves the previous file.

        With ``safe_serialization`` ``obj`` must be a dict of tensors, written as safetensors.
        """
        if not self.is_main_process:
            return
        write_atomically(
            f, lambda partial: save_safetensors(obj, partial) if safe_serialization else torch.save(obj, partial)
        )

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    # ---------------------------------------------------------------------------------------- models
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The original module inside a prepared one (without the autocast forward, if asked)."""
        module = unwrap_module(model)
        return module if keep_fp32_wrapper else remove_autocast(module)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict, with the wrappers' prefixes removed.

        Under FSDP it is gathered from every rank to the main process's CPU (the others get an empty
        dict, as in Accelerate), so every process must call it.
        """
        return self._strategy.full_state_dict(model) if unwrap else model.state_dict()

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the model's full weights: ``model.safetensors``, or shards and an index (main process writes;
        under FSDP every process must call it, to gather the shards).

        Example:
            >>> accelerator.save_model(model, "out/model", max_shard_size="1GB")
        """
        state_dict = self.get_state_dict(model)
        if self.is_main_process:
            save_model_files(
                state_dict,
                save_directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )

    # ------------------------------------------------------------------------------------ checkpoints
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (each with ``state_dict``/``load_state_dict``) with the state."""
        invalid = [type(obj).__name__ for obj in objects if not is_stateful(obj)]
        if invalid:
            raise ValueError(
                f"register_for_checkpointing needs objects with state_dict and load_state_dict; got {invalid}."
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` on every process before ``save_state`` writes.

        ``output_dir`` is the checkpoint folder being written (still under its temporary name):
        files the hook writes there become part of the checkpoint. Removing an entry from
        ``weights`` leaves that model out. Returns a handle whose ``remove()`` unregisters it.
        """
        return self._checkpointer.register(self._checkpointer.save_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` on every process before ``load_state`` reads.

        Removing an entry from ``models`` skips loading that model. Returns a removable handle.
        """
        return self._checkpointer.register(self._checkpointer.load_hooks, hook)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """Make the next pass of a prepared loader start after its first ``num_batches`` batches.

        The skipped batches are never loaded. Returns the same loader, for Accelerate's idiom
        ``for batch in accelerator.skip_first_batches(loader, n)``.
        """
        if not isinstance(dataloader, PreparedDataLoader):
            raise ValueError("skip_first_batches needs a loader returned by prepare(); prepare it first.")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        async_commit: bool = False,
        async_save: bool = False,
    ) -> str:
        """Save models, optimizers, schedulers, scaler, RNG states, data position and registered objects.

        With ``automatic_checkpoint_naming`` the folder is ``project_dir/checkpoints/checkpoint_{i}``
        and ``i`` advances after each save (past any folder already there, with a warning: nothing
        is overwritten); ``total_limit`` then keeps the newest checkpoints. The folder appears only
        once complete. Every process must call this. With ``ProjectConfiguration(save_on_each_node=True)``
        each node keeps its own copy, on its own disk (see :mod:`runner.engine.checkpoint.node_local`).

        Args:
            output_dir: The folder to write (ignored under automatic naming). A folder that holds
                anything but a checkpoint is refused, since saving replaces it whole.
            metadata: JSON-able facts to record in the manifest besides the engine's own (step,
                epoch, data position, accumulation, world size, files with sizes and digests).
            async_save: Return once the state is copied to host memory (pinned under CUDA); every
                rank writes and hashes its files, and rank 0 writes the manifest, syncs and commits,
                in background threads while training goes on (FSDP's shards through
                ``torch.distributed.checkpoint.async_save``). See :mod:`runner.engine.checkpoint.async_saves`.
            async_commit: Return once every rank's files are written and hashed; rank 0 writes the
                manifest and commits in a background thread. With either, the folder still appears
                only once complete, and the next ``save_state``, ``load_state``,
                ``wait_for_checkpoint`` or ``end_training`` waits for it (and raises its error on
                every process).

        Returns:
            The checkpoint folder.

        Raises:
            ValueError: No folder was given and naming is not automatic.
            CheckpointError: ``output_dir`` holds something other than a checkpoint.
        """
        target = self._checkpointer.save(
            self._prepared_objects(),
            output_dir,
            project=self.project_configuration,
            metadata=metadata,
            async_commit=async_commit,
            async_save=async_save,
        )
        return str(target)

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint saved with ``async_save`` or ``async_commit`` is committed; raise its error if
        it failed.

        Every process must call this (``save_state``, ``load_state`` and ``end_training`` do). After
        ``async_save`` each process waits for its own background save, and all of them end with the
        same outcome; after ``async_commit`` rank 0 waits for its commit, then tells every rank how it
        went. Either way all of them raise alike.
        """
        self._checkpointer.wait()

    def load_state(self, input_dir: str | os.PathLike | None = None, *, verify_checksums: bool = True) -> None:
        """Restore what :meth:`save_state` saved; every process must call this after ``prepare``.

        Without ``input_dir`` (and with automatic naming) the newest committed checkpoint of
        ``project_dir`` is loaded. After loading ``checkpoint_K`` the next automatic save is
        ``checkpoint_{K+1}``. Every file is checked against the manifest first: its size, and with
        ``verify_checksums`` (the default) the digest of every slice, each hashed once, by one process
        (the processes split the files they all read), before anything is loaded.
        Prepared loaders continue from the saved data position on their next pass.

        Raises:
            CheckpointError: One sentence naming the file that is missing, truncated or corrupted,
                or the keys of a model that does not fit.
        """
        self._checkpointer.load(
            self._prepared_objects(), input_dir, project=self.project_configuration, verify_checksums=verify_checksums
        )

    def _prepared_objects(self) -> PreparedObjects:
        return PreparedObjects(
            env=self.state,
            strategy=self._strategy,
            gradient_state=self.gradient_state,
            models=tuple(self._models),
            optimizers=tuple(self._optimizers),
            schedulers=tuple(self._schedulers),
            dataloaders=tuple(self._dataloaders),
            custom_objects=tuple(self._custom_objects),
            scaler=self.scaler,
        )

    # ---------------------------------------------------------------------------------------- trackers
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the trackers of ``log_with`` and record ``config`` as their hyperparameters.

        Trackers run on the main process, and on every process those whose class sets
        ``main_process_only = False``. ``init_kwargs`` maps a tracker's name to its constructor's keywords.
        A tracker that fails to start is reported in one warning and left out; training goes on.
        """
        built = build_trackers(
            self.log_with, run_name=project_name, logging_dir=self.logging_dir, init_kwargs=init_kwargs, start=False
        )
        mine = [tracker for tracker in built if self.is_main_process or not tracker.main_process_only]
        in_process = self.tracker_process and mine and tracker_process_available()
        self._tracker_thread = TrackerProcess(mine) if in_process else TrackerThread(mine)
        self._tracker_thread.call("start")
        if config is not None:
            self._tracker_thread.call("store_init_configuration", config)

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers this process runs (those that failed are gone)."""
        return self._tracker_thread.trackers

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send ``values`` at ``step`` to every tracker of this process (``log_kwargs``: a tracker's name to
        its ``log`` keywords). Returns at once: the trackers are called in order on a background thread,
        with the values as they are now (tensors are read here)."""
        self._tracker_thread.log(values, step, log_kwargs)

    def log_artifact(
        self, local_path: str | os.PathLike, artifact_path: str | None = None, *, trackers: list[str] | None = None
    ) -> None:
        """Keep a file or folder with the tracked run, in the trackers that store files (MLflow, W&B), or in
        those named in ``trackers``. Returns at once, as :meth:`log`."""
        self._tracker_thread.log_artifact(local_path, artifact_path, trackers)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying object with ``unwrap=True``). On a process that runs
        no trackers, a stand-in that does nothing."""
        self._tracker_thread.flush()  # whatever was logged has reached it
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main_process:
            return _BlankTracker(name)
        raise ValueError(f"No tracker named {name!r} was started; trackers: {[t.name for t in self.trackers]}.")

    def end_training(self) -> None:
        """Wait for a pending checkpoint commit and for the trackers to take everything logged, close them,
        free the host memory asynchronous saves keep for their copies, and wait for every process."""
        self._checkpointer.release()
        self._tracker_thread.close()
        self.wait_for_everyone()

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop references to everything prepared, collect garbage, and release cached GPU memory."""
        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self._custom_objects.clear()
        release_memory()
        return [None] * len(objects)

    clear = free_memory

    def __repr__(self) -> str:
        return (
            f"Accelerator(distributed_type={self.distributed_type.value}, num_processes={self.num_processes}, "
            f"process_index={self.process_index}, device={self.device}, mixed_precision={self.mixed_precision})"
        )


def _only_when(function: Callable, condition: Callable[[], bool]) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs) if condition() else None

    return wrapper


def _rank_zeros(value: Any) -> Any:
    """Rank 0's ``value`` on every process (picklable; the value itself on one process)."""
    return ops.broadcast_object_list([value])[0]
