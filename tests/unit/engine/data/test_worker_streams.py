"""Streams that loader workers read, each its own part: one process's order, positions and resumes; the router."""

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from runner.engine import Accelerator
from runner.engine.checkpoint.manifest import CheckpointError
from runner.engine.data.worker_streams import Tagged, WorkerRouter
from tests.helpers import ShardedRange


def _loader(dataset, workers: int = 2, **options) -> DataLoader:
    return Accelerator().prepare(DataLoader(dataset, batch_size=4, num_workers=workers, **options))


def _cut(make, taken: int, **options) -> tuple[list, dict]:
    loader = _loader(make(), **options)
    iterator = iter(loader)
    head = [next(iterator).tolist() for _ in range(taken)]
    return head, loader.state_dict()


def test_a_streamed_hugging_face_dataset_read_by_two_workers_resumes_exactly_after_every_batch(tmp_path, caplog):
    datasets = pytest.importorskip("datasets")  # the other tests here need only torch
    files = []
    for part, lines in enumerate((7, 12, 17)):  # three shards of unequal length: the workers end apart
        files.append(tmp_path / f"part{part}.txt")
        files[-1].write_text("".join(f"{part} {line}\n" for line in range(lines)))

    def loader(position=None):
        stream = datasets.load_dataset("text", data_files=[str(f) for f in files], split="train", streaming=True)
        prepared = Accelerator().prepare(
            DataLoader(stream, batch_size=4, num_workers=2, collate_fn=lambda rows: [r["text"] for r in rows])
        )
        if position is not None:
            prepared.load_state_dict(position)
        return prepared

    plain = list(
        DataLoader(
            datasets.load_dataset("text", data_files=[str(f) for f in files], split="train", streaming=True),
            batch_size=4,
            num_workers=2,
            collate_fn=lambda rows: [r["text"] for r in rows],
        )
    )
    whole = list(loader())
    assert whole == plain  # the plain loader's batches, in its order: worker 0 (shards 0, 2), worker 1 (shard 1)
    assert whole[:3] == [["0 0", "0 1", "0 2", "0 3"], ["1 0", "1 1", "1 2", "1 3"], ["0 4", "0 5", "0 6", "2 0"]]
    for taken in range(1, len(whole)):
        first = loader()
        iterator = iter(first)
        head = [next(iterator) for _ in range(taken)]
        position = first.state_dict()
        assert len(position["worker_states"]["workers"]) == 2
        assert head + list(loader(position)) == whole, taken
    assert "reading past" not in caplog.text


def test_a_late_resume_reads_one_batch_per_worker_at_most_and_continues_exactly():
    whole = [batch.tolist() for batch in _loader(ShardedRange(4000))]
    head, position = _cut(lambda: ShardedRange(4000), 900)
    resumed_stream = ShardedRange(4000)
    resumed = _loader(resumed_stream)
    resumed.load_state_dict(position)
    rest = [batch.tolist() for batch in resumed]
    assert head + rest == whole
    assert position["samples_seen"] == 3600 and position["worker_states"]["next"] == 0
    assert position["worker_states"]["workers"] == [{"shard": 1, "index": 800}] * 2  # 1,800 of each worker's 2,000
    assert resumed_stream.reads.value == 4000 - 3600  # nothing read again: each worker continues from its state


def test_workers_that_end_apart_and_drop_last_resume_exactly():
    # 2 workers of 3 shards of 10 (worker 0: 20 samples, worker 1: 10); batches of 4 with drop_last: each worker's
    # short last batch is left out, as torch's own loader does, and the end of each part still reaches the router
    whole = [b.tolist() for b in _loader(ShardedRange(30, shards=3), drop_last=True)]
    plain = [b.tolist() for b in DataLoader(ShardedRange(30, shards=3), batch_size=4, num_workers=2, drop_last=True)]
    assert whole == plain and len(whole) == 7  # 5 of worker 0's 20, 2 of worker 1's 10
    for taken in range(1, len(whole)):
        head, position = _cut(lambda: ShardedRange(30, shards=3), taken, drop_last=True)
        resumed = _loader(ShardedRange(30, shards=3), drop_last=True)
        resumed.load_state_dict(position)
        assert head + [b.tolist() for b in resumed] == whole, taken
    head, position = _cut(lambda: ShardedRange(30, shards=3), 6, drop_last=True)  # w0, w1, w0, w1, w0, (w1 ends) w0
    assert position["worker_states"]["ended"] == [1] and position["worker_states"]["next"] == 0


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_a_changed_worker_count_and_a_damaged_position_are_one_sentence_each():
    _, position = _cut(lambda: ShardedRange(40), 3)
    for workers, readers in ((3, "2 loader workers"), (0, "2 loader workers")):
        loader = _loader(ShardedRange(40), workers=workers)
        with pytest.raises(CheckpointError) as refused:
            loader.load_state_dict(position)
        assert str(refused.value) == (
            f"This loader's stream was checkpointed as read by {readers}, and a stream is split between a loader's "
            f"workers, so it continues only with the same number: resume with num_workers=2 (this loader has "
            f"{workers})."
        )
    in_main = {"epoch": 0, "samples_seen": 8, "dataset_state": {"shard": 0, "index": 8}}
    with pytest.raises(CheckpointError, match=r"read by the main process alone \(num_workers=0\).*num_workers=0 "):
        _loader(ShardedRange(40)).load_state_dict(in_main)
    damaged = {**position, "worker_states": {**position["worker_states"], "next": 5}}
    loader = _loader(ShardedRange(40))
    loader.load_state_dict(damaged)
    with pytest.raises(CheckpointError) as refused:
        next(iter(loader))
    assert str(refused.value) == (
        "The checkpoint's position of ShardedRange (worker_states) is damaged: it names no state for each of the 2 "
        "loader workers; resume from another checkpoint."
    )


def test_persistent_workers_read_past_and_say_why(caplog):
    whole = [b.tolist() for b in _loader(ShardedRange(40), persistent_workers=True)]
    resumed = _loader(ShardedRange(40), persistent_workers=True)
    resumed.load_state_dict({"epoch": 0, "samples_seen": 8})
    with caplog.at_level(logging.WARNING, logger="runner"):
        rest = [b.tolist() for b in resumed]
    assert rest == whole[2:]
    assert "persistent_workers keep their own copies of it" in caplog.text


def _tagged(worker: int, rows: list[int] | None, state, ended: bool = False) -> Tagged:
    return Tagged(None if rows is None else torch.tensor(rows), worker, state, ended)


def test_the_router_continues_with_the_worker_that_was_due_and_leaves_out_the_rows_handed_out():
    # torch starts every pass with worker 0; after a checkpoint where worker 1 was due with 2 rows of its batch
    # handed out, worker 1's batch comes first, less those rows, then the workers alternate; worker 0 ends first
    arrivals = [
        _tagged(0, [10, 11], {"w0": 1}),
        _tagged(1, [20, 21, 22], {"w1": 1}),
        _tagged(0, None, None, ended=True),
        _tagged(1, [23], {"w1": 2}),
        _tagged(1, None, None, ended=True),
    ]
    start = {"workers": [{"w0": 0}, {"w1": 0}], "ended": [], "next": 1, "rows": 2}
    router = WorkerRouter(iter(arrivals), 2, start)
    pieces = list(router)
    assert [piece.batch.tolist() for piece in pieces] == [[22], [10, 11], [23]]
    assert [piece.offset for piece in pieces] == [2, 0, 0]
    assert pieces[0].before == {"workers": [{"w0": 0}, {"w1": 0}], "ended": [], "next": 1, "rows": 2}
    assert pieces[2].before == {"workers": [{"w0": 1}, {"w1": 1}], "ended": [], "next": 1, "rows": 0}
    assert router.position() == {"workers": [None, None], "ended": [0, 1], "next": 1, "rows": 0}
    with pytest.raises(RuntimeError, match="Loader worker 1's stream ended without its end marker"):
        list(WorkerRouter(iter(arrivals[:1]), 2, None))
