"""Loaders for iterable datasets, and loaders whose batches rank 0 loads and sends to every rank.

Both keep the global batches of :mod:`runner.engine.loaders.sampling`: rank ``r`` gets the r-th slice of every
``batch_size * num_processes`` consecutive samples, and the short last global batch is padded (with
``even_batches``) from the start of the epoch, so ``gather_for_metrics`` returns each sample once.

- :class:`ShardedIterableLoader`: every rank reads the whole stream in its main process and keeps
  its own samples (``dispatch_batches=False``). A stream's length is unknown, so it fetches one
  batch ahead to know which batch is the last.
- :class:`DispatchedDataLoader`: rank 0 loads each global batch (with the loader's workers) and
  broadcasts it; every rank slices its rows. The default for iterable datasets, and available for
  map-style ones. Non-tensor per-sample columns (lists of strings, say) travel pickled and are
  sliced like tensors.

Positions count samples as everywhere else. A stream with ``state_dict()``/``load_state_dict()`` (a Hugging
Face ``IterableDataset``, a torchdata node, ``runner.data.Mixture``, a class of yours) is checkpointed by its
state as of the last batch handed out, and resumed from it without reading what was seen: the state is the
stream's global position (one reader: every rank's stream, or rank 0's under dispatch), so a run may resume
on another number of processes. It must be JSON (numbers, strings, lists, dicts), as the manifest records it.
With ``num_workers > 0`` a stream with state is read by :mod:`runner.engine.loaders.worker_streams` (each worker its
part, a state for each). A stream without state is resumed by reading past the samples already seen, which it
says once; such a stream must be the same in every pass of an epoch (seed any shuffling from ``set_epoch``).
"""

from __future__ import annotations

import collections
import copy
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, Sampler

from runner.engine.loaders.loader import PreparedDataLoader
from runner.engine.loaders.sampling import ShardedBatchSampler, Sharding

_END = object()


def stateful(dataset: Any) -> bool:
    """Whether ``dataset`` records its position itself (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def snapshot(dataset: Any) -> Any:
    """The stream's state now, as the manifest will hold it (a copy: the stream moves on)."""
    state = dataset.state_dict()
    try:
        json.dumps(state)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{type(dataset).__name__}.state_dict() returned what JSON cannot hold ({error}); a stream's state is "
            "recorded in the checkpoint's manifest, so return numbers, strings, lists and dicts."
        ) from None
    return copy.deepcopy(state)


class IterableDatasetShard(IterableDataset):
    """This rank's samples of an iterable dataset: its slice of every global batch of the stream.

    ``skip_samples`` (consumed by the next pass) reads past the epoch's first samples; ``remainder``
    is set when a pass pads its last global batch.
    """

    def __init__(self, dataset: IterableDataset, sharding: Sharding) -> None:
        self.dataset = dataset
        self.sharding = sharding
        self.skip_samples = 0
        self.remainder = -1
        self.resume_state: Any = None  # consumed by the next pass: the stream continues from it
        self.track_state = False  # record the stream's state after each global batch, in ``snapshots``
        self.snapshots: collections.deque = collections.deque()

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        return self.sharding.rank_items(len(self.dataset))  # TypeError for a stream without a length

    def __iter__(self) -> Iterator[Any]:
        skip, self.skip_samples = self.skip_samples, 0
        state, self.resume_state = self.resume_state, None
        self.remainder = -1
        self.snapshots.clear()
        sharding, size = self.sharding, self.sharding.global_batch_size
        head: list[Any] = []  # the epoch's first global batch, which pads the last
        if state is not None:  # continue from the saved state: only the head is read again, if it pads
            if sharding.num_processes > 1 and sharding.even_batches:
                head = list(itertools.islice(iter(self.dataset), size))
            self.dataset.load_state_dict(state)
            skip = size  # past the head: what follows the state is the rest of the epoch
        batch: list[Any] = []
        for position, sample in enumerate(self.dataset, start=size if state is not None else 0):
            if position < size:
                head.append(sample)
            if position < skip:
                continue
            batch.append(sample)
            if len(batch) == size:
                if self.track_state:
                    self.snapshots.append(snapshot(self.dataset))
                yield from sharding.rank_slice(batch)
                batch = []
        if batch and (last := sharding.last_batch(batch, head)):
            if len(last) > len(batch):
                self.remainder = len(batch)
            if self.track_state:
                self.snapshots.append(snapshot(self.dataset))
            yield from sharding.rank_slice(last)


class ShardedIterableLoader(PreparedDataLoader):
    """A prepared loader over an :class:`IterableDatasetShard` (read in the main process)."""

    @property
    def total_dataset_length(self) -> int:
        return len(self.dataset.dataset)

    def _pass(self, skip: int) -> Iterator[Any]:
        shard = self.dataset
        shard.set_epoch(self.iteration)
        shard.track_state = stateful(shard.dataset) and self.num_workers == 0
        state = self._take_stream_state(shard.dataset, skip, shard.track_state, log=shard.sharding.process_index == 0)
        shard.resume_state, shard.skip_samples = state, 0 if state is not None else skip

        def ended() -> None:
            self.remainder = shard.remainder

        for batch in self._flag_last(map(self._to_device, DataLoader.__iter__(self)), ended):
            if shard.track_state:  # the state after this batch's global batch: what a save now records
                self._stream_state = shard.snapshots.popleft()
            yield batch


class GlobalBatches(Sampler[list[int]]):
    """The batch sampler rank 0 loads with under ``dispatch_batches``: whole global batches."""

    def __init__(self, sharded: ShardedBatchSampler) -> None:
        self.sharded = sharded
        self.sampler = sharded.sampler  # so the loader's position records the shuffle seed

    def __iter__(self) -> Iterator[list[int]]:
        return self.sharded.global_batches()

    def __len__(self) -> int:
        return len(self.sharded.sharding.global_rows(len(self.sampler)))


class _Round(NamedTuple):
    batch: Any  # the global batch, on the communication device
    remainder: int  # real samples of a padded last global batch, else -1
    next_rows: int  # rows of the next global batch, 0 after the last
    state: Any = None  # rank 0, a stream with state: its state after this global batch


class DispatchedDataLoader(PreparedDataLoader):
    """Rank 0 loads every global batch and broadcasts it; each rank keeps its rows.

    The other ranks never read the dataset (nor start workers). Each global batch is one
    ``broadcast_object_list`` (its structure, and any non-tensor columns) and one ``broadcast`` per
    tensor, on ``comm_device``.
    """

    def __init__(self, dataset, *, comm_device: torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.comm_device = comm_device or torch.device("cpu")

    @property
    def _map_style(self) -> bool:
        return isinstance(self.batch_sampler, GlobalBatches)

    def __len__(self) -> int:
        if self._map_style:
            return self.batch_sampler.sharded.num_batches(0)
        return self.sharding.num_batches(len(self.dataset))  # TypeError for a stream without a length

    @property
    def _stream(self) -> Any:
        """The user's stream this loader reads."""
        return self.dataset

    def _tracks_stream(self) -> bool:
        """Whether this loader's stream records its state, which a checkpoint keeps (rank 0 reads it)."""
        return not self._map_style and stateful(self.dataset) and self.num_workers == 0

    def _pass(self, skip: int) -> Iterator[Any]:
        sharding = self.sharding
        tracked = self._tracks_stream()
        state = None
        if not self._map_style:
            state = self._take_stream_state(self._stream, skip, tracked, log=sharding.process_index == 0)
        if state is None and skip % sharding.global_batch_size and not self._map_style:  # raised on every rank alike
            raise ValueError(
                f"This iterable loader cannot resume {skip} samples into an epoch: dispatched streams resume at "
                f"whole global batches of {sharding.global_batch_size}; resume with the global batch size the run "
                "was saved with."
            )
        rounds = self._load_and_send(skip, state, tracked) if sharding.process_index == 0 else self._receive()
        for batch, remainder, next_rows, stream_state in rounds:
            if tracked:
                self._stream_state = stream_state  # rank 0's, which the manifest records
            start, stop = _row_range(sharding, batch_rows(batch))
            if start >= stop:
                continue  # without even_batches the last ranks may have no share of the last batch
            self.remainder = remainder
            self._batches_yielded += 1
            start_next, stop_next = _row_range(sharding, next_rows)
            if start_next >= stop_next:
                self._pass_batches = self._batches_yielded
                self.end_of_dataloader = True
            yield self._to_device(slice_rows(batch, start, stop))
        self.end_of_dataloader = True

    # ------------------------------------------------------------------------------------------- rank 0
    def _load_and_send(self, skip: int, state: Any, tracked: bool) -> Iterator[_Round]:
        sent = False
        for round_ in self._global_rounds(skip, state, tracked):
            _send(round_, self.comm_device)
            sent = True
            yield round_
        if not sent:
            dist.broadcast_object_list([None], src=0, device=self.comm_device)

    def _global_rounds(self, skip: int, state: Any, tracked: bool) -> Iterator[_Round]:
        if self._map_style:
            sharded = self.batch_sampler.sharded
            sharded.set_epoch(self.iteration)
            sharded.skip_samples = skip
            rows = self.sharding.global_rows(len(sharded.sampler) - skip)
            remainder = sharded.remainder_after(skip)
            for step, batch in enumerate(DataLoader.__iter__(self)):
                next_rows = rows[step + 1] if step + 1 < len(rows) else 0
                yield _Round(batch, remainder if not next_rows else -1, next_rows)
            return
        yield from self._streamed_rounds(skip, state, tracked)

    def _global_stream(self, skip: int, state: Any, tracked: bool) -> tuple[Any, Iterator[tuple[Any, Any]]]:
        """The epoch's first global batch (it pads the last; None for an empty stream), and the pass's global
        batches from ``skip`` samples in (or from ``state``), each with the stream's state after it if ``tracked``."""
        size = self.sharding.global_batch_size
        stream = rebatch(DataLoader.__iter__(self), size)
        head = next(stream, None)
        if head is None:
            return None, iter(())
        if state is not None:  # continue from the saved state: the head was all that was read again
            self.dataset.load_state_dict(state)
            stream = rebatch(DataLoader.__iter__(self), size)
        else:
            stream = itertools.islice(itertools.chain([head], stream), skip // size, None)
        return head, ((batch, snapshot(self.dataset) if tracked else None) for batch in stream)

    def _streamed_rounds(self, skip: int, state: Any, tracked: bool) -> Iterator[_Round]:
        sharding, size = self.sharding, self.sharding.global_batch_size
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(self.iteration)
        head, stream = self._global_stream(skip, state, tracked)
        current, current_state = next(stream, (_END, None))
        while current is not _END:
            upcoming, upcoming_state = next(stream, (_END, None))
            rows, remainder = batch_rows(current), -1
            if rows < size and sharding.even_batches and rows % sharding.num_processes:
                filler = concat_rows(head, current) if batch_rows(head) == size else current
                padding = [i % batch_rows(filler) for i in range(-rows % sharding.num_processes)]
                current, remainder = concat_rows(current, take_rows(filler, padding)), rows
            next_rows = 0 if upcoming is _END else batch_rows(upcoming)
            if next_rows < size and sharding.even_batches:
                next_rows += -next_rows % sharding.num_processes
            yield _Round(current, remainder, next_rows, current_state)
            current, current_state = upcoming, upcoming_state

    # ----------------------------------------------------------------------------------- other ranks
    def _receive(self) -> Iterator[_Round]:
        while True:
            header: list[Any] = [None]
            dist.broadcast_object_list(header, src=0, device=self.comm_device)
            if header[0] is None:
                return
            structure, remainder, next_rows = header[0]
            yield _Round(_map_leaves(self._receive_tensor, structure, _TensorSpec), remainder, next_rows)
            if not next_rows:
                return

    def _receive_tensor(self, spec: _TensorSpec) -> torch.Tensor:
        tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.comm_device)
        dist.broadcast(tensor, src=0)
        return tensor


class _TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


def _send(round_: _Round, device: torch.device) -> None:
    tensors: list[torch.Tensor] = []

    def describe(tensor: torch.Tensor) -> _TensorSpec:
        tensors.append(tensor.to(device).contiguous())
        return _TensorSpec(tuple(tensor.shape), tensor.dtype)

    structure = _map_leaves(describe, round_.batch, torch.Tensor)
    dist.broadcast_object_list([(structure, round_.remainder, round_.next_rows)], src=0, device=device)
    for tensor in tensors:
        dist.broadcast(tensor, src=0)


# --------------------------------------------------------------------- rows of a collated batch
# A collated batch is a nest of dicts, lists and tuples whose leaves are tensors (one row per sample
# along dim 0) or per-sample columns (lists of plain values, e.g. strings, one per sample).


def _is_column(data: Any) -> bool:
    return isinstance(data, list) and bool(data) and not any(isinstance(item, _CONTAINERS) for item in data)


_CONTAINERS = (torch.Tensor, list, tuple, Mapping, _TensorSpec)


def _map_leaves(func: Callable[[Any], Any], data: Any, leaf: type) -> Any:
    """Apply ``func`` to every ``leaf`` instance in a nest of lists, tuples (named too) and mappings."""
    if isinstance(data, leaf):
        return func(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_map_leaves(func, item, leaf) for item in data))
    if isinstance(data, (list, tuple)) and not _is_column(data):
        return type(data)(_map_leaves(func, item, leaf) for item in data)
    if isinstance(data, Mapping):
        return type(data)({key: _map_leaves(func, value, leaf) for key, value in data.items()})
    return data


def _map_rows(on_tensor: Callable, on_column: Callable, *batches: Any) -> Any:
    """Combine batches of one structure leaf by leaf: tensors with ``on_tensor``, columns with ``on_column``."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return on_tensor(*batches)
    if _is_column(first):
        return on_column(*batches)
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(_map_rows(on_tensor, on_column, *items) for items in zip(*batches, strict=True)))
    if isinstance(first, (list, tuple)):
        return type(first)(_map_rows(on_tensor, on_column, *items) for items in zip(*batches, strict=True))
    if isinstance(first, Mapping):
        return type(first)({key: _map_rows(on_tensor, on_column, *(b[key] for b in batches)) for key in first})
    return first


def batch_rows(batch: Any) -> int:
    """The number of samples in a collated batch: the first dimension of its tensors."""
    found: list[int] = []
    _map_rows(lambda t: found.append(len(t)), lambda column: found.append(len(column)), batch)
    if not found:
        raise ValueError(
            "dispatch_batches needs batches holding tensors or per-sample lists, one row per sample; turn "
            "dispatch_batches off for this loader."
        )
    return found[0]


def slice_rows(batch: Any, start: int, stop: int) -> Any:
    return _map_rows(lambda t: t[start:stop], lambda column: column[start:stop], batch)


def take_rows(batch: Any, rows: list[int]) -> Any:
    index = torch.tensor(rows, dtype=torch.long)
    return _map_rows(lambda t: t[index.to(t.device)], lambda column: [column[i] for i in rows], batch)


def concat_rows(first: Any, second: Any) -> Any:
    return _map_rows(lambda a, b: torch.cat([a, b]), lambda a, b: a + b, first, second)


def rebatch(batches: Iterator[Any], size: int) -> Iterator[Any]:
    """Cut a stream of collated batches into batches of ``size`` rows (the last may be shorter).

    A loader with several workers ends each worker's share with a short batch; regrouping keeps
    global batches consecutive. Batches that already have ``size`` rows pass through uncopied.
    """
    pending = None
    for batch in batches:
        pending = batch if pending is None else concat_rows(pending, batch)
        while batch_rows(pending) >= size:
            rows = batch_rows(pending)
            if rows == size:
                yield pending
                pending = None
                break
            yield slice_rows(pending, 0, size)
            pending = slice_rows(pending, size, rows)
    if pending is not None and batch_rows(pending):
        yield pending


def _row_range(sharding: Sharding, rows: int) -> tuple[int, int]:
    """This rank's rows of a global batch of ``rows`` rows (see :meth:`Sharding.rank_slice`)."""
    share = sharding.rank_slice(range(rows))
    return share.start, share.stop
