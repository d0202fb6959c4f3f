"""runner.engine: the Accelerate programming model on torch.distributed.

    from runner.engine import Accelerator

Names and behaviour follow Accelerate's public API, so a script written for it runs after changing
its imports (``accelerate`` -> ``runner.engine``, ``accelerate.utils`` -> ``runner.engine.utils``,
``accelerate.tracking`` -> ``runner.engine.tracking``, ``accelerate.data_loader`` -> ``runner.engine.data_loader``,
``accelerate.state`` -> ``runner.engine.state``, ``accelerate.local_sgd`` -> ``runner.engine.local_sgd``).
"""

from runner.engine.accelerator import Accelerator
from runner.engine.checkpoint import CheckpointError, ProjectConfiguration
from runner.engine.checkpoint.serialization import load_checkpoint_in_model
from runner.engine.data import DataLoaderConfiguration
from runner.engine.distributed import DistributedType, InitProcessGroupKwargs
from runner.engine.launchers import debug_launcher, notebook_launcher
from runner.engine.memory import find_executable_batch_size
from runner.engine.ops import DistributedOperationException
from runner.engine.optimizer import AcceleratedOptimizer, AcceleratedScheduler, GradientAccumulationPlugin
from runner.engine.parallel import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
)
from runner.engine.precision import AutocastKwargs, GradScalerKwargs
from runner.engine.rng import set_seed
from runner.engine.state import PartialState
from runner.engine.tracking import GeneralTracker, register_tracker_class

__all__ = [
    "AcceleratedOptimizer",
    "AcceleratedScheduler",
    "Accelerator",
    "AutocastKwargs",
    "CheckpointError",
    "DDPCommunicationHookType",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedOperationException",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "ParallelismConfig",
    "PartialState",
    "ProjectConfiguration",
    "debug_launcher",
    "find_executable_batch_size",
    "load_checkpoint_in_model",
    "notebook_launcher",
    "register_tracker_class",
    "set_seed",
]
