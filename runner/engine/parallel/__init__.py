"""Parallel strategies: one module each, behind one small interface, chosen once per Accelerator.

A strategy wraps a plain ``nn.Module`` (models never know how they are parallelised) and keeps the
optimizers built from it pointing at its parameters, provides the context that skips gradient
synchronisation during accumulation, the model's full state dict and the total norm of its
gradients, and owns the models' and optimizers' state in a checkpoint: how it is written and read,
and the format the manifest records (see :mod:`runner.engine.parallel.base`).
"""

from __future__ import annotations

from runner.engine.distributed import DistributedEnvironment
from runner.engine.parallel.base import CheckpointReader, CheckpointWriter, ParallelStrategy, unwrap_module
from runner.engine.parallel.ddp import (
    DDPCommunicationHookType,
    DDPStrategy,
    DistributedDataParallelKwargs,
    sync_in_next_backward,
)
from runner.engine.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin
from runner.engine.parallel.none import SingleProcessStrategy

__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "DDPCommunicationHookType",
    "DDPStrategy",
    "DistributedDataParallelKwargs",
    "FSDPStrategy",
    "FullyShardedDataParallelPlugin",
    "ParallelStrategy",
    "SingleProcessStrategy",
    "select_strategy",
    "sync_in_next_backward",
    "unwrap_module",
]


def select_strategy(
    env: DistributedEnvironment,
    *,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
    param_dtype=None,
) -> ParallelStrategy:
    """FSDP when a plugin is given; otherwise DDP across several processes, else none."""
    if fsdp_plugin is not None:
        return FSDPStrategy(env, fsdp_plugin, param_dtype)
    if env.is_distributed:
        return DDPStrategy(env, ddp_kwargs or DistributedDataParallelKwargs())
    return SingleProcessStrategy()
