"""Accelerate's ``accelerate.utils`` names, so ``from accelerate.utils import X`` ports by renaming."""

from runner.engine.checkpoint import ProjectConfiguration
from runner.engine.data import DataLoaderConfiguration
from runner.engine.distributed import DistributedType
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
from runner.engine.parallel import DistributedDataParallelKwargs
from runner.engine.precision import AutocastKwargs, GradScalerKwargs, PrecisionType
from runner.engine.rng import set_seed, synchronize_rng_states
from runner.engine.serialization import load_checkpoint_in_model

__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "PrecisionType",
    "ProjectConfiguration",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "load_checkpoint_in_model",
    "pad_across_processes",
    "reduce",
    "send_to_device",
    "set_seed",
    "synchronize_rng_states",
]
