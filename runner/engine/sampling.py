"""Which samples each rank loads, in which order and with which seed: the sharding every prepared loader shares.

The data is cut into *global batches* of ``batch_size * num_processes`` samples (or ``batch_size``
with ``split_batches``); rank ``r`` takes the r-th slice of each. At every step the ranks together see
exactly the batch one process would see with the global batch size, which is what makes N processes
x batch b equal to 1 process x batch N*b.

The last global batch may be short. With ``even_batches`` (the default) it is padded with samples
from the start of the epoch to the next multiple of ``num_processes`` and split evenly, so every rank
runs the same number of steps; ``gather_for_metrics`` drops the padding again, because the gathered
slices concatenate back into the padded global batch in rank order.

Shuffling is seeded alike on every rank and anew each epoch, and every batch carries the seed its
random draws start from (:class:`SeededBatch`), so a resumed run draws as an uninterrupted one.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler


@dataclass(frozen=True)
class Sharding:
    """How each global batch is split across processes: the arithmetic every sharded loader shares."""

    per_process: int
    num_processes: int
    process_index: int
    drop_last: bool = False
    even_batches: bool = True

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
        """A rank's share of a global batch: consecutive slices of ``ceil(len / num_processes)``.

        Indices and collated batches are split alike, so every way of sharding splits a short last
        batch the same way (when it is not padded, the last ranks may get fewer items, or none).
        """
        rank = self.process_index if rank is None else rank
        size = -(-len(batch) // self.num_processes)
        return batch[rank * size : (rank + 1) * size]

    def last_batch(self, batch: list, head: list) -> list | None:
        """The short last global batch as handed out: dropped, as is, or padded with the epoch's start.

        ``head`` is the epoch's first global batch; if the epoch had no full one, the short batch
        pads itself. Padding stops at the next multiple of ``num_processes``.
        """
        if self.drop_last:
            return None
        if not self.even_batches:
            return batch
        filler = head + batch if len(head) == self.global_batch_size else batch
        return batch + [filler[i % len(filler)] for i in range(-len(batch) % self.num_processes)]

    def remainder(self, total: int) -> int:
        """Real samples in the padded last global batch of a pass over ``total`` samples, or -1."""
        short = total % self.global_batch_size
        padded = short and not self.drop_last and self.even_batches and short % self.num_processes
        return short if padded else -1

    def global_rows(self, total: int) -> list[int]:
        """The length of each global batch of a pass over ``total`` samples, padding included."""
        full, short = divmod(max(total, 0), self.global_batch_size)
        rows = [self.global_batch_size] * full
        if short and not self.drop_last:
            rows.append(short + (-short % self.num_processes if self.even_batches else 0))
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


class SeedableRandomSampler(Sampler[int]):
    """A random permutation drawn from ``seed + epoch``: the same on every rank, new each epoch.

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
        self.data_source = data_source
        if data_seed is not None:
            seed = data_seed
        self.seed = seed if seed is not None else torch.initial_seed()
        self.epoch = 0
        self.replacement = replacement
        self._num_samples = num_samples
        self.generator = generator

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = (self.generator or torch.Generator()).manual_seed((self.seed + self.epoch) % 2**64)
        n = len(self.data_source)
        if self.replacement:
            yield from torch.randint(n, (self.num_samples,), generator=generator).tolist()
            return
        order: list[int] = []
        while len(order) < self.num_samples:
            order.extend(torch.randperm(n, generator=generator).tolist())
        yield from order[: self.num_samples]

    def __len__(self) -> int:
        return self.num_samples


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
    ) -> None:
        self.sharding = sharding or Sharding.create(
            batch_size,
            num_processes=num_processes,
            split_batches=split_batches,
            process_index=process_index,
            drop_last=drop_last,
            even_batches=even_batches,
        )
        self.sampler = sampler
        self.process_index = self.sharding.process_index
        self.per_process = self.sharding.per_process
        self.global_batch_size = self.sharding.global_batch_size
        self.skip_samples = 0  # applies to the next pass only
        self.seed: int | None = None  # reseeds a sampler's own generator each epoch (see set_epoch)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        elif self.seed is not None and isinstance(getattr(self.sampler, "generator", None), torch.Generator):
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


class BatchSamplerShard(Sampler[list]):
    """This rank's share of the batches of a user's batch sampler, as Accelerate's ``BatchSamplerShard``.

    The user's batches are kept whole: without ``split_batches`` rank ``r`` gets batches r, r + N, ...
    (a step is N consecutive batches); with it every batch is cut into N slices of ``batch_size // N``
    and rank ``r`` gets the r-th. A last step that does not give every rank a full batch is completed,
    with ``even_batches``, from the epoch's first batches (cycling from their start, as Accelerate
    does), dropped if the batch sampler has ``drop_last``, and otherwise handed out as it is (some
    ranks then get a short batch or none). Short batches earlier in the epoch (a sampler of varying
    batch sizes) are handed out as they are.

    Positions count the user's batches: ``skip_batches`` (consumed by the next pass) skips the epoch's
    first ones, without loading a sample. ``remainder`` is set once the last step is produced: the real
    samples in it when it was padded, else -1.

    Args:
        batch_sampler: Yields batches (lists of indices, or whatever the dataset takes).
        seed: Reseeds the ``generator`` of a batch sampler (or of its ``sampler``) that has no
            ``set_epoch``, alike on every rank and anew each epoch.
        as_indices: Yield :class:`SeededBatch` lists (for a ``batch_sampler=``), not the user's objects.

    Raises:
        ValueError: With ``split_batches`` or ``even_batches`` on several processes for a batch sampler
            without a ``batch_size``, or ``split_batches`` with a batch size the processes do not divide.
    """

    def __init__(
        self,
        batch_sampler,
        *,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
        seed: int = 0,
        as_indices: bool = True,
    ) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)  # so the loader's position records the shuffle seed
        self.batch_size: int | None = getattr(batch_sampler, "batch_size", None)
        self.drop_last = bool(getattr(batch_sampler, "drop_last", False))
        self.num_processes, self.process_index = num_processes, process_index
        self.split_batches, self.even_batches = split_batches, even_batches
        self.seed, self.as_indices = seed, as_indices
        self.epoch = 0
        self.skip_batches = 0
        self.remainder = -1
        name = type(batch_sampler).__name__
        if num_processes > 1 and self.batch_size is None and (split_batches or even_batches):
            option = "split_batches" if split_batches else "even_batches"
            raise ValueError(
                f"{option} needs a batch size, and the batch sampler {name} has no batch_size attribute; give it "
                f"one or set {option}=False in the DataLoaderConfiguration."
            )
        if split_batches and self.batch_size is not None and self.batch_size % num_processes:
            raise ValueError(
                f"split_batches=True needs a batch size divisible by the {num_processes} processes, but {name} "
                f"has batch_size={self.batch_size}; change the batch size or turn split_batches off."
            )

    @property
    def batches_per_step(self) -> int:
        """The user's batches one step consumes, all ranks together."""
        return 1 if self.split_batches or self.num_processes == 1 else self.num_processes

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        for target in (self.batch_sampler, self.sampler):
            if hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
            elif isinstance(getattr(target, "generator", None), torch.Generator):
                # A batch sampler shuffled by its own generator: the same batches on every rank, new each epoch.
                target.generator.manual_seed((self.seed + epoch) % 2**64)

    def num_batches(self, skipped: int = 0) -> int | None:
        """This rank's batches in a pass that skips the epoch's first ``skipped`` batches; None if unknowable.

        Known from the batch sampler's length without drawing a batch, except where it depends on the
        length of the last batch (``split_batches`` without ``even_batches``) or it has no length.
        """
        try:
            total = max(len(self.batch_sampler) - skipped, 0)
        except TypeError:
            return None
        if self.batches_per_step == 1:
            return total if self.even_batches or self.num_processes == 1 else None
        steps, left = divmod(total, self.num_processes)
        if left and not self.drop_last and (self.even_batches or self.process_index < left):
            steps += 1
        return steps

    def __len__(self) -> int:
        """Accelerate's length: the batches this rank gets (with ``split_batches``, the user's batches)."""
        known = self.num_batches(0)
        return len(self.batch_sampler) if known is None else known

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip_batches = self.skip_batches, 0
        self.remainder = -1
        if self.num_processes == 1:
            for offset, batch in enumerate(itertools.islice(self.batch_sampler, skip, None), start=skip):
                yield self._handed_out(batch, offset)
            return
        batches = iter(self.batch_sampler)
        # The epoch's first batches complete its last step, also in a pass that resumes mid-epoch.
        head = list(itertools.islice(batches, self.num_processes))
        stream = itertools.islice(itertools.chain(head, batches), skip, None)
        steps = iter(lambda: list(itertools.islice(stream, self.batches_per_step)), [])
        offset, step = skip, next(steps, None)
        while step is not None:
            upcoming = next(steps, None)  # indices only: whether this step is the last, before it is handed out
            if upcoming is not None or self._is_full(step):
                self._check_split(step)
                yield from self._mine(step, offset)
            elif not self.drop_last:
                if self.even_batches:
                    self.remainder = sum(map(len, step))
                    step = self._completed(step, head)
                yield from self._mine(step, offset)
            offset += self.batches_per_step
            step = upcoming

    def _is_full(self, step: list) -> bool:
        if len(step) < self.batches_per_step:
            return False
        return self.batch_size is None or all(len(batch) >= self.batch_size for batch in step)

    def _check_split(self, step: list) -> None:
        if self.split_batches and len(step[0]) != self.batch_size:  # every rank sees the same batches: all raise
            raise ValueError(
                f"split_batches=True needs every batch but the last to hold batch_size={self.batch_size} samples, "
                f"and {type(self.batch_sampler).__name__} yielded one of {len(step[0])}; turn split_batches off."
            )

    def _completed(self, step: list, head: list) -> list[list]:
        """A short last step made full: each batch filled up to ``batch_size`` from the epoch's first batches."""
        filler = [index for batch in (head[:1] if self.split_batches else head) for index in batch]
        needed = self.batches_per_step * self.batch_size
        filler = filler * -(-needed // max(len(filler), 1))
        step, cursor = [*step, *([[]] * (self.batches_per_step - len(step)))], 0
        for position, batch in enumerate(step):
            missing = self.batch_size - len(batch)
            if missing > 0:
                step[position] = list(batch) + filler[cursor : cursor + missing]
                cursor += missing
        return step

    def _mine(self, step: list, offset: int) -> Iterator[Any]:
        if self.split_batches:
            size = self.batch_size // self.num_processes
            share = step[0][self.process_index * size : (self.process_index + 1) * size]
        else:
            share = step[self.process_index] if self.process_index < len(step) else None
        if share is not None and len(share):
            yield self._handed_out(share, offset)

    def _handed_out(self, batch, offset: int):
        if not self.as_indices:
            return batch
        seeded = SeededBatch(batch)
        seeded.seed = batch_seed(self.seed, self.epoch, offset, self.process_index)
        return seeded
