"""Which samples each rank loads, in which order and with which seed: the sharding every prepared loader shares.

The data is cut into *global batches* of ``batch_size * num_processes`` samples (or ``batch_size``
with ``split_batches``); rank ``r`` takes the r-th slice of each. At every step the ranks together see
exactly the batch one process would see with the global batch size, which is what makes N processes
x batch b equal to 1 process x batch N*b.

The last global batch may be short. With ``even_batches`` (the default) it is padded with samples
from the start of the epoch, so every rank runs the same number of steps, as Accelerate pads it: a
loader sharded by index is padded to a whole global batch, each rank keeping its whole batch of
``batch_size`` (Accelerate's ``BatchSamplerShard``); batches rank 0 dispatches are padded to the next
multiple of ``num_processes`` and split evenly (Accelerate's ``DataLoaderDispatcher``).
``gather_for_metrics`` drops the padding again, because the gathered slices concatenate back into the
padded global batch in rank order, the real samples first.

Shuffling is seeded alike on every rank and anew each epoch, and every batch carries the seed its
random draws start from (:class:`SeededBatch`), so a resumed run draws as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import RandomSampler, Sampler


@dataclass(frozen=True)
class Sharding:
    """How each global batch is split across processes: the arithmetic every sharded loader shares."""

    per_process: int
    num_processes: int
    process_index: int
    drop_last: bool = False
    even_batches: bool = True
    dispatched: bool = False  # rank 0 loads each global batch and sends every rank its share

    @classmethod
    def create(cls, batch_size: int, *, num_processes: int, split_batches: bool, **options: Any) -> Sharding:
        if split_batches and batch_size % num_processes:
            raise ValueError(
                f"split_batches=True needs a batch size divisible by the {num_processes} processes, "
                f"got {batch_size}; change the batch size or turn split_batches off."
            )
        per_process = batch_size // num_processes if split_batches else batch_size
        return cls(per_process, num_processes, **options)

    @property
    def global_batch_size(self) -> int:
        return self.per_process * self.num_processes

    def rank_slice(self, batch, rank: int | None = None):
        """A rank's share of a global batch: its whole batch of ``per_process`` items, or, dispatched, consecutive
        slices of ``ceil(len / num_processes)``.

        Indices and collated batches are split alike, so every way of sharding splits a short last
        batch the same way (when it is not padded, the last ranks may get fewer items, or none).
        """
        rank = self.process_index if rank is None else rank
        size = -(-len(batch) // self.num_processes) if self.dispatched else self.per_process
        return batch[rank * size : (rank + 1) * size]

    def _padding(self, short: int) -> int:
        """How many samples pad a short last global batch of ``short`` samples."""
        if self.drop_last or not self.even_batches or not short or self.num_processes == 1:
            return 0
        return -short % self.num_processes if self.dispatched else self.global_batch_size - short

    def last_batch(self, batch: list, head: list) -> list | None:
        """The short last global batch as handed out: dropped, as is, or padded with the epoch's start.

        ``head`` is the epoch's first global batch; if the epoch had no full one, the short batch
        pads itself, over and over. Sharded by index, padding fills a whole global batch; dispatched,
        it stops at the next multiple of ``num_processes``.
        """
        if self.drop_last:
            return None
        filler = head + batch if len(head) == self.global_batch_size else batch
        return batch + [filler[i % len(filler)] for i in range(self._padding(len(batch)))]

    def real_rows(self, remainder: int, rows: int) -> int:
        """Of this rank's ``rows`` rows in the padded last global batch that holds ``remainder`` real samples, how
        many are real (they come first: the padding fills the global batch's end)."""
        padded = remainder + self._padding(remainder)
        start = self.process_index * (-(-padded // self.num_processes) if self.dispatched else self.per_process)
        return max(0, min(rows, remainder - start))

    def remainder(self, total: int) -> int:
        """Real samples in the padded last global batch of a pass over ``total`` samples, or -1."""
        short = total % self.global_batch_size
        return short if self._padding(short) else -1

    def global_rows(self, total: int) -> list[int]:
        """The length of each global batch of a pass over ``total`` samples, padding included."""
        full, short = divmod(max(total, 0), self.global_batch_size)
        rows = [self.global_batch_size] * full
        if short and not self.drop_last:
            rows.append(short + self._padding(short))
        return rows

    def num_batches(self, total: int) -> int:
        """This rank's batches in a pass over ``total`` samples."""
        rows = self.global_rows(total)
        if rows and rows[-1] < self.global_batch_size and not self.rank_slice(range(rows[-1])):
            return len(rows) - 1
        return len(rows)

    def rank_items(self, total: int) -> int:
        """This rank's samples in a pass over ``total`` samples, padding included."""
        return sum(len(self.rank_slice(range(rows))) for rows in self.global_rows(total))


class SeededBatch(list):
    """A batch's sample indices, and the seed its random draws start from when a loader worker loads it.

    A worker's generators otherwise run on from batch to batch, so the draws a sample gets would
    depend on which batches that worker happened to load before it, and a resumed run, whose fresh
    workers begin at the checkpoint, would draw differently from an uninterrupted one. Seeded from
    the loader's seed, the epoch, the batch's place in it and the rank, each batch draws the same in
    both, whichever worker loads it. (Without workers the process's own generators serve, and the
    checkpoint restores them.)
    """

    seed: int = 0


def batch_seed(seed: int, epoch: int, offset: int, rank: int) -> int:
    """The seed of the global batch that starts ``offset`` samples into ``epoch``, for ``rank``'s share."""
    key = b"%d:%d:%d:%d" % (seed, epoch, offset, rank)
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def seed_generators(seed: int) -> None:
    """Seed ``random``, numpy's global generator (if numpy is loaded) and torch's CPU generator."""
    random.seed(seed)
    torch.manual_seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _init_seeded_worker(worker_init_fn: Callable[[int], None] | None, worker_id: int) -> None:
    """A loader worker's start: the user's ``worker_init_fn``, then each :class:`SeededBatch` loaded reseeds first.

    The worker's copy of the dataset gets a ``__getitems__`` that torch's fetcher calls with each
    batch of indices; the dataset in the main process is untouched.
    """
    if worker_init_fn is not None:
        worker_init_fn(worker_id)
    dataset = torch.utils.data.get_worker_info().dataset
    load_batch = getattr(dataset, "__getitems__", None)

    def load_seeded(indices):
        if isinstance(indices, SeededBatch):
            seed_generators(indices.seed)
        indices = list(indices)
        return load_batch(indices) if load_batch else [dataset[index] for index in indices]

    try:
        dataset.__getitems__ = load_seeded
    except (AttributeError, TypeError):  # a dataset that takes no attributes (__slots__): draws as torch seeds them
        pass


def seeded_worker_init_fn(worker_init_fn: Callable[[int], None] | None) -> Callable[[int], None]:
    """A ``worker_init_fn`` that runs ``worker_init_fn`` and then seeds every batch the worker loads."""
    return functools.partial(_init_seeded_worker, worker_init_fn)  # a partial pickles, for spawned workers


class SeedableRandomSampler(RandomSampler):
    """A random permutation drawn from ``seed + epoch``: the same on every rank, new each epoch (Accelerate's).

    Each pass reseeds the generator with ``seed + epoch`` and draws as torch's ``RandomSampler`` does, and a pass
    run to its end moves to the next epoch, so a plain DataLoader over it shuffles anew every epoch; a prepared
    loader sets the epoch before each pass (``set_epoch``).

    Args:
        data_source: What is sampled (only its length is used).
        replacement: Draw with replacement, ``num_samples`` of them.
        num_samples: How many indices a pass yields; ``len(data_source)`` by default.
        generator: The generator each pass reseeds and draws from (as Accelerate's does); a private one
            by default.
        data_seed: Accelerate's name for the seed; it wins over ``seed``.
        seed: The seed. Without it or ``data_seed``, torch's initial seed (``torch.initial_seed()``),
            as in Accelerate.

    Example:
        >>> sampler = SeedableRandomSampler(range(10), data_seed=42)
        >>> sampler.set_epoch(1)  # the order of epoch 1, on every rank alike
    """

    def __init__(
        self,
        data_source,
        replacement: bool = False,
        num_samples: int | None = None,
        generator: torch.Generator | None = None,
        *,
        data_seed: int | None = None,
        seed: int | None = None,
    ):
        super().__init__(data_source, replacement=replacement, num_samples=num_samples, generator=generator)
        if data_seed is not None:
            seed = data_seed
        self.seed = seed if seed is not None else torch.initial_seed()
        self.epoch = 0

    @property
    def initial_seed(self) -> int:
        """Accelerate's name for :attr:`seed`."""
        return self.seed

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed((self.seed + self.epoch) % 2**64)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's slice of each global batch of the wrapped sampler's indices.

    Give either ``sharding`` or the settings it is made of.
    """

    def __init__(
        self,
        sampler: Sampler[int],
        *,
        sharding: Sharding | None = None,
        batch_size: int = 1,
        drop_last: bool = False,
        num_processes: int = 1,
        process_index: int = 0,
        split_batches: bool = False,
        even_batches: bool = True,
        dispatched: bool = False,
    ) -> None:
        self.sharding = sharding or Sharding.create(
            batch_size,
            num_processes=num_processes,
            split_batches=split_batches,
            process_index=process_index,
            drop_last=drop_last,
            even_batches=even_batches,
            dispatched=dispatched,
        )
        self.sampler = sampler
        self.process_index = self.sharding.process_index
        self.per_process = self.sharding.per_process
        self.global_batch_size = self.sharding.global_batch_size
        self.skip_samples = 0  # applies to the next pass only
        self.seed: int | None = None  # seeds the batches, and reseeds a sampler's own generator each epoch
        self.reseeds_sampler = True  # False when a PlainShuffle draws the order (see set_epoch)
        self.epoch = 0

    @property
    def even_batches(self) -> bool:
        """Whether the short last global batch is padded (Accelerate's attribute; ``join_uneven_inputs`` sets it)."""
        return self.sharding.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self.sharding = dataclasses.replace(self.sharding, even_batches=value)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        elif (
            self.reseeds_sampler
            and self.seed is not None
            and isinstance(getattr(self.sampler, "generator", None), torch.Generator)
        ):
            # SubsetRandomSampler, WeightedRandomSampler, ...: the same draws on every rank, new each epoch.
            self.sampler.generator.manual_seed((self.seed + epoch) % 2**64)

    def remainder_after(self, skipped: int) -> int:
        """Real samples in the padded last global batch of a pass that skips ``skipped`` samples, or -1."""
        return self.sharding.remainder(len(self.sampler) - skipped)

    @property
    def remainder(self) -> int:
        return self.remainder_after(0)

    def global_batches(self) -> Iterator[SeededBatch]:
        """Every rank's indices of each step together: the global batches, the short last one padded.

        Each is seeded for rank 0, which loads it whole under ``dispatch_batches``.
        """
        skip, self.skip_samples = self.skip_samples, 0
        indices = iter(self.sampler)
        # The epoch's first global batch pads its short last one, also in a pass that resumes mid-epoch,
        # so an interrupted epoch sees exactly the samples of an uninterrupted one.
        head = list(itertools.islice(indices, self.global_batch_size))
        # Skipped samples cost index arithmetic only, never a sample load.
        stream = itertools.islice(itertools.chain(head, indices), skip, None)
        offset = skip
        while batch := list(itertools.islice(stream, self.global_batch_size)):
            if len(batch) < self.global_batch_size:
                if last := self.sharding.last_batch(batch, head):
                    yield self._seeded(last, offset, rank=0)
                return
            yield self._seeded(batch, offset, rank=0)
            offset += len(batch)

    def _seeded(self, indices: list[int], offset: int, *, rank: int) -> SeededBatch:
        batch = SeededBatch(indices)
        batch.seed = batch_seed(self.seed or 0, self.epoch, offset, rank)
        return batch

    def __iter__(self) -> Iterator[SeededBatch]:
        if self.sharding.num_processes == 1:
            yield from self.global_batches()
            return
        start, stop = self.process_index * self.per_process, (self.process_index + 1) * self.per_process
        offset = self.skip_samples
        for batch in self.global_batches():
            mine = batch[start:stop] if len(batch) == self.global_batch_size else self.sharding.rank_slice(batch)
            if mine:
                yield self._seeded(mine, offset, rank=self.process_index)
            offset += len(batch)

    def num_batches(self, skipped: int = 0) -> int:
        """This rank's batches in a pass that skips the epoch's first ``skipped`` samples."""
        return self.sharding.num_batches(len(self.sampler) - skipped)

    def __len__(self) -> int:
        return self.num_batches(0)
