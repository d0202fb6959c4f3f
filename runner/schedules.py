"""Learning-rate schedules measured in optimizer steps, built as ``LambdaLR`` over a ``functools.partial``.

The recipe calls each with the optimizer and the run's total number of optimizer steps. The factor is
a partial of a plain function: torch saves a callable's ``__dict__`` in the scheduler's state, and a
partial's is empty, so a resumed run keeps the step count from its checkpoint while the shape of the
schedule (``total_steps`` included) comes from its current config. Resuming with a larger
``trainer.max_steps`` therefore stretches the schedule instead of leaving the learning rate at its end.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def warmup_cosine_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def constant_factor(step: int) -> float:
    return 1.0


def warmup_cosine(
    optimizer: Optimizer, *, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    factor = partial(
        warmup_cosine_factor, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
    )
    return LambdaLR(optimizer, factor)


def constant(optimizer: Optimizer, *, total_steps: int) -> LambdaLR:
    """The optimizer's learning rate, unchanged."""
    return LambdaLR(optimizer, partial(constant_factor))
