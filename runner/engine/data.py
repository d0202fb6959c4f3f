"""Sharded data loading: distinct samples per rank, seeded shuffling, even batch counts.

How each global batch is split across ranks, shuffled and seeded is :mod:`runner.engine.sampling`
(its names are importable from here too). This module holds the loader those samplers feed: it
moves batches to the device, counts each pass's batches so the Accelerator knows when an epoch
ends, and records its position for ``save_state``.

Map-style datasets are sharded by index (each rank loads only its samples). Iterable datasets, and
any dataset with ``dispatch_batches``, go through :mod:`runner.engine.dispatch`, with the same
global batches, padding and positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from runner.engine.ops import send_to_device
from runner.engine.sampling import (
    SeedableRandomSampler,
    SeededBatch,
    ShardedBatchSampler,
    Sharding,
    batch_seed,
    seed_generators,
    seeded_worker_init_fn,
)

__all__ = [
    "DataLoaderConfiguration",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "SeededBatch",
    "ShardedBatchSampler",
    "Sharding",
    "batch_seed",
    "seed_generators",
    "seeded_worker_init_fn",
]


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders (Accelerate's names).

    Args:
        split_batches: The loader's ``batch_size`` is the global batch, split across processes
            (it must divide evenly). Otherwise each process gets batches of ``batch_size``.
        dispatch_batches: Rank 0 loads each global batch and sends every rank its slice; the other
            ranks never touch the dataset. None (the default) means on for iterable datasets and
            off for map-style ones.
        even_batches: Pad the last global batch with samples from the start of the epoch so every
            process runs the same number of steps. Without it some processes may get a smaller last
            batch, or none.
        use_seedable_sampler: Accepted for compatibility; shuffling here is always seeded, identical
            across processes and different each epoch.
        use_stateful_dataloader: Accepted for compatibility; prepared loaders always record their
            position in ``save_state`` and continue from it after ``load_state``.
        non_blocking: Copy batches to the GPU with ``non_blocking=True`` (pair it with pin_memory).
        data_seed: The seed prepared loaders shuffle from (and seed their workers and batches from),
            as Accelerate's seedable sampler does. None (the default): the loader's generator's
            seed if it has one, else torch's initial seed; rank 0's either way.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = True
    use_stateful_dataloader: bool = True
    non_blocking: bool = False
    data_seed: int | None = None


class PreparedDataLoader(DataLoader):
    """A DataLoader over this rank's shard that moves batches to the device.

    It counts the batches of each pass, so that while the last one is processed the Accelerator
    already knows the epoch is ending (``accumulate`` syncs there; ``gather_for_metrics`` trims the
    padding) without fetching ahead: a dataset's random draws happen in the order of an
    uninterrupted run, which keeps resume exact. Each full pass advances the epoch, which reseeds
    the shuffle (and the loader's own generator, whose draw seeds the worker processes);
    ``set_epoch`` sets it.

    Subclasses for iterable datasets and dispatched batches replace :meth:`_pass`.
    """

    def __init__(
        self,
        dataset,
        *,
        device: torch.device | None,
        gradient_state,
        non_blocking: bool,
        sharding: Sharding,
        on_epoch_start: Callable[[], None] | None = None,
        seed: int = 0,
        **kwargs,
    ):
        super().__init__(dataset, generator=torch.Generator(), **kwargs)
        self.seed = seed
        self.sharding = sharding
        self.on_epoch_start = on_epoch_start
        self.device = device
        # Decided once: the loader already yields CPU tensors, so a CPU run has nothing to move.
        self._moves_batches = device is not None and device.type != "cpu"
        self.gradient_state = gradient_state
        self.non_blocking = non_blocking
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = -1
        self._skip_on_next_pass = 0  # samples
        self._skipped_this_pass = 0
        self._batches_yielded = 0
        self._pass_batches = 0  # this rank's batches in the current pass, once known

    @property
    def total_batch_size(self) -> int:
        return self.sharding.global_batch_size

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle order the next pass uses."""
        self.iteration = epoch

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next pass start after its first ``num_batches`` batches."""
        self._skip_on_next_pass = num_batches * self.total_batch_size

    @property
    def samples_seen(self) -> int:
        """Samples of the current epoch handed out so far, on all ranks together."""
        return self._skipped_this_pass + self._batches_yielded * self.total_batch_size

    def state_dict(self) -> dict[str, int]:
        """The position in the data: the epoch, the samples of it handed out, and its shuffle seed.

        Positions count samples, not batches, so a run can continue on another number of processes.
        """
        if self._skip_on_next_pass:  # loaded, not iterated yet: the position is the pending one
            state = {"epoch": self.iteration, "samples_seen": self._skip_on_next_pass}
        elif self._pass_batches and self._batches_yielded == self._pass_batches:
            state = {"epoch": self.iteration + 1, "samples_seen": 0}  # complete; the generator has not returned
        else:
            state = {"epoch": self.iteration, "samples_seen": self.samples_seen}
        sampler = getattr(self.batch_sampler, "sampler", None)
        if isinstance(sampler, SeedableRandomSampler):
            state["seed"] = sampler.seed
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict` position on the next pass."""
        self.iteration = state["epoch"]
        self._skip_on_next_pass = state["samples_seen"]
        sampler = getattr(self.batch_sampler, "sampler", None)
        if "seed" in state and isinstance(sampler, SeedableRandomSampler):
            sampler.seed = state["seed"]

    def _to_device(self, batch: Any) -> Any:
        if not self._moves_batches:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def __iter__(self) -> Iterator[Any]:
        if self.on_epoch_start is not None:
            self.on_epoch_start()
        skip, self._skip_on_next_pass = self._skip_on_next_pass, 0
        self._skipped_this_pass = skip
        self._batches_yielded = self._pass_batches = 0
        self.end_of_dataloader = False
        self.remainder = -1
        # torch draws each pass's worker seed from the loader's generator. Seeded from (seed, epoch,
        # rank), it differs between ranks (their workers augment independently) and is the same in a
        # resumed run. 7919 and 104729 are primes: no two (epoch, rank) pairs of a real run collide.
        rank = self.sharding.process_index
        self.generator.manual_seed((self.seed + 7919 * self.iteration + 104729 * rank) % 2**64)
        self.gradient_state.activate(self)
        try:
            yield from self._pass(skip)
            self.iteration += 1
            self._skipped_this_pass = self._batches_yielded = self._pass_batches = 0
        finally:
            self.gradient_state.deactivate(self)

    def _pass(self, skip: int) -> Iterator[Any]:
        """This rank's batches of one pass that starts ``skip`` samples into the epoch."""
        sampler = self.batch_sampler
        sampler.set_epoch(self.iteration)
        sampler.skip_samples = skip
        self.remainder = sampler.remainder_after(skip)
        self._pass_batches = sampler.num_batches(skip)
        self.end_of_dataloader = self._pass_batches == 0
        for batch in super().__iter__():
            self._batches_yielded += 1
            self.end_of_dataloader = self._batches_yielded == self._pass_batches
            yield self._to_device(batch)

    def _flag_last(self, batches: Iterator[Any], on_exhausted: Callable[[], None]) -> Iterator[Any]:
        """Yield ``batches`` one behind, so the last is flagged when it is handed out.

        For streams of unknown length; ``on_exhausted`` runs once the stream has ended, before the
        last batch is yielded.
        """
        current = next(batches, _EXHAUSTED)
        for upcoming in batches:
            self._batches_yielded += 1
            yield current
            current = upcoming
        on_exhausted()
        if current is not _EXHAUSTED:
            self._batches_yielded += 1
            self._pass_batches = self._batches_yielded
            self.end_of_dataloader = True
            yield current
        self.end_of_dataloader = True


_EXHAUSTED = object()
