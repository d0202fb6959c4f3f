"""Parallel strategies: one module each, behind one small interface, chosen once per Accelerator.

A strategy wraps a plain ``nn.Module`` (models never know how they are parallelised) and keeps the
optimizers built from it pointing at its parameters, provides the context that skips gradient
synchronisation during accumulation, the model's full state dict and the total norm of its
gradients, and owns the models' and optimizers' state in a checkpoint: how it is written and read,
and the format the manifest records (see :mod:`runner.engine.parallel.base`). Beside them,
:mod:`~runner.engine.parallel.mesh` lays out the N-D device mesh, :mod:`~runner.engine.parallel.tensor_parallel`
splits layers by a plan, and :mod:`~runner.engine.parallel.pipeline` cuts a model into pipeline stages by its plan
(the stages keep the model's names, torch's schedules by name), which :mod:`~runner.engine.parallel.pipelined`
runs as a strategy on the mesh's ``pp`` dimension.

It may import torch, the engine's core modules and its checkpoint room; nothing outside the engine.
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
from runner.engine.parallel.mesh import ParallelismConfig
from runner.engine.parallel.none import SingleProcessStrategy

__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "DDPCommunicationHookType",
    "DDPStrategy",
    "DistributedDataParallelKwargs",
    "FSDPStrategy",
    "FullyShardedDataParallelPlugin",
    "ParallelismConfig",
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
    parallelism_config: ParallelismConfig | None = None,
    precision=None,
) -> ParallelStrategy:
    """Pipeline stages when the parallelism config has several (each sharded or split as below); FSDP2 on a mesh
    when a plugin is given, or a parallelism config that shards or splits the model (tensor parallelism);
    otherwise DDP across several processes, else none.

    Args:
        precision: The run's :class:`~runner.engine.precision.Precision`, whose autocast each pipeline stage's
            forward runs under.

    Raises:
        ValueError: The parallelism config's sizes do not multiply to the world size.
    """
    if parallelism_config is not None:
        parallelism_config = parallelism_config.resolve(env.world_size)
        if parallelism_config.pp_enabled:
            from runner.engine.parallel.pipelined import PipelineStrategy

            plugin = fsdp_plugin or FullyShardedDataParallelPlugin()
            return PipelineStrategy(env, plugin, param_dtype, parallelism_config, precision)
        splits = parallelism_config.tp_enabled or parallelism_config.cp_enabled
        if fsdp_plugin is None and (splits or parallelism_config.dp_shard_enabled):
            fsdp_plugin = FullyShardedDataParallelPlugin()
        if fsdp_plugin is not None:
            plain = not splits and not parallelism_config.dp_replicate_enabled
            return FSDPStrategy(env, fsdp_plugin, param_dtype, None if plain else parallelism_config)
    if fsdp_plugin is not None:
        return FSDPStrategy(env, fsdp_plugin, param_dtype)
    if env.is_distributed:
        return DDPStrategy(env, ddp_kwargs or DistributedDataParallelKwargs())
    return SingleProcessStrategy()
