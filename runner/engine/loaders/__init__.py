"""The engine's loaders room: how ``prepare`` makes a DataLoader hand each rank its share of every global batch,
and where a loader keeps its position in the data. (The datasets a config declares are :mod:`runner.data`'s.)

- :mod:`~runner.engine.loaders.sampling`: the sharding arithmetic (global batches, padding) and the seeded
  samplers.
- :mod:`~runner.engine.loaders.shuffles`: each pass's order drawn as the unprepared loader draws it.
- :mod:`~runner.engine.loaders.batch_shards`: a user's batch sampler, sharded by whole batches.
- :mod:`~runner.engine.loaders.loader`: the prepared loader, its configuration and its position (``state_dict``).
- :mod:`~runner.engine.loaders.dispatch`: streams read on each rank, and batches rank 0 loads and sends.
- :mod:`~runner.engine.loaders.worker_streams`: streams read by loader workers, each its part, a state for each.
- :mod:`~runner.engine.loaders.prepare`: the ``prepare_data_loader`` the Accelerator calls, which picks one of them;
  the one exported here takes Accelerate's arguments (:mod:`runner.engine.data_loader`).

It may import torch, :mod:`runner.engine.ops` (moving batches to a device) and the checkpoint room's
``CheckpointError`` (a saved position this loader cannot continue); nothing else of the engine. The names
below are importable from here, as they were from the module this room grew from.
"""

from runner.engine.loaders.batch_shards import BatchSamplerShard
from runner.engine.loaders.dispatch import DispatchedDataLoader, IterableDatasetShard
from runner.engine.loaders.loader import BatchShardedDataLoader, DataLoaderConfiguration, PreparedDataLoader
from runner.engine.loaders.sampling import (
    SeedableRandomSampler,
    SeededBatch,
    ShardedBatchSampler,
    Sharding,
    batch_seed,
    seed_generators,
    seeded_worker_init_fn,
)
from runner.engine.loaders.shuffles import PlainShuffle

__all__ = [
    "BatchSamplerShard",
    "BatchShardedDataLoader",
    "DataLoaderConfiguration",
    "DispatchedDataLoader",
    "IterableDatasetShard",
    "PlainShuffle",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "SeededBatch",
    "ShardedBatchSampler",
    "Sharding",
    "batch_seed",
    "prepare_data_loader",
    "seed_generators",
    "seeded_worker_init_fn",
    "skip_first_batches",
]


def __getattr__(name: str):
    """Accelerate's ``prepare_data_loader`` and ``skip_first_batches`` (:mod:`runner.engine.data_loader`, which
    builds on this room), imported when first read."""
    if name in ("prepare_data_loader", "skip_first_batches"):
        from runner.engine import data_loader

        return getattr(data_loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
