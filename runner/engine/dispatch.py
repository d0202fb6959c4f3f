"""Where ``runner.engine.data.dispatch``'s loaders were first importable from: dispatched batches and sharded streams.

Kept so scripts that import them from here still run; new code imports from :mod:`runner.engine.data`.
"""

from runner.engine.data.dispatch import DispatchedDataLoader, GlobalBatches, IterableDatasetShard, ShardedIterableLoader

__all__ = ["DispatchedDataLoader", "GlobalBatches", "IterableDatasetShard", "ShardedIterableLoader"]
