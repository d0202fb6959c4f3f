"""What an Accelerator has prepared, as one read-only value: the view ``save_state`` and ``load_state`` work from.

The Accelerator builds a :class:`PreparedObjects` for each save or load, so the checkpoint code
reads no attribute of the Accelerator and can be driven (in tests, say) with objects and a strategy
of one's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runner.engine.distributed import DistributedEnvironment
from runner.engine.optimizer import GradientState
from runner.engine.parallel.base import ParallelStrategy


@dataclass(frozen=True)
class PreparedObjects:
    """The objects one Accelerator prepared, each kind in the order it was prepared.

    Args:
        env: Where this process runs (rank, world size).
        strategy: The parallel strategy the models were wrapped with; it saves and loads their state.
        gradient_state: Accumulation bookkeeping, shared with the Accelerator (live, not a copy).
        models: The models as prepared (wrapped for the strategy).
        optimizers: The prepared optimizers (``AcceleratedOptimizer``).
        schedulers: The prepared schedulers (``AcceleratedScheduler``).
        dataloaders: The prepared loaders, whose positions a checkpoint records.
        custom_objects: The objects given to ``register_for_checkpointing``.
        scaler: The fp16 loss scaler, if any.

    Example:
        >>> prepared = PreparedObjects(env=read_environment(), strategy=SingleProcessStrategy(),
        ...                            gradient_state=GradientState(GradientAccumulationPlugin()), models=(model,))
    """

    env: DistributedEnvironment
    strategy: ParallelStrategy
    gradient_state: GradientState
    models: tuple[nn.Module, ...] = ()
    optimizers: tuple[Any, ...] = ()
    schedulers: tuple[Any, ...] = ()
    dataloaders: tuple[Any, ...] = ()
    custom_objects: tuple[Any, ...] = ()
    scaler: torch.amp.GradScaler | None = None
