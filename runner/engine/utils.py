"""Accelerate's ``accelerate.utils`` names, so ``from accelerate.utils import X`` ports by renaming."""

from runner.engine.checkpoint import ProjectConfiguration
from runner.engine.data import DataLoaderConfiguration
from runner.engine.distributed import DistributedType
from runner.engine.launchers import debug_launcher, notebook_launcher
from runner.engine.memory import find_executable_batch_size, release_memory, should_reduce_batch_size
from runner.engine.ops import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    reduce,
    send_to_device,
)
from runner.engine.optimizer import GradientAccumulationPlugin
from runner.engine.parallel import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin
from runner.engine.precision import AutocastKwargs, GradScalerKwargs, PrecisionType
from runner.engine.rng import set_seed, synchronize_rng_states
from runner.engine.serialization import load_checkpoint_in_model

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "PrecisionType",
    "ProjectConfiguration",
    "broadcast",
    "debug_launcher",
    "find_executable_batch_size",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "pad_across_processes",
    "reduce",
    "release_memory",
    "send_to_device",
    "set_seed",
    "should_reduce_batch_size",
    "synchronize_rng_states",
]
