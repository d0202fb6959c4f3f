"""Sharded data loading: distinct samples per rank, seeded shuffling, even batch counts.

How each global batch is split across ranks, shuffled and seeded is :mod:`runner.engine.loaders.sampling`
(its names are importable from the package, :mod:`runner.engine.loaders`, too). This module holds the loader
those samplers feed: it moves batches to the device, counts each pass's batches so the Accelerator knows when an epoch
ends, and records its position for ``save_state``.

Map-style datasets are sharded by index (each rank loads only its samples). Iterable datasets, and
any dataset with ``dispatch_batches``, go through :mod:`runner.engine.loaders.dispatch`, with the same
global batches, padding and positions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.loaders.batch_shards import BatchSamplerShard
from runner.engine.loaders.sampling import SeedableRandomSampler, Sharding
from runner.engine.loaders.shuffles import PlainShuffle, int64_draw
from runner.engine.loaders.stream_states import check_stream_state
from runner.engine.ops import send_to_device

logger = logging.getLogger("runner")

__all__ = ["BatchShardedDataLoader", "DataLoaderConfiguration", "PreparedDataLoader"]


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
        use_seedable_sampler: Shuffle from a :class:`SeedableRandomSampler`, whose order is a function of
            the seed and the epoch (``set_epoch``). Off (the default, as in Accelerate), a prepared
            loader draws its order exactly as the unprepared one does, from the loader's generator or
            torch's global one (see :class:`PlainShuffle`): on one process it yields the plain loader's
            batches, on several the same order cut into per-rank slices. Either way the order is the
            same on every process and resumes exactly.
        use_stateful_dataloader: Accepted for compatibility; prepared loaders always record their
            position in ``save_state`` and continue from it after ``load_state``.
        non_blocking: Copy batches to the GPU with ``non_blocking=True`` (pair it with pin_memory).
        data_seed: The seed of the seedable sampler (giving one turns ``use_seedable_sampler`` on),
            which also seeds the loader's workers and batches. None (the default): the loader's
            generator's seed if it has one, else torch's initial seed; rank 0's either way.
    """

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    use_stateful_dataloader: bool = True
    non_blocking: bool = False
    data_seed: int | None = None

    @property
    def seedable(self) -> bool:
        """Whether prepared loaders shuffle with a :class:`SeedableRandomSampler`."""
        return self.use_seedable_sampler or self.data_seed is not None


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
        shuffle: PlainShuffle | None = None,
        base_generator: torch.Generator | None = None,
        **kwargs,
    ):
        super().__init__(dataset, generator=torch.Generator(), **kwargs)
        self.seed = seed
        self.shuffle = shuffle  # draws each pass's order as the unprepared loader does, if it shuffles so
        # The user's loader's generator (None: torch's global one), which each pass draws one number from, as torch
        # draws its workers' base seed: so the draws after a pass (the next shuffle, dropout) are a plain loader's.
        self.base_generator = base_generator
        self._resumes_pass = False  # a loaded position is mid-pass: that pass made its draws before it was saved
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
        self._stream_state: Any = None  # a stateful stream's state after the last batch handed out
        self._pending_stream_state: Any = None  # loaded: where the next pass's stream continues

    @property
    def total_batch_size(self) -> int:
        return self.sharding.global_batch_size

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose shuffle order the next pass uses."""
        self.iteration = epoch

    # What a position counts, and how far each step moves it: samples, a global batch of them.
    _position_key = "samples_seen"
    # Where a position keeps its stream's state: the stream's own (read in this process), or its workers'.
    _stream_key = "dataset_state"

    @property
    def _step_size(self) -> int:
        return self.total_batch_size

    def skip_first_batches(self, num_batches: int) -> None:
        """Make the next pass start after its first ``num_batches`` batches."""
        self._skip_on_next_pass = num_batches * self._step_size

    @property
    def samples_seen(self) -> int:
        """Samples of the current epoch handed out so far, on all ranks together."""
        return self._position

    @property
    def _position(self) -> int:
        return self._skipped_this_pass + self._batches_yielded * self._step_size

    @property
    def _shuffler(self) -> SeedableRandomSampler | None:
        """The seeded sampler whose seed a position records, if the loader shuffles with one."""
        sampler = getattr(self.batch_sampler, "sampler", None)
        return sampler if isinstance(sampler, SeedableRandomSampler) else None

    def state_dict(self) -> dict[str, int]:
        """The position in the data: the epoch, the samples of it handed out, and its shuffle seed.

        Positions count samples, not batches, so a run can continue on another number of processes.
        """
        key = self._position_key
        complete = False
        if self._skip_on_next_pass:  # loaded, not iterated yet: the position is the pending one
            state = {"epoch": self.iteration, key: self._skip_on_next_pass}
            stream_state = self._pending_stream_state
        elif self._pass_batches and self._batches_yielded == self._pass_batches:
            state = {"epoch": self.iteration + 1, key: 0}  # complete; the generator has not returned
            complete, stream_state = True, None  # the next epoch's stream starts from its beginning
        else:
            state = {"epoch": self.iteration, key: self._position}
            stream_state = self._stream_state if self._batches_yielded else None
        if stream_state is not None:
            state[self._stream_key] = stream_state
        if self._shuffler is not None:
            state["seed"] = self._shuffler.seed
        if self.shuffle is not None:
            state.update(self.shuffle.state(between_passes=complete))
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict` position on the next pass."""
        if self._position_key not in state:
            raise ValueError(
                f"This loader's position has no {self._position_key!r} (it records {sorted(state)}): a loader that "
                "counts its position differently saved it; prepare the same kind of DataLoader as the saved run."
            )
        if self.shuffle is not None:
            self.shuffle.load(state)
        elif "generators" in state:
            raise ValueError(
                "This loader's saved position records the generators of a plain shuffle, but this loader shuffles "
                "with a seedable sampler (or not at all); prepare it as the saved run did (use_seedable_sampler)."
            )
        self.iteration = state["epoch"]
        self._skip_on_next_pass = state[self._position_key]
        self._resumes_pass = bool(self._skip_on_next_pass)
        self._pending_stream_state = None
        if self._skip_on_next_pass and ("dataset_state" in state or "worker_states" in state):
            self._pending_stream_state = self._saved_stream(state)
        if "seed" in state and self._shuffler is not None:
            self._shuffler.seed = state["seed"]

    def _saved_stream(self, state: dict[str, Any]) -> Any:
        """The stream's saved state this loader continues from: it was read by as many loader workers as this
        loader has (each reads its own part of a stream, so a position of one split fits no other)."""
        workers = state.get("worker_states")
        saved = 0
        if workers is not None:
            if not (isinstance(workers, dict) and isinstance(workers.get("workers"), list) and workers["workers"]):
                raise CheckpointError(
                    "The checkpoint's loader position holds a damaged worker_states (each loader worker's stream "
                    "state); resume from another checkpoint."
                )
            saved = len(workers["workers"])
        if saved != self.num_workers:
            readers = f"{saved} loader workers" if saved else "the main process alone (num_workers=0)"
            raise CheckpointError(
                f"This loader's stream was checkpointed as read by {readers}, and a stream is split between a "
                f"loader's workers, so it continues only with the same number: resume with num_workers={saved} "
                f"(this loader has {self.num_workers})."
            )
        saved_state = state.get(self._stream_key)
        return None if saved_state is None else self._checked_stream_state(saved_state)

    @property
    def _stream(self) -> Any:
        """The user's stream whose state a position records: the one this loader's shard of it wraps."""
        return getattr(self.dataset, "dataset", self.dataset)

    def _checked_stream_state(self, saved: Any) -> Any:
        """``saved`` (a position's ``dataset_state``) if this loader's stream can continue from it; else one sentence
        naming its field (see :mod:`runner.engine.loaders.stream_states`). A stream's state is checked as it is loaded,
        before any pass reads it: a wrong one would fail deep in a pass, or resume on other data."""
        check_stream_state(self._stream, saved, field=self._stream_key)
        return saved

    def _take_stream_state(self, dataset: Any, skip: int, tracked: bool, *, log: bool = True) -> Any:
        """The saved state the stream of this pass continues from, if it can (``tracked``: the loader records
        one, the stream's or its workers'); else None, and a pass that starts ``skip`` samples in reads past
        them, which is said once."""
        state, self._pending_stream_state = self._pending_stream_state, None
        if skip and tracked and state is not None:
            return state
        if skip and log:
            if tracked:
                why = "the checkpoint holds no state of it"
            elif callable(getattr(dataset, "state_dict", None)):
                why = "its loader's persistent_workers keep their own copies of it, which do not report their state"
            else:
                why = "it has no state_dict"
            logger.warning(
                "Resuming %s by reading past the %d samples already seen this epoch (%s); a stream with state_dict() "
                "and load_state_dict() resumes at once.",
                type(dataset).__name__, skip, why,
            )  # fmt: skip
        return None

    def real_rows(self, rows: int) -> int:
        """How many of the ``rows`` rows of the batch just handed out are samples, not ``even_batches`` padding: all
        but in the padded last step, where the padding ends each rank's batch (and the global batch).

        A loss a model computes over a whole batch averages its padding in; at that step (``end_of_dataloader``
        with ``remainder > 0``, on every rank alike) evaluate the first ``real_rows`` rows again for the real mean.
        """
        if not self.end_of_dataloader or self.remainder <= 0:
            return rows
        return self.sharding.real_rows(self.remainder, rows)

    def _to_device(self, batch: Any) -> Any:
        if not self._moves_batches:
            return batch
        return send_to_device(batch, self.device, non_blocking=self.non_blocking)

    def __iter__(self) -> Iterator[Any]:
        if self.on_epoch_start is not None:
            self.on_epoch_start()
        skip, self._skip_on_next_pass = self._skip_on_next_pass, 0
        self._skipped_this_pass = skip
        self._stream_state = None
        self._batches_yielded = self._pass_batches = 0
        self.end_of_dataloader = False
        self.remainder = -1
        # torch draws each pass's worker seed from the loader's generator. Seeded from (seed, epoch,
        # rank), it differs between ranks (their workers augment independently) and is the same in a
        # resumed run. 7919 and 104729 are primes: no two (epoch, rank) pairs of a real run collide.
        rank = self.sharding.process_index
        self.generator.manual_seed((self.seed + 7919 * self.iteration + 104729 * rank) % 2**64)
        resumes, self._resumes_pass = self._resumes_pass, False
        if self.shuffle is not None:
            self.shuffle.begin_pass()
        elif not resumes:  # a resumed pass's draw is in the generator states the checkpoint restored
            int64_draw(self.base_generator)
        self.gradient_state.activate(self)
        try:
            yield from self._pass(skip)
            self.iteration += 1
            self._skipped_this_pass = self._batches_yielded = self._pass_batches = 0
            if self.shuffle is not None:
                self.shuffle.end_pass()
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


class BatchShardedDataLoader(PreparedDataLoader):
    """A prepared loader over this rank's share of the batches of a user's batch sampler (a :class:`BatchSamplerShard`).

    Its position counts the user's batches (``batches_seen``), since their sizes may vary; the
    ``samples_seen`` it also records is that count times the batch sampler's ``batch_size`` (the count
    itself where it has none), for the manifest. A pass resumed from a position draws the epoch's
    batches again from the batch sampler and skips the ones already handed out, without loading them:
    exact for a batch sampler that yields the same batches each time an epoch is replayed (seeded
    from ``set_epoch``, or from a generator, which is reseeded each epoch).

    Args:
        batches: This rank's share of the user's batches.
        as_sampler: The user's loader took its batch sampler as ``sampler=`` with ``batch_size=None``
            (the dataset gets each batch whole); otherwise as ``batch_sampler=``.
    """

    _position_key = "batches_seen"

    def __init__(self, dataset, *, batches: BatchSamplerShard, as_sampler: bool, **kwargs: Any) -> None:
        slot = {"sampler": batches, "batch_size": None} if as_sampler else {"batch_sampler": batches}
        super().__init__(dataset, **slot, **kwargs)
        self.batches = batches

    @property
    def total_batch_size(self) -> int | None:
        """The user's batch size times the processes (once with ``split_batches``); None without one."""
        return None if self.batches.batch_size is None else self.sharding.global_batch_size

    @property
    def _step_size(self) -> int:
        return self.batches.batches_per_step

    @property
    def _shuffler(self) -> SeedableRandomSampler | None:
        sampler = self.batches.sampler
        return sampler if isinstance(sampler, SeedableRandomSampler) else None

    @property
    def samples_seen(self) -> int:
        return self._position * (self.batches.batch_size or 1)

    def state_dict(self) -> dict[str, int]:
        state = super().state_dict()
        state["samples_seen"] = state["batches_seen"] * (self.batches.batch_size or 1)
        return state

    def _pass(self, skip: int) -> Iterator[Any]:
        batches = self.batches
        batches.set_epoch(self.iteration)
        batches.skip_batches = skip
        count = batches.num_batches(skip)

        def ended() -> None:
            self.remainder = batches.remainder

        if count is None:  # the last batch's length decides: fetch one ahead to know which is the last
            yield from self._flag_last(map(self._to_device, DataLoader.__iter__(self)), ended)
            return
        self._pass_batches = count
        self.end_of_dataloader = count == 0
        for batch in DataLoader.__iter__(self):
            self._batches_yielded += 1
            self.end_of_dataloader = self._batches_yielded == count
            if self.end_of_dataloader:
                ended()  # the batch sampler has produced the last step by now, loader workers or not
            yield self._to_device(batch)
