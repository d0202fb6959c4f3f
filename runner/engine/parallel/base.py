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

    def full_state_dict(self, model: nn.Module) -> dict:
        """The whole model's state dict, without the wrappers' prefixes (a collective when sharded)."""

    def total_norm(self, norm):
        """The gradients' total norm as clip_grad_norm_ returned it, as a plain tensor."""


class ReplicatedModelStrategy:
    """What strategies that keep a whole model on every rank share."""

    def full_state_dict(self, model: nn.Module) -> dict:
        return unwrap_module(model).state_dict()

    @staticmethod
    def total_norm(norm):
        return norm


def unwrap_module(model: nn.Module) -> nn.Module:
    """Peel parallel wrappers (``.module``) and torch.compile (``._orig_mod``) off ``model``."""
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        else:
            return model
