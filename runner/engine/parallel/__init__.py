"""Parallel strategies: one module each, behind one small interface, chosen once per Accelerator.

A strategy wraps a plain ``nn.Module`` (models never know how they are parallelised), provides the
context that skips gradient synchronisation during accumulation, and unwraps back to the original
module.
"""

from __future__ import annotations

from runner.engine.distributed import DistributedEnvironment
from runner.engine.parallel.base import ParallelStrategy, unwrap_module
from runner.engine.parallel.ddp import DDPStrategy, DistributedDataParallelKwargs
from runner.engine.parallel.none import SingleProcessStrategy

__all__ = [
    "DDPStrategy",
    "DistributedDataParallelKwargs",
    "ParallelStrategy",
    "SingleProcessStrategy",
    "select_strategy",
    "unwrap_module",
]


def select_strategy(
    env: DistributedEnvironment, *, ddp_kwargs: DistributedDataParallelKwargs | None = None
) -> ParallelStrategy:
    """The strategy for this environment: DDP across several processes, else none."""
    if env.is_distributed:
        return DDPStrategy(env, ddp_kwargs or DistributedDataParallelKwargs())
    return SingleProcessStrategy()
