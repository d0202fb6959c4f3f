"""runner.engine: the Accelerate programming model on torch.distributed.

    from runner.engine import Accelerator

Names and behaviour follow Accelerate's public API, so a script written for it runs after changing
its imports (``accelerate`` -> ``runner.engine``, ``accelerate.utils`` -> ``runner.engine.utils``,
``accelerate.tracking`` -> ``runner.engine.tracking``, ``accelerate.data_loader`` -> ``runner.engine.data_loader``,
``accelerate.state`` -> ``runner.engine.state``, ``accelerate.local_sgd`` -> ``runner.engine.local_sgd``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Each public name and the module that defines it, imported when the name is first read: ``import runner.engine``
# and its light modules (the checkpoint room's errors, manifests and folders) do not import torch.
_NAMES = {
    "AcceleratedOptimizer": "runner.engine.optimizer",
    "AcceleratedScheduler": "runner.engine.optimizer",
    "Accelerator": "runner.engine.accelerator",
    "AsyncSave": "runner.engine.checkpoint.async_saves",
    "AutocastKwargs": "runner.engine.precision",
    "CheckpointError": "runner.engine.checkpoint.errors",
    "DDPCommunicationHookType": "runner.engine.parallel",
    "DataLoaderConfiguration": "runner.engine.loaders",
    "DistributedDataParallelKwargs": "runner.engine.parallel",
    "DistributedOperationException": "runner.engine.ops",
    "DistributedType": "runner.engine.distributed",
    "FullyShardedDataParallelPlugin": "runner.engine.parallel",
    "GeneralTracker": "runner.engine.tracking",
    "GradScalerKwargs": "runner.engine.precision",
    "GradientAccumulationPlugin": "runner.engine.optimizer",
    "InitProcessGroupKwargs": "runner.engine.distributed",
    "ParallelismConfig": "runner.engine.parallel",
    "PartialState": "runner.engine.state",
    "ProjectConfiguration": "runner.engine.checkpoint.folders",
    "debug_launcher": "runner.engine.launchers",
    "find_executable_batch_size": "runner.engine.memory",
    "load_checkpoint_in_model": "runner.engine.checkpoint.serialization",
    "notebook_launcher": "runner.engine.launchers",
    "register_tracker_class": "runner.engine.tracking",
    "set_seed": "runner.engine.rng",
}
__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use; a submodule (``runner.engine.ops``), imported."""
    module = _NAMES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
