"""Where ``runner.engine.loaders.dispatch``'s loaders were first importable from: dispatched batches, sharded streams.

Kept so scripts that import them from here still run; new code imports from :mod:`runner.engine.loaders`.
"""

from runner.engine.loaders.dispatch import (
    DispatchedDataLoader,
    GlobalBatches,
    IterableDatasetShard,
    ShardedIterableLoader,
)

__all__ = ["DispatchedDataLoader", "GlobalBatches", "IterableDatasetShard", "ShardedIterableLoader"]
