"""One process: nothing to wrap, nothing to synchronise."""

from __future__ import annotations

import contextlib

from torch import nn

from runner.engine.parallel.base import ReplicatedModelStrategy


class SingleProcessStrategy(ReplicatedModelStrategy):
    name = "none"

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()
