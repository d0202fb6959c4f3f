"""DistributedDataParallel: every rank holds the whole model; gradients are averaged in backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, fields

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from runner.engine.distributed import DistributedEnvironment
from runner.engine.parallel.base import ReplicatedModelStrategy


@dataclass
class DistributedDataParallelKwargs:
    """Options handed to ``DistributedDataParallel`` (Accelerate's names and torch's defaults).

    Pass it as ``Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)])``.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def to_kwargs(self) -> dict:
        """The options that differ from torch's defaults."""
        default = type(self)()
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)
        }


class DDPStrategy(ReplicatedModelStrategy):
    name = "ddp"

    def __init__(self, env: DistributedEnvironment, kwargs: DistributedDataParallelKwargs) -> None:
        self.env = env
        self.kwargs = kwargs

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # DDP refuses modules without trainable parameters (an eval-only model).
        device_ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, **self.kwargs.to_kwargs())

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
