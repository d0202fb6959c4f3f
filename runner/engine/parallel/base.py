"""The interface every parallel strategy implements."""

from __future__ import annotations

import contextlib
from typing import Protocol

from torch import nn


class ParallelStrategy(Protocol):
    name: str

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return ``model`` (already on its device) ready for parallel training."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward accumulates local gradients without communicating."""


def unwrap_module(model: nn.Module) -> nn.Module:
    """Peel parallel wrappers (``.module``) and torch.compile (``._orig_mod``) off ``model``."""
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        else:
            return model
