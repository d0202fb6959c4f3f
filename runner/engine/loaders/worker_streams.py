"""Streams read by a loader's worker processes, each its own part, checkpointed by every worker's state.

torch gives each loader worker its own copy of an iterable dataset. A stream that splits itself by
``torch.utils.data.get_worker_info()`` reads a different part in each (a Hugging Face ``IterableDataset``
deals its shards, ``n_shards``, to the workers; ``runner.data.Packed`` and ``Mixture`` over such streams
follow their sources), and the loader hands out the workers' batches in turn, leaving out a worker
whose part has ended. For a stream with ``state_dict()``/``load_state_dict()`` and ``num_workers > 0``:

- :class:`WorkerStream` is what the workers iterate: the stream, started in each worker from that worker's
  saved state, in the loader's batches, followed by an end marker, so this process learns where each
  worker's part ended.
- :class:`TaggedCollate` collates in the worker and tags each batch with the worker and its stream's state
  after the batch.
- :class:`WorkerRouter` hands the batches out in the order of an uninterrupted run: after a resume it
  starts with the worker whose batch was due, though torch starts every pass with worker 0.

A position (the manifest's ``worker_states``, JSON) holds each worker's state before its next batch
(null: its part from the start), the workers whose part has ended, the worker whose batch comes next,
and the rows of that batch already handed out (a global batch may end inside a worker's batch). It
continues with the same number of workers; nothing already seen is read again but those rows. Each
worker's state names the worker that saved it (``{"loader_worker": 1, "stream_state": ...}``), since a
worker's part follows from its number: a state in another worker's place would read another part.
A position is checked when it is loaded (:func:`checked_position`), its states by their stream; one saved
before states named their worker (a bare stream state) still loads.
"""

from __future__ import annotations

import collections
import itertools
import json
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from runner.engine.loaders.dispatch import DispatchedDataLoader, batch_rows, concat_rows, slice_rows, stateful
from runner.engine.loaders.loader import PreparedDataLoader
from runner.engine.loaders.stream_states import check_stream_state, is_count, shown, stream_state_error

_POSITION_KEYS = ("workers", "ended", "next", "rows")
_NAMED_STATE_KEYS = {"loader_worker", "stream_state"}


class _End:
    """What a worker's stream yields after its last sample."""


class WorkerStream(IterableDataset):
    """The dataset the workers iterate: ``dataset`` from this worker's state in ``resume``, then an end marker.

    ``resume`` and ``ended`` are set before each pass starts its workers (which copy this object).
    With ``drop_last``, a worker's short last batch is left out here, so that the end marker still arrives.
    """

    def __init__(self, dataset: IterableDataset, batch_size: int, drop_last: bool) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.tracked = False  # whether each batch carries the stream's state (TaggedCollate)
        self.resume: list[Any] | None = None  # each worker's state to start from; None: every part from its start
        self.ended: frozenset[int] = frozenset()  # workers whose part had ended

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)  # TypeError for a stream without a length

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if worker not in self.ended:
            if self.resume is not None and self.resume[worker] is not None:
                self.dataset.load_state_dict(self.resume[worker])
            batch: list[Any] = []
            for sample in self.dataset:
                batch.append(sample)
                if len(batch) == self.batch_size:
                    yield from batch
                    batch = []
            if batch and not self.drop_last:
                yield from batch
        yield _End()


class Tagged(NamedTuple):
    """A worker's batch (None: its part ended with a full batch), the worker, and its stream's state after it."""

    batch: Any
    worker: int
    state: Any
    ended: bool


class TaggedCollate:
    """``collate_fn`` in the worker, its batch tagged (:class:`Tagged`)."""

    def __init__(self, collate_fn) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Tagged:
        info = get_worker_info()
        ended = bool(samples) and isinstance(samples[-1], _End)
        if ended:
            samples = samples[:-1]
        stream = info.dataset
        state = None
        if stream.tracked and not ended:
            state = {"loader_worker": info.id, "stream_state": stream.dataset.state_dict()}
        return Tagged(self.collate_fn(samples) if samples else None, info.id, state, ended)


class Piece(NamedTuple):
    """A batch the router hands out, the position that reproduces it, and the rows of it left out before ``batch``."""

    batch: Any
    before: dict[str, Any]
    offset: int


class WorkerRouter:
    """The workers' batches (from ``tagged``, torch's order) in the order of an uninterrupted run, from ``start``."""

    def __init__(self, tagged: Iterator[Tagged], workers: int, start: dict[str, Any] | None) -> None:
        self._tagged = tagged
        self._queues: list[collections.deque] = [collections.deque() for _ in range(workers)]
        start = start or {"workers": [None] * workers, "ended": [], "next": 0, "rows": 0}
        self._before = list(start["workers"])  # each worker's state before its next batch handed out
        self._ended = set(start["ended"])
        self._next = start["next"]
        self._drop = start["rows"]  # rows of the next worker's output already handed out before the checkpoint
        self._rows_handed_out = start["rows"]

    def position(self, rows: int = 0) -> dict[str, Any]:
        """Where the stream continues: after the last batch handed out (and ``rows`` of the next)."""
        return {"workers": list(self._before), "ended": sorted(self._ended), "next": self._next, "rows": rows}

    def __iter__(self) -> Iterator[Piece]:
        while len(self._ended) < len(self._queues):
            worker = self._next
            tagged = self._take(worker)
            before, offset = self.position(), 0
            batch = tagged.batch
            if self._drop and batch is not None:
                offset = min(self._drop, batch_rows(batch))
                batch = slice_rows(batch, offset, batch_rows(batch)) if offset < batch_rows(batch) else None
                self._drop -= offset
                before["rows"] = offset
            if self._drop and tagged.ended:
                raise self._more_rows_than_the_part(worker)
            self._before[worker] = tagged.state
            if tagged.ended:
                self._ended.add(worker)
            if not self._drop:  # else a batch left out whole (saved with bigger batches): its worker is still due
                self._next = self._following(worker)
            if batch is not None:
                yield Piece(batch, before, offset)

    def _more_rows_than_the_part(self, worker: int) -> Exception:
        """The rows handed out of ``worker``'s batch were part of its stream, which has ended before as many."""
        return stream_state_error(
            "worker_states.rows",
            f"{self._rows_handed_out} rows of loader worker {worker}'s batch handed out, but its part ends after "
            f"{self._rows_handed_out - self._drop}",
        )

    def _take(self, worker: int) -> Tagged:
        while not self._queues[worker]:
            tagged = next(self._tagged, None)
            if tagged is None:
                raise RuntimeError(f"Loader worker {worker}'s stream ended without its end marker.")
            self._queues[tagged.worker].append(tagged)
        return self._queues[worker].popleft()

    def _following(self, worker: int) -> int:
        count = len(self._queues)
        for step in range(1, count + 1):
            if (worker + step) % count not in self._ended:
                return (worker + step) % count
        return worker


def checked_position(position: Any, *, stream: WorkerStream, workers: int) -> dict[str, Any]:
    """``position`` (a checkpoint's ``worker_states``) if ``workers`` loader workers of ``stream`` can continue from
    it: the workers it names are this loader's, the worker due has not ended, each state sits in its own worker's
    place and fits the stream (:func:`~runner.engine.loaders.stream_states.check_stream_state`). Else one sentence
    naming the field."""
    if not isinstance(position, dict) or set(position) != set(_POSITION_KEYS):
        raise stream_state_error(
            "worker_states", f"{shown(position)} is not a position of loader workers ({', '.join(_POSITION_KEYS)})"
        )
    states, ended, due = position["workers"], position["ended"], position["next"]
    if not isinstance(states, list) or len(states) != workers:
        raise stream_state_error(
            "worker_states.workers", f"{shown(states)} is not a state for each of {workers} workers"
        )
    names_workers = isinstance(ended, list) and all(type(w) is int and 0 <= w < workers for w in ended)
    if not names_workers or ended != sorted(set(ended)):
        raise stream_state_error("worker_states.ended", f"{shown(ended)} is not a list of workers 0 to {workers - 1}")
    if type(due) is not int or not 0 <= due < workers or (due in ended and len(ended) < workers):
        raise stream_state_error(
            "worker_states.next", f"{shown(due)} is not a worker whose part goes on (0 to {workers - 1}, not ended)"
        )
    if not is_count(position["rows"]):
        raise stream_state_error("worker_states.rows", f"{shown(position['rows'])} is not a count of rows")
    for worker, saved in enumerate(states):
        _check_worker_state(saved, worker=worker, ended=worker in ended, stream=stream.dataset)
    return position


def _check_worker_state(saved: Any, *, worker: int, ended: bool, stream: Any) -> None:
    field = f"worker_states.workers[{worker}]"
    if saved is not None and ended:
        raise stream_state_error(field, f"{shown(saved)}, a state for worker {worker}, whose part has ended")
    if saved is None:
        return
    if _names_its_worker(saved):
        if saved["loader_worker"] != worker:
            raise stream_state_error(
                f"{field}.loader_worker",
                f"the state of loader worker {shown(saved['loader_worker'])} in worker {worker}'s place",
            )
        saved, field = saved["stream_state"], f"{field}.stream_state"
    check_stream_state(stream, saved, field=field)


def _names_its_worker(saved: Any) -> bool:
    """Whether ``saved`` names the worker that saved it (positions saved before that hold the bare stream state)."""
    return isinstance(saved, dict) and set(saved) == _NAMED_STATE_KEYS


def _stream_state(saved: Any) -> Any:
    """The stream's own state in a worker's saved state."""
    return saved["stream_state"] if _names_its_worker(saved) else saved


def _checked_state(tagged: Tagged, name: str) -> Tagged:
    """``tagged``, its state checked to be what JSON holds (the manifest records it)."""
    try:
        json.dumps(tagged.state)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{name}.state_dict() returned what JSON cannot hold ({error}); a stream's state is recorded in the "
            "checkpoint's manifest, so return numbers, strings, lists and dicts."
        ) from None
    return tagged


class _WorkerPasses:
    """What both loaders below share: a pass of the workers from a position, with the position after each batch."""

    _stream_key = "worker_states"
    dataset: WorkerStream
    num_workers: int

    @property
    def _stream(self) -> Any:
        return self.dataset.dataset

    def _checked_stream_state(self, saved: Any) -> Any:
        return checked_position(saved, stream=self.dataset, workers=self.num_workers)

    def _tracks_stream(self) -> bool:
        """Whether the workers' states are recorded: a stream with state, in workers that start anew each pass
        (persistent workers keep the copies of their first pass, which a resumed position cannot reach)."""
        return stateful(self._stream) and not self.persistent_workers

    def _pieces(self, start: dict[str, Any] | None) -> tuple[WorkerRouter, Iterator[Piece]]:
        stream, name = self.dataset, type(self.dataset.dataset).__name__
        stream.tracked = self._tracks_stream()
        stream.resume = None if start is None else [_stream_state(saved) for saved in start["workers"]]
        stream.ended = frozenset(() if start is None else start["ended"])
        tagged = DataLoader.__iter__(self)  # the workers start here
        if stream.tracked:
            tagged = (_checked_state(t, name) for t in tagged)
        router = WorkerRouter(tagged, self.num_workers, start)
        return router, iter(router)


class WorkerStreamLoader(_WorkerPasses, PreparedDataLoader):
    """One process's loader of a stream its workers read: the plain loader's batches, in its order."""

    def _pass(self, skip: int) -> Iterator[Any]:
        self.dataset.set_epoch(self.iteration)
        tracked = self._tracks_stream()
        start = self._take_stream_state(self._stream, skip, tracked)
        router, pieces = self._pieces(start)
        batches = ((piece.batch, router.position()) for piece in pieces)
        if skip and start is None:  # no state saved: read past what was seen
            batches = _after_rows(batches, skip)
        for batch, position in self._flag_last(((self._to_device(b), p) for b, p in batches), lambda: None):
            self._stream_state = position if tracked else None
            yield batch


class DispatchedWorkerLoader(_WorkerPasses, DispatchedDataLoader):
    """Rank 0's workers read the stream, each its own part; its global batches are cut from their batches in turn."""

    def _global_stream(self, skip: int, state: Any, tracked: bool) -> tuple[Any, Iterator[tuple[Any, Any]]]:
        size = self.sharding.global_batch_size
        head = None
        if state is not None and self.sharding.even_batches:  # the epoch's first global batch pads its last
            fresh = self._global_batches(None)
            head = next(fresh, (None, None))[0]
            fresh.close()  # its workers stop
        stream = self._global_batches(state)
        if state is None:
            first = next(stream, None)
            if first is None:
                return None, iter(())
            head = first[0]
            stream = itertools.islice(itertools.chain([first], stream), skip // size, None)
        return head, stream

    def _global_batches(self, start: dict[str, Any] | None) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Global batches cut from the workers' batches in turn, each with the position after it."""
        size = self.sharding.global_batch_size
        router, pieces = self._pieces(start)
        pending: list[Piece] = []
        count = 0
        for piece in pieces:
            pending.append(piece)
            count += batch_rows(piece.batch)
            while count >= size:
                taken, pending, count = *_split(pending, size), count - size
                yield taken, (_resumes_at(pending[0]) if pending else router.position())
        if pending:
            yield _joined([piece.batch for piece in pending]), router.position()


def _split(pieces: list[Piece], size: int) -> tuple[Any, list[Piece]]:
    """The first ``size`` rows of ``pieces`` as one batch, and the pieces after them (a piece cut in two leaves its
    rest, which records the rows of its worker's batch before it)."""
    for index, piece in enumerate(pieces):
        rows = batch_rows(piece.batch)
        if rows == size:
            return _joined([p.batch for p in pieces[: index + 1]]), pieces[index + 1 :]
        if rows > size:
            left = Piece(slice_rows(piece.batch, size, rows), piece.before, piece.offset + size)
            taken = [*(p.batch for p in pieces[:index]), slice_rows(piece.batch, 0, size)]
            return _joined(taken), [left, *pieces[index + 1 :]]
        size -= rows
    raise ValueError(f"{size} more rows were asked of pieces that hold fewer")


def _resumes_at(piece: Piece) -> dict[str, Any]:
    """The position that continues with ``piece``: its worker's batch again, less the rows before it."""
    return {**piece.before, "rows": piece.offset}


def _joined(parts: list[Any]) -> Any:
    joined = parts[0]
    for part in parts[1:]:
        joined = concat_rows(joined, part)
    return joined


def _after_rows(batches: Iterator[tuple[Any, Any]], skip: int) -> Iterator[tuple[Any, Any]]:
    """``batches`` without their first ``skip`` rows."""
    for batch, position in batches:
        rows = batch_rows(batch)
        if skip >= rows:
            skip -= rows
            continue
        yield (slice_rows(batch, skip, rows) if skip else batch), position
        skip = 0
