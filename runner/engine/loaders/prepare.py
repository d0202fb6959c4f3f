"""``prepare`` for a DataLoader: rebuild it over this rank's shard, as a map-style, streamed or dispatched loader.

:mod:`~runner.engine.loaders.sampling` holds the sharding arithmetic and the samplers,
:mod:`~runner.engine.loaders.loader` the map-style loader, :mod:`~runner.engine.loaders.dispatch` the loaders for
streams and for batches rank 0 loads, :mod:`~runner.engine.loaders.worker_streams` those for streams that loader
workers read; this module chooses between them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from runner.engine.loaders import dispatch, worker_streams
from runner.engine.loaders.batch_shards import BatchSamplerShard
from runner.engine.loaders.loader import BatchShardedDataLoader, DataLoaderConfiguration, PreparedDataLoader
from runner.engine.loaders.sampling import (
    SeedableRandomSampler,
    ShardedBatchSampler,
    Sharding,
    seeded_worker_init_fn,
)
from runner.engine.loaders.shuffles import PlainShuffle, int64_draw

_LOADER_OPTIONS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
)


def _shuffle_seed(dataloader: DataLoader, broadcast_seed, config: DataLoaderConfiguration) -> int:
    """The seed shared by all ranks: ``data_seed``, else (unless seedable) the loader's generator's, else torch's;
    rank 0's. A seedable sampler shuffles from ``data_seed`` or torch's initial seed, as Accelerate's does."""
    if config.data_seed is not None:
        seed = config.data_seed
    elif config.seedable:
        seed = torch.initial_seed()
    else:
        generator = getattr(dataloader.sampler, "generator", None) or dataloader.generator
        seed = generator.initial_seed() if generator is not None else torch.initial_seed()
    return broadcast_seed(seed)  # every rank broadcasts, data_seed or not, so the collectives pair up


def prepare_data_loader(
    dataloader: DataLoader,
    *,
    device: torch.device | None,
    num_processes: int,
    process_index: int,
    gradient_state,
    config: DataLoaderConfiguration,
    broadcast_seed: Callable[[int], int] = lambda seed: seed,
    share: Callable[[Any], Any] = lambda value: value,
    on_epoch_start: Callable[[], None] | None = None,
    comm_device: torch.device | None = None,
) -> PreparedDataLoader:
    """Rebuild ``dataloader`` over this rank's shard of every global batch.

    Args:
        dataloader: A DataLoader over a map-style or an iterable dataset, with automatic batching
            (``batch_size`` set, or a ``batch_sampler``), or over a map-style dataset with a
            ``BatchSampler`` as its ``sampler`` and ``batch_size=None``. A batch sampler other than
            torch's own keeps its batches whole: each rank gets its share of them (see
            :class:`~runner.engine.loaders.batch_shards.BatchSamplerShard`).
        device: Where batches are moved, or None to leave them where the loader puts them.
        broadcast_seed: Makes rank 0's shuffle seed everyone's (a collective when distributed).
        share: Makes rank 0's value (a generator's state, a seed) everyone's, as each pass begins
            (a collective when distributed).
        on_epoch_start: Called when each pass begins (to synchronise RNG states, say).
        comm_device: Where dispatched batches travel between processes (the GPU under NCCL).

    Raises:
        ValueError: For a loader without batching, and for settings that cannot shard exactly (see
            the messages).
    """
    user_batches = _user_batch_sampler(dataloader)
    if user_batches is not None:
        return _batch_sharded_loader(
            dataloader,
            user_batches,
            num_processes=num_processes,
            process_index=process_index,
            config=config,
            seed=_shuffle_seed(dataloader, broadcast_seed, config),
            share=share,
            device=device,
            gradient_state=gradient_state,
            non_blocking=config.non_blocking,
            on_epoch_start=on_epoch_start,
        )
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        raise ValueError("prepare() needs a batched DataLoader; set batch_size (not None) when building it.")
    return _sample_sharded_loader(
        dataloader,
        device=device,
        num_processes=num_processes,
        process_index=process_index,
        gradient_state=gradient_state,
        config=config,
        broadcast_seed=broadcast_seed,
        share=share,
        on_epoch_start=on_epoch_start,
        comm_device=comm_device,
    )


def _sample_sharded_loader(
    dataloader: DataLoader,
    *,
    device,
    num_processes: int,
    process_index: int,
    gradient_state,
    config: DataLoaderConfiguration,
    broadcast_seed: Callable[[int], int],
    share: Callable[[Any], Any],
    on_epoch_start: Callable[[], None] | None,
    comm_device,
) -> PreparedDataLoader:
    """A loader cut into global batches of samples: sharded by index, dispatched from rank 0, or an iterable's slice."""
    batch_sampler = dataloader.batch_sampler
    iterable = isinstance(dataloader.dataset, IterableDataset)
    dispatch_batches = iterable if config.dispatch_batches is None else config.dispatch_batches
    sharding = Sharding.create(
        batch_sampler.batch_size,
        num_processes=num_processes,
        split_batches=config.split_batches,
        process_index=process_index,
        drop_last=batch_sampler.drop_last,
        even_batches=config.even_batches,
        dispatched=dispatch_batches and num_processes > 1,
    )
    seed = _shuffle_seed(dataloader, broadcast_seed, config)
    options = _loader_options(dataloader, iterable=iterable)
    # As in Accelerate, only a sampler each rank draws for itself keeps one generator across passes.
    persistent = num_processes > 1 and not dispatch_batches and not iterable
    sampler, shuffle = _shuffled(
        batch_sampler.sampler, seed, dataloader, config, share, single=num_processes == 1, persistent=persistent
    )
    common = {
        "device": device,
        "gradient_state": gradient_state,
        "non_blocking": config.non_blocking,
        "sharding": sharding,
        "on_epoch_start": on_epoch_start,
        "seed": seed,
        "shuffle": shuffle,
        "base_generator": dataloader.generator,
        **options,
    }
    workers = options.get("num_workers", 0) > 0
    if iterable and workers and (num_processes == 1 or (dispatch_batches and _workers_keep_state(options, dataloader))):
        return _worker_stream_loader(dataloader, dispatched=num_processes > 1, comm_device=comm_device, **common)
    if num_processes > 1 and dispatch_batches:
        return _dispatched_loader(dataloader, sampler, comm_device=comm_device, iterable=iterable, **common)
    if iterable:
        if options.get("num_workers", 0) > 0 and num_processes > 1:
            raise ValueError(
                "An IterableDataset with num_workers > 0 cannot be sharded exactly on each process (torch "
                "gives every worker its own copy of the stream); keep dispatch_batches on (the default for "
                "iterable datasets) or set num_workers=0."
            )
        shard = dispatch.IterableDatasetShard(dataloader.dataset, sharding)
        return dispatch.ShardedIterableLoader(shard, batch_size=sharding.per_process, **common)
    return PreparedDataLoader(
        dataloader.dataset, batch_sampler=_sharded_sampler(sampler, sharding, seed, shuffle), **common
    )


def _user_batch_sampler(dataloader: DataLoader):
    """The loader's own batch sampler, whose batches are sharded whole, or None for torch's ``BatchSampler``.

    As in Accelerate, that is a ``BatchSampler`` given as ``sampler`` (with ``batch_size=None``), or a
    ``batch_sampler`` of another class.
    """
    if isinstance(dataloader.sampler, BatchSampler) and dataloader.batch_sampler is None:
        return dataloader.sampler
    if dataloader.batch_sampler is not None and type(dataloader.batch_sampler) is not BatchSampler:
        return dataloader.batch_sampler
    return None


def _loader_options(dataloader: DataLoader, *, iterable: bool) -> dict[str, Any]:
    """The loader's own options that the prepared loader keeps (worker seeding added for map-style data)."""
    options = {name: getattr(dataloader, name) for name in _LOADER_OPTIONS if hasattr(dataloader, name)}
    if options.get("num_workers", 0) == 0:
        options.pop("prefetch_factor", None)
        options.pop("persistent_workers", None)
    elif not iterable:  # workers load whole batches of indices: each one's random draws are seeded (SeededBatch)
        options["worker_init_fn"] = seeded_worker_init_fn(options.get("worker_init_fn"))
    return options


def _dispatched_loader(
    dataloader: DataLoader, sampler, *, comm_device: torch.device | None, iterable: bool, **common: Any
) -> dispatch.DispatchedDataLoader:
    """A loader whose global batches rank 0 loads and sends to every rank (``common``: the loader's settings)."""
    sharding = common["sharding"]
    if iterable:
        return dispatch.DispatchedDataLoader(
            dataloader.dataset,
            batch_size=sharding.global_batch_size,
            drop_last=sharding.drop_last,
            comm_device=comm_device,
            **common,
        )
    sampled = _sharded_sampler(sampler, sharding, common["seed"], common["shuffle"])
    return dispatch.DispatchedDataLoader(
        dataloader.dataset, batch_sampler=dispatch.GlobalBatches(sampled), comm_device=comm_device, **common
    )


def _workers_keep_state(options: dict[str, Any], dataloader: DataLoader) -> bool:
    """Whether the loader's workers read a stream with state, which a checkpoint then records for each worker.

    Persistent workers keep the copies of the stream they made in their first pass, which a resumed position
    cannot reach: such a stream is read past as one without state."""
    return dispatch.stateful(dataloader.dataset) and not options.get("persistent_workers")


def _worker_stream_loader(
    dataloader: DataLoader, *, dispatched: bool, comm_device: torch.device | None, **common: Any
) -> PreparedDataLoader:
    """A loader whose workers each read their part of a stream with state (:mod:`runner.engine.loaders.worker_streams`):
    on one process, the plain loader's batches; on several, rank 0's global batches, dispatched."""
    sharding = common["sharding"]
    size = sharding.global_batch_size if dispatched else sharding.per_process
    stream = worker_streams.WorkerStream(dataloader.dataset, size, sharding.drop_last)
    common["collate_fn"] = worker_streams.TaggedCollate(common["collate_fn"])
    if dispatched:
        return worker_streams.DispatchedWorkerLoader(stream, batch_size=size, comm_device=comm_device, **common)
    return worker_streams.WorkerStreamLoader(stream, batch_size=size, **common)


def _seeded(sampler, seed: int):
    """``sampler``, or a copy of it whose shuffle every rank draws alike (reseeded each epoch)."""
    if isinstance(sampler, RandomSampler) and not hasattr(sampler, "set_epoch"):
        return SeedableRandomSampler(
            sampler.data_source, seed=seed, replacement=sampler.replacement, num_samples=sampler._num_samples
        )
    if hasattr(sampler, "generator") and not hasattr(sampler, "set_epoch"):
        sampler = copy.copy(sampler)  # a random sampler of the user's: give it a generator every rank seeds alike
        sampler.generator = torch.Generator()
    return sampler


def _shuffled(
    sampler,
    seed: int,
    dataloader: DataLoader,
    config: DataLoaderConfiguration,
    share,
    *,
    single: bool,
    persistent: bool = False,
):
    """The sampler a prepared loader draws from, and the :class:`PlainShuffle` that draws it (None if seedable).

    Seedable (``use_seedable_sampler`` or a ``data_seed``): a ``RandomSampler`` becomes a
    :class:`SeedableRandomSampler`. Otherwise a sampler with a ``generator`` (and no ``set_epoch``)
    draws each pass's order as the unprepared loader would; it is copied, so that the generator it
    may get leaves the user's sampler as it was. ``persistent`` (several processes, each drawing its
    own indices) gives a sampler without a generator one for every pass, seeded now by one draw of
    torch's global generator and rank 0's on every rank as each pass begins: Accelerate's order.
    On one process (``single``) such a sampler draws as in a plain DataLoader.
    """
    if config.seedable:
        return _seeded(sampler, seed), None
    if hasattr(sampler, "generator") and not hasattr(sampler, "set_epoch"):
        sampler = copy.copy(sampler)
        persistent = persistent and sampler.generator is None
        if persistent:
            sampler.generator = torch.Generator().manual_seed(int64_draw(None))
        return sampler, PlainShuffle(sampler, dataloader.generator, share, global_draws=single, persistent=persistent)
    return sampler, None


def _sharded_sampler(sampler, sharding: Sharding, seed: int, shuffle: PlainShuffle | None) -> ShardedBatchSampler:
    """The loader's sampler (seeded alike on every rank, or drawn by ``shuffle``) behind a ShardedBatchSampler."""
    sharded = ShardedBatchSampler(sampler, sharding=sharding)
    sharded.seed = seed
    sharded.reseeds_sampler = shuffle is None
    return sharded


def _batch_sharded_loader(
    dataloader: DataLoader,
    user_batches,
    *,
    num_processes: int,
    process_index: int,
    config: DataLoaderConfiguration,
    seed: int,
    share: Callable[[Any], Any],
    **common: Any,
) -> BatchShardedDataLoader:
    """A loader handing each rank its share of the user's batches, kept whole (Accelerate's ``BatchSamplerShard``)."""
    name = type(user_batches).__name__
    if num_processes > 1 and config.dispatch_batches:
        raise ValueError(
            f"dispatch_batches=True cannot send the batches of the batch sampler {name}, which are sharded whole; "
            "set dispatch_batches=False (or leave it None) for this loader."
        )
    # A shallow copy, so that seeding its sampler (or its generator) leaves the user's loader as it was.
    user_batches, shuffle = copy.copy(user_batches), None
    if hasattr(user_batches, "sampler"):
        user_batches.sampler, shuffle = _shuffled(
            user_batches.sampler,
            seed,
            dataloader,
            config,
            share,
            single=num_processes == 1,
            persistent=num_processes > 1,
        )
    if shuffle is None:  # shuffled by the batch sampler's own generator, if at all
        user_batches, shuffle = _shuffled(user_batches, seed, dataloader, config, share, single=num_processes == 1)
    as_sampler = dataloader.batch_sampler is None
    batches = BatchSamplerShard(
        user_batches,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=config.split_batches,
        even_batches=config.even_batches,
        seed=seed,
        as_indices=not as_sampler,
    )
    batches.reseeds = shuffle is None
    sharding = Sharding.create(
        batches.batch_size or 1,
        num_processes=num_processes,
        split_batches=config.split_batches and batches.batch_size is not None,
        process_index=process_index,
        drop_last=batches.drop_last,
        even_batches=config.even_batches,
    )
    options = _loader_options(dataloader, iterable=False)
    return BatchShardedDataLoader(
        dataloader.dataset,
        batches=batches,
        as_sampler=as_sampler,
        sharding=sharding,
        seed=seed,
        shuffle=shuffle,
        base_generator=dataloader.generator,
        **options,
        **common,
    )
