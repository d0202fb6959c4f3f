"""Sharded data loading: distinct samples per rank, seeded shuffling, even batch counts.

The sampler's index stream is cut into *global batches* of ``batch_size * num_processes`` indices
(or ``batch_size`` with ``split_batches``); rank ``r`` takes the r-th slice of each. At every step the
ranks together see exactly the batch one process would see with the global batch size, which is what
makes N processes x batch b equal to 1 process x batch N*b.

The last global batch may be short. With ``even_batches`` (the default) it is padded with samples
from the start of the epoch to the next multiple of ``num_processes`` and split evenly, so every rank
runs the same number of steps; ``gather_for_metrics`` drops the padding again, because the gathered
slices concatenate back into the padded global batch in rank order.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler

from runner.engine.ops import send_to_device


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards dataloaders (Accelerate's names).

    Args:
        split_batches: The loader's ``batch_size`` is the global batch, split across processes
            (it must divide evenly). Otherwise each process gets batches of ``batch_size``.
        even_batches: Pad the last global batch with samples from the start of the epoch so every
            process runs the same number of steps. Without it some processes may get a smaller last
            batch, or none.
        use_seedable_sampler: Accepted for compatibility; shuffling here is always seeded, identical
            across processes and different each epoch.
        use_stateful_dataloader: Accepted for compatibility; prepared loaders always record their
            position in ``save_state`` and continue from it after ``load_state``.
        non_blocking: Copy batches to the GPU with ``non_blocking=True`` (pair it with pin_memory).
    """

    split_batches: bool = False
    even_batches: bool = True
    use_seedable_sampler: bool = True
    use_stateful_dataloader: bool = True
    non_blocking: bool = False


class SeedableRandomSampler(Sampler[int]):
    """A random permutation drawn from ``seed + epoch``: the same on every rank, new each epoch."""

    def __init__(self, data_source, *, seed: int, replacement: bool = False, num_samples: int | None = None):
        self.data_source = data_source
        self.seed = seed
        self.epoch = 0
        self.replacement = replacement
        self._num_samples = num_samples

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed((self.seed + self.epoch) % 2**64)
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
    """Yields this rank's slice of each global batch of the wrapped sampler's indices."""

    def __init__(
        self,
        sampler: Sampler[int],
        *,
        batch_size: int,
        drop_last: bool,
        num_processes: int,
        process_index: int,
        split_batches: bool = False,
        even_batches: bool = True,
    ) -> None:
        if split_batches:
            if batch_size % num_processes:
                raise ValueError(
                    f"split_batches=True needs a batch size divisible by the {num_processes} processes, "
                    f"got {batch_size}; change the batch size or turn split_batches off."
                )
            self.per_process = batch_size // num_processes
        else:
            self.per_process = batch_size
        self.sampler = sampler
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.even_batches = even_batches
        self.global_batch_size = self.per_process * num_processes
        self.skip_samples = 0  # applies to the next pass only
        self.seed: int | None = None  # reseeds a sampler's own generator each epoch (see set_epoch)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        elif self.seed is not None and isinstance(getattr(self.sampler, "generator", None), torch.Generator):
            # SubsetRandomSampler, WeightedRandomSampler, ...: the same draws on every rank, new each epoch.
            self.sampler.generator.manual_seed((self.seed + epoch) % 2**64)

    def remainder_after(self, skipped: int) -> int:
        """Real samples in the padded last global batch of a pass that skips ``skipped`` samples, or -1."""
        short = (len(self.sampler) - skipped) % self.global_batch_size
        padded = short and not self.drop_last and self.even_batches and short % self.num_processes
        return short if padded else -1

    @property
    def remainder(self) -> int:
        return self.remainder_after(0)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip_samples = self.skip_samples, 0
        rank, size = self.process_index, self.per_process
        indices = iter(self.sampler)
        # The epoch's first global batch pads its short last one, also in a pass that resumes mid-epoch,
        # so an interrupted epoch sees exactly the samples of an uninterrupted one.
        head = list(itertools.islice(indices, self.global_batch_size))
        batch: list[int] = []
        # Skipped samples cost index arithmetic only, never a sample load.
        for index in itertools.islice(itertools.chain(head, indices), skip, None):
            batch.append(index)
            if len(batch) == self.global_batch_size:
                yield batch[rank * size : (rank + 1) * size]
                batch = []
        if batch and not self.drop_last:
            yield from self._last_batch(batch, head)

    def _last_batch(self, batch: list[int], head: list[int]) -> Iterator[list[int]]:
        if self.num_processes == 1:
            yield batch
            return
        size = math.ceil(len(batch) / self.num_processes)
        if self.even_batches:
            filler = head + batch if len(head) == self.global_batch_size else batch
            batch = batch + [filler[i % len(filler)] for i in range(size * self.num_processes - len(batch))]
        mine = batch[self.process_index * size : (self.process_index + 1) * size]
        if mine:
            yield mine

    def num_batches(self, skipped: int = 0) -> int:
        """This rank's batches in a pass that skips the epoch's first ``skipped`` samples."""
        full, short = divmod(max(len(self.sampler) - skipped, 0), self.global_batch_size)
        if not short or self.drop_last:
            return full
        if self.even_batches or self.num_processes == 1:
            return full + 1
        return full + int(self.process_index * math.ceil(short / self.num_processes) < short)

    def __len__(self) -> int:
        return self.num_batches(0)


class PreparedDataLoader(DataLoader):
    """A DataLoader over this rank's shard that moves batches to the device.

    It counts the batches of each pass, so that while the last one is processed the Accelerator
    already knows the epoch is ending (``accumulate`` syncs there; ``gather_for_metrics`` trims the
    padding) without fetching ahead: a dataset's random draws happen in the order of an
    uninterrupted run, which keeps resume exact. Each full pass advances the epoch, which reseeds
    the shuffle (and the loader's own generator, whose draw seeds the worker processes);
    ``set_epoch`` sets it.
    """

    def __init__(
        self,
        dataset,
        *,
        device: torch.device | None,
        gradient_state,
        non_blocking: bool,
        on_epoch_start: Callable[[], None] | None = None,
        seed: int = 0,
        **kwargs,
    ):
        super().__init__(dataset, generator=torch.Generator(), **kwargs)
        self.seed = seed
        self.on_epoch_start = on_epoch_start
        self.device = device
        # Decided once: the loader already yields CPU tensors, so a CPU run has nothing to move.
        self._moves_batches = device is not None and device.type != "cpu"
        self.gradient_state = gradient_state
        self.non_blocking = non_blocking
        self.iteration = 0
        self.end_of_dataloader = False
        self.remainder = self.batch_sampler.remainder
        self._skip_on_next_pass = 0  # samples
        self._skipped_this_pass = 0
        self._batches_yielded = 0
        self._pass_batches = 0

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
        sampler = self.batch_sampler.sampler
        if isinstance(sampler, SeedableRandomSampler):
            state["seed"] = sampler.seed
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict` position on the next pass."""
        self.iteration = state["epoch"]
        self._skip_on_next_pass = state["samples_seen"]
        sampler = self.batch_sampler.sampler
        if "seed" in state and isinstance(sampler, SeedableRandomSampler):
            sampler.seed = state["seed"]

    @property
    def total_batch_size(self) -> int:
        sampler = self.batch_sampler
        return sampler.global_batch_size if isinstance(sampler, ShardedBatchSampler) else self.batch_size

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def _to_device(self, batch: Any) -> Any:
        if not self._moves_batches:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def __iter__(self) -> Iterator[Any]:
        if self.on_epoch_start is not None:
            self.on_epoch_start()
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(self.iteration)
        skip, self._skip_on_next_pass = self._skip_on_next_pass, 0
        self.batch_sampler.skip_samples = self._skipped_this_pass = skip
        self.remainder = self.batch_sampler.remainder_after(skip)
        self._pass_batches = self.batch_sampler.num_batches(skip)
        self._batches_yielded = 0
        self.end_of_dataloader = self._pass_batches == 0
        # torch draws each pass's worker seed from the loader's generator. Seeded from (seed, epoch,
        # rank), it differs between ranks (their workers augment independently) and is the same in a
        # resumed run. 7919 and 104729 are primes: no two (epoch, rank) pairs of a real run collide.
        rank = self.batch_sampler.process_index
        self.generator.manual_seed((self.seed + 7919 * self.iteration + 104729 * rank) % 2**64)
        self.gradient_state.activate(self)
        try:
            for batch in super().__iter__():
                self._batches_yielded += 1
                self.end_of_dataloader = self._batches_yielded == self._pass_batches
                yield self._to_device(batch)
            self.iteration += 1
            self._skipped_this_pass = self._batches_yielded = self._pass_batches = 0
        finally:
            self.gradient_state.deactivate(self)


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


def _shuffle_seed(dataloader: DataLoader, broadcast_seed) -> int:
    """The seed shared by all ranks: the loader's generator's if it has one, else rank 0's torch seed."""
    generator = getattr(dataloader.sampler, "generator", None) or dataloader.generator
    seed = generator.initial_seed() if generator is not None else torch.initial_seed()
    return broadcast_seed(seed)


def prepare_data_loader(
    dataloader: DataLoader,
    *,
    device: torch.device | None,
    num_processes: int,
    process_index: int,
    gradient_state,
    config: DataLoaderConfiguration,
    broadcast_seed: Callable[[int], int] = lambda seed: seed,
    on_epoch_start: Callable[[], None] | None = None,
) -> PreparedDataLoader:
    """Rebuild ``dataloader`` over this rank's shard of every global batch.

    Args:
        dataloader: A map-style DataLoader with automatic batching (``batch_size`` set) or a
            ``batch_sampler``.
        device: Where batches are moved, or None to leave them where the loader puts them.
        broadcast_seed: Makes rank 0's shuffle seed everyone's (a collective when distributed).
        on_epoch_start: Called when each pass begins (to synchronise RNG states, say).

    Raises:
        ValueError: For an IterableDataset or a loader without batching, which cannot be sharded by
            index.
    """
    if isinstance(dataloader.dataset, IterableDataset):
        raise ValueError(
            "prepare() shards map-style datasets by index; this DataLoader wraps an IterableDataset, "
            "so give it a map-style Dataset (one with __len__ and __getitem__)."
        )
    if dataloader.batch_sampler is None:
        raise ValueError("prepare() needs a batched DataLoader; set batch_size (not None) when building it.")
    batch_sampler = dataloader.batch_sampler
    if type(batch_sampler) is not BatchSampler:
        raise ValueError(
            f"prepare() cannot shard a custom batch_sampler ({type(batch_sampler).__name__}); pass a "
            "sampler and batch_size to the DataLoader instead."
        )
    sampler = batch_sampler.sampler
    seed = _shuffle_seed(dataloader, broadcast_seed)
    if isinstance(sampler, RandomSampler):
        sampler = SeedableRandomSampler(
            sampler.data_source, seed=seed, replacement=sampler.replacement, num_samples=sampler._num_samples
        )
    elif hasattr(sampler, "generator") and not hasattr(sampler, "set_epoch"):
        sampler = copy.copy(sampler)  # a random sampler of the user's: give it a generator every rank seeds alike
        sampler.generator = torch.Generator()
    sharded = ShardedBatchSampler(
        sampler,
        batch_size=batch_sampler.batch_size,
        drop_last=batch_sampler.drop_last,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=config.split_batches,
        even_batches=config.even_batches,
    )
    sharded.seed = seed
    options = {name: getattr(dataloader, name) for name in _LOADER_OPTIONS if hasattr(dataloader, name)}
    if options.get("num_workers", 0) == 0:
        options.pop("prefetch_factor", None)
        options.pop("persistent_workers", None)
    return PreparedDataLoader(
        dataloader.dataset,
        batch_sampler=sharded,
        device=device,
        gradient_state=gradient_state,
        non_blocking=config.non_blocking,
        on_epoch_start=on_epoch_start,
        seed=seed,
        **options,
    )
