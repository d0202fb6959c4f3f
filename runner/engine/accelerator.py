"""The Accelerator: Accelerate's small set of verbs, delegating to one module per concern.

The class is a front. It holds the state (the process group's facts, precision, strategy, what was prepared) and
its own verbs: ``prepare``, the training step (``backward``, ``accumulate``, clipping, ``autocast``) and the
end. The other verbs come by concern from mixins kept beside the room they drive, each declaring what it reads:
:class:`~runner.engine.processes.ProcessVerbs` (rank and device, collectives, work on some processes only),
:class:`~runner.engine.checkpoint.verbs.CheckpointVerbs` (``save_state``, ``load_state``, a model's weights)
and :class:`~runner.engine.tracking.verbs.TrackingVerbs` (``init_trackers``, ``log``, ``get_tracker``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from runner.engine import distributed, ops
from runner.engine.checkpoint.checkpointer import Checkpointer
from runner.engine.checkpoint.folders import ProjectConfiguration
from runner.engine.checkpoint.verbs import CheckpointVerbs
from runner.engine.constants import MIXED_PRECISION_ENV
from runner.engine.distributed import AcceleratorState, DistributedEnvironment, join_process_group
from runner.engine.kwargs_handlers import sort_kwargs_handlers
from runner.engine.loaders import DataLoaderConfiguration, PreparedDataLoader
from runner.engine.loaders.prepare import prepare_data_loader
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
from runner.engine.parallel.context import group_mean, sequence_sharded
from runner.engine.parallel.pipelined import PipelinedModel
from runner.engine.precision import (
    AutocastKwargs,
    GradScalerKwargs,
    Precision,
    PrecisionType,
    parse_mixed_precision,
    remove_autocast,
)
from runner.engine.processes import ProcessVerbs
from runner.engine.profiling import ProfileKwargs, profiled
from runner.engine.rng import synchronize_rng_states
from runner.engine.tracking import GeneralTracker
from runner.engine.tracking.thread import TrackerThread
from runner.engine.tracking.verbs import TrackingVerbs

_SCHEDULER_TYPES = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_PARAMETER_DTYPES = {PrecisionType.BF16: torch.bfloat16, PrecisionType.FP16: torch.float16}  # FSDP2's param_dtype


class Accelerator(ProcessVerbs, CheckpointVerbs, TrackingVerbs):
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
        step_scheduler_per_optimizer_step: Step them once per optimizer step on any number of processes (a
            schedule in optimizer steps), instead of Accelerate's once per process's batch.
        rng_types: Generators made identical on all ranks at the start of every epoch (rank 0's
            state wins): any of ``"torch"``, ``"cuda"``, ``"python"``, ``"numpy"``, ``"generator"``.
        kwargs_handlers: ``DistributedDataParallelKwargs``, ``GradScalerKwargs``, ``AutocastKwargs``,
            ``InitProcessGroupKwargs`` (the process group's backend, init method and collective timeout),
            ``ProfileKwargs`` (what ``profile()`` records when called without one).
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
        step_scheduler_per_optimizer_step: bool = False,
    ) -> None:
        resolve_math_kernels()  # before any op this process runs on several threads (see runner.engine.numerics)
        handlers = sort_kwargs_handlers(kwargs_handlers)
        env = join_process_group(cpu=cpu, options=handlers.get(distributed.InitProcessGroupKwargs))
        self._set_configurations(project_config, project_dir, dataloader_config, split_batches)
        self.device_placement, self.step_scheduler_with_optimizer = device_placement, step_scheduler_with_optimizer
        self.step_scheduler_per_optimizer_step = step_scheduler_per_optimizer_step
        self.rng_types = list(rng_types) if rng_types is not None else ["generator"]
        self.log_with, self.tracker_process = log_with, tracker_process
        self.profile_handler = handlers.get(ProfileKwargs)
        if mixed_precision is None:  # as set by notebook_launcher(mixed_precision=...)
            mixed_precision = os.environ.get(MIXED_PRECISION_ENV) or None
        precision = parse_mixed_precision(mixed_precision)
        self._precision = Precision(  # here, so that its fp16-on-CPU warning names the caller's line
            precision, env.device, scaler_kwargs=handlers.get(GradScalerKwargs),
            autocast_kwargs=handlers.get(AutocastKwargs),
        )  # fmt: skip
        self.scaler = self._precision.scaler
        plugin = gradient_accumulation_plugin or GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
        self.gradient_state = GradientState(plugin)
        self._set_strategy(env, precision, handlers.get(DistributedDataParallelKwargs), fsdp_plugin, parallelism_config)
        self._forget_prepared()
        self._tracker_thread = TrackerThread([])
        self._checkpointer, self._trigger_set = Checkpointer(), False

    def _set_configurations(
        self,
        project_config: ProjectConfiguration | None,
        project_dir: str | os.PathLike | None,
        dataloader_config: DataLoaderConfiguration | None,
        split_batches: bool,
    ) -> None:
        self.project_configuration = project_config or ProjectConfiguration()
        if project_dir is not None:
            self.project_configuration.set_directories(project_dir)
        self.dataloader_config = dataloader_config or DataLoaderConfiguration()
        if split_batches:
            self.dataloader_config.split_batches = True

    def _set_strategy(
        self,
        env: DistributedEnvironment,
        precision: PrecisionType,
        ddp_kwargs: DistributedDataParallelKwargs | None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None,
        parallelism_config: ParallelismConfig | None,
    ) -> None:
        self._strategy = select_strategy(
            env, ddp_kwargs=ddp_kwargs, fsdp_plugin=fsdp_plugin, param_dtype=_PARAMETER_DTYPES.get(precision),
            parallelism_config=parallelism_config, precision=self._precision,
        )  # fmt: skip
        self.parallelism_config = None if parallelism_config is None else parallelism_config.resolve(env.world_size)
        # Built last: it reports the strategy and precision chosen above. Each Accelerator has its own.
        self.state = AcceleratorState.of(
            env, fsdp=self._strategy.name == "fsdp", mixed_precision=precision.value, debug=ops.is_debug_mode()
        )

    def _forget_prepared(self) -> None:
        self._models: list[nn.Module] = []
        self._optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[AcceleratedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        self._custom_objects: list[Any] = []

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
            per_optimizer_step=self.step_scheduler_per_optimizer_step,
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
            broadcast_seed=ops.rank_zero_value,
            share=ops.rank_zero_value,
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

    def forward_backward(
        self,
        model: nn.Module,
        *args: Any,
        target: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        **kwargs: Any,
    ) -> torch.Tensor:
        """One micro-step's forward and backward: ``loss = loss_fn(model(*args, **kwargs), target)``, then
        :meth:`backward`; returns the loss, detached.

        Under pipeline parallelism the same call is one step of the pipeline's schedule (torch's ``schedule.step``):
        the batch is split into ``pp_microbatches`` micro-batches whose forwards and backwards the stages run in the
        schedule's order; the first stage reads ``args`` and ``kwargs``, the last compares its outputs with
        ``target``, each micro-batch's loss counting ``1 / pp_microbatches`` of the batch's (so ``loss_fn`` should
        average over its rows, as the usual losses do). The loss returned, the batch's mean, is the same on every
        stage. Accumulation works as without pipelining (``accumulate`` around it); clip with
        :meth:`clip_grad_norm_`, which takes the norm across the stages.

        Under context parallelism (``cp_size > 1``) the batch's sequences, and the positions the model is given
        (``positions=`` or ``position_ids=``), are split across the ``cp`` processes for the step
        (:mod:`runner.engine.parallel.context`); the loss returned is the group's mean.

        Example:
            >>> with accelerator.accumulate(model):
            ...     loss = accelerator.forward_backward(model, inputs, target=targets, loss_fn=F.cross_entropy)
            ...     optimizer.step()
            ...     optimizer.zero_grad()
        """
        config = self.parallelism_config
        if config is not None and config.cp_enabled and self.use_distributed:
            mesh = self.torch_device_mesh["cp"]
            with sequence_sharded(mesh, model, args, kwargs, target) as sharded:
                loss = loss_fn(model(*args, **sharded), target)
                self.backward(loss)
            return group_mean(loss, mesh)
        if isinstance(model, PipelinedModel):
            factor = torch.ones((), device=self.device) / self.gradient_state.num_steps
            if self.scaler is not None:
                factor = self.scaler.scale(factor)
            loss = model.step(args, kwargs, target, loss_fn, scale=factor)
            if self.sync_gradients:
                model.sum_tied_gradients()
            return loss
        loss = loss_fn(model(*args, **kwargs), target)
        self.backward(loss)
        return loss.detach()

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
        return self._strategy.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value: float) -> None:
        """Clamp every gradient to ``[-clip_value, clip_value]``, after unscaling under fp16."""
        if not self.sync_gradients:
            return
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ------------------------------------------------------------------------------------- profiling
    def profile(self, profile_handler: ProfileKwargs | None = None) -> contextlib.AbstractContextManager:
        """Profile the block with ``torch.profiler`` and yield the profiler; with ``output_trace_dir``, each process
        writes its Chrome trace there on leaving (see :func:`runner.engine.profiling.profiled`).

        Args:
            profile_handler: The settings for this call; None takes the ``ProfileKwargs`` given in
                ``kwargs_handlers``, or the defaults (every supported activity, no schedule).
        """
        handler = profile_handler or self.profile_handler or ProfileKwargs()
        return profiled(handler, process_index=self.process_index, wait_for_everyone=self.wait_for_everyone)

    # ---------------------------------------------------------------------------------------- models
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True) -> nn.Module:
        """The original module inside a prepared one (without the autocast forward, if asked).

        Under pipeline parallelism that is the whole model, built anew on every process from every stage's weights:
        a collective, which every process calls (as ``get_state_dict``).
        """
        module = self._strategy.whole_model(model) if isinstance(model, PipelinedModel) else unwrap_module(model)
        return module if keep_fp32_wrapper else remove_autocast(module)

    # --------------------------------------------------------------------------------------- the end
    def end_training(self) -> None:
        """Wait for a pending checkpoint commit and for the trackers to take everything logged, close them,
        free the host memory asynchronous saves keep for their copies, and wait for every process."""
        self._checkpointer.release()
        self._tracker_thread.close()
        self.wait_for_everyone()

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop references to everything prepared, collect garbage, and release cached GPU memory."""
        self._forget_prepared()
        release_memory()
        return [None] * len(objects)

    clear = free_memory

    def __repr__(self) -> str:
        return (
            f"Accelerator(distributed_type={self.distributed_type.value}, num_processes={self.num_processes}, "
            f"process_index={self.process_index}, device={self.device}, mixed_precision={self.mixed_precision})"
        )
