"""A user's own batch sampler, sharded by whole batches: each rank gets its share of the batches it yields.

``DataLoader(batch_sampler=...)`` with a sampler other than torch's ``BatchSampler`` (or a
``BatchSampler`` given as ``sampler`` with ``batch_size=None``) decides the batches itself, so they
are not cut into global batches of samples as :mod:`runner.engine.loaders.sampling` does: they are handed
out whole, as Accelerate's ``BatchSamplerShard`` hands them out.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from runner.engine.loaders.sampling import SeededBatch, batch_seed


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
        self.reseeds = True  # False when a PlainShuffle draws the order
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
            elif self.reseeds and isinstance(getattr(target, "generator", None), torch.Generator):
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
        """Whether a step needs no padding: all its batches, the last one full (Accelerate's test)."""
        if len(step) < self.batches_per_step:
            return False
        return self.batch_size is None or len(step[-1]) >= self.batch_size

    def _check_split(self, step: list) -> None:
        if self.split_batches and len(step[0]) != self.batch_size:  # every rank sees the same batches: all raise
            raise ValueError(
                f"split_batches=True needs every batch but the last to hold batch_size={self.batch_size} samples, "
                f"and {type(self.batch_sampler).__name__} yielded one of {len(step[0])}; turn split_batches off."
            )

    def _completed(self, step: list, head: list) -> list[list]:
        """A short last step made full as Accelerate makes it: its last batch filled up to ``batch_size``, and the
        batches missing after it, from the epoch's first batches. Earlier batches stay as they are, so the
        padding comes last and ``remainder`` counts exactly the real samples before it."""
        filler = [index for batch in (head[:1] if self.split_batches else head) for index in batch]
        needed = self.batches_per_step * self.batch_size
        filler = filler * -(-needed // max(len(filler), 1))
        real = len(step)
        step, cursor = [*step, *([[]] * (self.batches_per_step - real))], 0
        for position in range(real - 1, len(step)):
            missing = self.batch_size - len(step[position])
            if missing > 0:
                step[position] = list(step[position]) + filler[cursor : cursor + missing]
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
