"""Learning-rate schedules measured in optimizer steps, built as ``LambdaLR`` with picklable factors.

The recipe calls each with the optimizer and the run's total number of optimizer steps. Factors are
small objects, not lambdas, so the scheduler's state dict holds plain numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


@dataclass
class WarmupCosineFactor:
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class ConstantFactor:
    def __call__(self, step: int) -> float:
        return 1.0


def warmup_cosine(
    optimizer: Optimizer, *, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    return LambdaLR(optimizer, WarmupCosineFactor(warmup_steps, total_steps, min_lr_ratio))


def constant(optimizer: Optimizer, *, total_steps: int) -> LambdaLR:
    """The optimizer's learning rate, unchanged."""
    return LambdaLR(optimizer, ConstantFactor())
