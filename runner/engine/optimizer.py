"""Optimizer and scheduler wrappers that know about gradient accumulation and loss scaling.

One :class:`GradientState` belongs to one Accelerator and is shared with the loaders, optimizers and
schedulers it prepared: the loader says when an epoch ends, ``accumulate`` says whether this
micro-step syncs, and the optimizer and scheduler act only on the steps that sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MethodType
from typing import Any

import torch


@dataclass
class GradientAccumulationPlugin:
    """Gradient accumulation settings (Accelerate's names).

    Args:
        num_steps: Micro-steps per optimizer step.
        sync_with_dataloader: Also sync (and step) at the last batch of the dataloader, so an epoch
            never ends with gradients pending.
        sync_each_batch: Communicate gradients on every micro-step (the optimizer still steps every
            ``num_steps``). Costs bandwidth, saves memory under FSDP, where unsynced gradients are
            kept unsharded.
    """

    num_steps: int = 1
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


class GradientState:
    """Accumulation bookkeeping of one Accelerator."""

    def __init__(self, plugin: GradientAccumulationPlugin) -> None:
        if plugin.num_steps < 1:
            raise ValueError(f"gradient_accumulation_steps={plugin.num_steps} must be at least 1.")
        self.num_steps = plugin.num_steps
        self.sync_with_dataloader = plugin.sync_with_dataloader
        self.sync_each_batch = plugin.sync_each_batch
        self.sync_gradients = True
        self.step = 0
        # Loaders being iterated, innermost last: an eval loop inside a training epoch must not
        # make the training loader look finished.
        self._active_loaders: list = []

    def activate(self, loader) -> None:
        self.deactivate(loader)
        self._active_loaders.append(loader)

    def deactivate(self, loader) -> None:
        self._active_loaders = [active for active in self._active_loaders if active is not loader]

    @property
    def active_dataloader(self):
        """The innermost prepared loader being iterated, or None (Accelerate's name)."""
        return self._active_loaders[-1] if self._active_loaders else None

    @property
    def in_dataloader(self) -> bool:
        """Whether a prepared loader is being iterated."""
        return bool(self._active_loaders)

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the innermost loader being iterated has yielded its last batch."""
        return bool(self._active_loaders) and self._active_loaders[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        """Real samples in the padded last global batch of the innermost loader, or -1."""
        return self._active_loaders[-1].remainder if self._active_loaders else -1

    def advance(self) -> None:
        """Decide whether the micro-step about to run syncs gradients."""
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step = 0
            self.sync_gradients = True
            return
        self.step += 1
        self.sync_gradients = self.step % self.num_steps == 0


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so ``step`` and ``zero_grad`` act only on syncing micro-steps.

    Under fp16, ``step`` goes through the loss scaler; ``step_was_skipped`` then tells whether the
    scaler found inf/NaN gradients and skipped the update.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        gradient_state: GradientState,
        scaler: torch.amp.GradScaler | None = None,
        sharded_gradients: bool = False,
    ) -> None:
        """
        Args:
            sharded_gradients: Each process holds a shard of the gradients (FSDP, tensor parallelism): an
                inf/NaN in one shard must skip the step on every process, so the scaler's verdicts are
                all-reduced (the DTensor check torch runs reduces only over the placements of the first
                gradient it sees, which misses the others' when a replicated one comes first).
        """
        # Deliberately not calling Optimizer.__init__: this object is a view on `optimizer`.
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self.sharded_gradients = sharded_gradients
        self.unscaled = False
        self.steps = 0  # optimizer steps taken or skipped by the scaler: one per syncing step() call
        self._step_was_skipped = False
        self._inner_step_called = False
        if scaler is not None:
            self._count_inner_steps()

    def _count_inner_steps(self) -> None:
        # GradScaler.step calls optimizer.step only when the gradients are finite. Observing that
        # call tells us about a skipped step without reading the scale back from the device.
        inner_step = self.optimizer.step

        def counted_step(opt, *args, **kwargs):
            self._inner_step_called = True
            return inner_step(*args, **kwargs)

        # An LR scheduler built before prepare() marked the step it wrapped; keep the mark, or torch
        # warns that optimizer.step was overridden after the scheduler was created.
        if hasattr(inner_step, "_wrapped_by_lr_sched"):
            counted_step._wrapped_by_lr_sched = True
        self.optimizer.step = MethodType(counted_step, self.optimizer)

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_gradients(self) -> None:
        """Divide the gradients by the loss scale, once per step (before clipping)."""
        if self.scaler is not None and not self.unscaled:
            self.scaler.unscale_(self.optimizer)
            self.unscaled = True
            if self.sharded_gradients:
                self._agree_on_overflow()

    def _agree_on_overflow(self) -> None:
        import torch.distributed as dist

        found = self.scaler._per_optimizer_states[id(self.optimizer)]["found_inf_per_device"]
        for verdict in found.values():  # one per device: the same number of tensors on every process
            dist.all_reduce(verdict, op=dist.ReduceOp.MAX)

    def step(self, closure=None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        self.steps += 1
        if self.scaler is None:
            self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            self._step_was_skipped = False
            return
        self._inner_step_called = False
        self.unscale_gradients()  # every process's verdict on inf/NaN gradients, before the scaler acts on it
        self.scaler.step(self.optimizer, closure) if closure is not None else self.scaler.step(self.optimizer)
        self.scaler.update()
        self.unscaled = False
        self._step_was_skipped = not self._inner_step_called

    def train(self) -> None:
        """Put the wrapped optimizer in train mode, if it has modes (schedule-free optimizers do); else nothing.

        A schedule-free optimizer (``schedulefree.AdamWScheduleFree``, ...) keeps two points per parameter
        and moves the model's parameters between them: to the point the gradients are taken at in train
        mode, to the averaged weights in eval mode. Its ``step`` refuses to run in eval mode.

        Example:
            >>> model.train()
            >>> optimizer.train()  # before the training loop
        """
        self._switch_mode("train")

    def eval(self) -> None:
        """Put the wrapped optimizer in eval mode, if it has modes (see :meth:`train`); else nothing.

        Example:
            >>> model.eval()
            >>> optimizer.eval()  # before evaluating, or saving the model's weights
        """
        self._switch_mode("eval")

    def _switch_mode(self, mode: str) -> None:
        switch = getattr(self.optimizer, mode, None)
        if callable(switch):
            switch()

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last ``step`` was skipped because of inf/NaN gradients under fp16."""
        return self._step_was_skipped

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"

    # Optimizer's own pickling expects the attributes its __init__ sets, which this view never calls.
    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)


class AcceleratedScheduler:
    """Wraps an LR scheduler so it steps only when its optimizer really stepped.

    With ``step_with_optimizer`` (the default) ``scheduler.step()`` steps it only after a real optimizer
    step: not on a micro-step of accumulation, nor after a step the loss scaler skipped. Following
    Accelerate's convention, a schedule counts batches of one process: without ``split_batches`` each
    optimizer step consumed ``num_processes`` such batches, so the scheduler advances ``num_processes``
    times. With ``per_optimizer_step`` it advances once, whatever the number of processes: a schedule
    measured in optimizer steps, as Lightning's and torchtitan's are. Set
    ``step_scheduler_with_optimizer=False`` to step it yourself on every call.
    """

    def __init__(
        self,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        optimizers: list[AcceleratedOptimizer],
        gradient_state: GradientState,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
        num_processes: int = 1,
        per_optimizer_step: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.steps_per_call = 1 if split_batches or per_optimizer_step else num_processes
        # OneCycleLR raises past its total_steps; stepping stops there instead.
        self._total_steps = getattr(scheduler, "total_steps", None)

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        for optimizer in self.optimizers:
            if optimizer._step_was_skipped:
                return
        for _ in range(self.steps_per_call):
            if self._total_steps is not None and self.scheduler.last_epoch >= self._total_steps:
                return
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self) -> list[float]:
        return self.scheduler.get_lr()

    def __getattr__(self, name: str) -> Any:
        # Everything else (last_epoch, base_lrs, ...) reads through to the wrapped scheduler.
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
