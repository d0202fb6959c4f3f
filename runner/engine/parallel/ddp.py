"""DistributedDataParallel: every rank holds the whole model; gradients are averaged in backward."""

from __future__ import annotations

import contextlib
import enum
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from runner.engine.distributed import DistributedEnvironment
from runner.engine.parallel.base import ReplicatedModelStrategy


class DDPCommunicationHookType(str, enum.Enum):
    """How DDP communicates gradients instead of a plain fp32 all-reduce (Accelerate's names and values)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


_HOOKS = {
    DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
    DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook,
    DDPCommunicationHookType.POWER_SGD: powerSGD_hook.powerSGD_hook,
    DDPCommunicationHookType.BATCHED_POWER_SGD: powerSGD_hook.batched_powerSGD_hook,
}
_WRAPPERS = {
    DDPCommunicationHookType.FP16: default_hooks.fp16_compress_wrapper,
    DDPCommunicationHookType.BF16: default_hooks.bf16_compress_wrapper,
}
_POWER_SGD_HOOKS = (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD)
# The keyword arguments of PowerSGDState but its process group, which is always DDP's (the default group).
_POWER_SGD_OPTIONS = tuple(inspect.signature(powerSGD_hook.PowerSGDState).parameters)[1:]
# Fields that configure the hook registered after wrapping, not DistributedDataParallel(...) itself.
_COMM_HOOK_FIELDS = ("comm_hook", "comm_wrapper", "comm_state_option")


def _hook_type(key: str, value, allowed) -> DDPCommunicationHookType:
    """``value`` (a member or its string) as a member of ``allowed``; a ValueError naming ``key`` otherwise."""
    try:
        member = DDPCommunicationHookType(value)
    except (ValueError, TypeError):
        member = None
    if member not in allowed:
        choices = ", ".join(repr(m.value) for m in allowed)
        raise ValueError(f"{key}={value!r} is not supported; use one of {choices}.")
    return member


@dataclass
class DistributedDataParallelKwargs:
    """Options for wrapping a model in ``DistributedDataParallel`` (Accelerate's names and torch's defaults).

    The first seven fields go to ``DistributedDataParallel(...)`` unchanged (see torch's documentation).
    The ``comm_*`` fields pick a communication hook from ``torch.distributed.algorithms.ddp_comm_hooks``,
    registered on the model right after it is wrapped, which replaces the fp32 all-reduce of the
    gradients; every rank still ends the backward with the same gradients.

    Args:
        comm_hook: ``"fp16"`` / ``"bf16"`` all-reduce the gradients cast to that dtype (half the
            traffic, rounded gradients); ``"power_sgd"`` / ``"batched_power_sgd"`` send a low-rank
            approximation of each gradient matrix (of each whole bucket, for the batched one) once
            ``start_powerSGD_iter`` backwards have run with a plain all-reduce; ``"no"`` (default)
            registers nothing. A string or a ``DDPCommunicationHookType``.
        comm_wrapper: ``"fp16"`` / ``"bf16"`` casts the gradients a PowerSGD hook communicates to
            that dtype; ``"no"`` (default) leaves them in their own dtype.
        comm_state_option: Keyword arguments of torch's ``PowerSGDState`` for a PowerSGD hook, such as
            ``matrix_approximation_rank`` and ``start_powerSGD_iter`` (1000 by default).

    Two limits of torch's hooks (2.13): it registers the bf16 hook or wrapper only on a build with
    CUDA and NCCL 2.10+ (or XPU), even where gloo runs it; and ``batched_powerSGD_hook`` raises an
    AssertionError at its first compressed backward, so prefer ``"power_sgd"``.

    Raises:
        ValueError: A hook name that is not one of the enum's values, a wrapper other than fp16/bf16,
            a wrapper or state options without a PowerSGD hook, or an option ``PowerSGDState`` lacks.

    Example::

        from runner.engine import Accelerator, DistributedDataParallelKwargs

        kwargs = DistributedDataParallelKwargs(
            comm_hook="power_sgd", comm_wrapper="fp16", comm_state_option={"matrix_approximation_rank": 2}
        )
        accelerator = Accelerator(kwargs_handlers=[kwargs])
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = _hook_type("comm_hook", self.comm_hook, tuple(DDPCommunicationHookType))
        self.comm_wrapper = _hook_type("comm_wrapper", self.comm_wrapper, (DDPCommunicationHookType.NO, *_WRAPPERS))
        uses_power_sgd = self.comm_hook in _POWER_SGD_HOOKS
        # Accelerate ignores both here; a setting that silently does nothing is a mistake to report.
        if self.comm_wrapper is not DDPCommunicationHookType.NO and not uses_power_sgd:
            raise ValueError(
                f"comm_wrapper={self.comm_wrapper.value!r} wraps a PowerSGD hook, but comm_hook is "
                f"{self.comm_hook.value!r}; set comm_hook to 'power_sgd' or 'batched_power_sgd', or comm_wrapper "
                "to 'no'."
            )
        if self.comm_state_option and not uses_power_sgd:
            raise ValueError(
                f"comm_state_option configures a PowerSGD hook, but comm_hook is {self.comm_hook.value!r}; set "
                "comm_hook to 'power_sgd' or 'batched_power_sgd', or leave comm_state_option empty."
            )
        unknown = sorted(set(self.comm_state_option) - set(_POWER_SGD_OPTIONS))
        if unknown:
            raise ValueError(
                f"comm_state_option has {', '.join(map(repr, unknown))}, which PowerSGDState does not take; "
                f"use {', '.join(_POWER_SGD_OPTIONS)}."
            )

    def to_kwargs(self) -> dict:
        """The ``DistributedDataParallel(...)`` options that differ from torch's defaults (no hook fields)."""
        default = type(self)()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in _COMM_HOOK_FIELDS and getattr(self, f.name) != getattr(default, f.name)
        }

    def register_comm_hook(self, model: DistributedDataParallel) -> None:
        """Register the hook ``comm_hook`` names, wrapped in ``comm_wrapper``, on a DDP ``model``; none for ``"no"``.

        Call it once per model, before its first backward (DDP accepts one hook per model).
        """
        if self.comm_hook is DDPCommunicationHookType.NO:
            return
        hook = _HOOKS[self.comm_hook]
        if self.comm_wrapper is not DDPCommunicationHookType.NO:
            hook = _WRAPPERS[self.comm_wrapper](hook)
        # PowerSGD keeps per-model state (the iteration count, error feedback); fp16/bf16 take the process group.
        state = None
        if self.comm_hook in _POWER_SGD_HOOKS:
            state = powerSGD_hook.PowerSGDState(process_group=None, **self.comm_state_option)
        model.register_comm_hook(state, hook)


class DDPStrategy(ReplicatedModelStrategy):
    name = "ddp"

    def __init__(self, env: DistributedEnvironment, kwargs: DistributedDataParallelKwargs) -> None:
        self.env = env
        self.kwargs = kwargs

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # DDP refuses modules without trainable parameters (an eval-only model).
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **self.kwargs.to_kwargs())
        self.kwargs.register_comm_hook(wrapped)
        return wrapped

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()


@contextlib.contextmanager
def sync_in_next_backward(model: nn.Module) -> Iterator[None]:
    """Make the backward inside all-reduce a DDP ``model``'s gradients, even after a forward under ``no_sync``.

    DDP decides in forward whether the coming backward syncs (it arms its reducer there, unless
    ``no_sync``); arming the reducer here, for all parameters, makes the next backward sync what has
    accumulated in ``.grad`` so far. The same DDP internals Accelerate's ``trigger_sync_in_backward``
    sets; anything but a DDP module is left alone.
    """
    if not isinstance(model, DistributedDataParallel):
        yield
        return
    saved = model.require_backward_grad_sync, model.require_forward_param_sync
    model.require_backward_grad_sync = model.require_forward_param_sync = True
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved
