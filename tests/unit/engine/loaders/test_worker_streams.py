"""Streams that loader workers read, each its own part: one process's order, positions and resumes; the router."""

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from runner.data import Packed
from runner.engine import Accelerator
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.loaders.worker_streams import Tagged, WorkerRouter
from tests.helpers import ShardedRange


def _loader(dataset, workers: int = 2, **options) -> DataLoader:
    return Accelerator().prepare(DataLoader(dataset, batch_size=4, num_workers=workers, **options))


def _cut(make, taken: int, **options) -> tuple[list, dict]:
    loader = _loader(make(), **options)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(taken)]
    return [batch.tolist() if isinstance(batch, torch.Tensor) else batch for batch in head], loader.state_dict()


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
    assert position["worker_states"]["workers"] == [  # 1,800 of each worker's 2,000, each state naming its worker
        {"loader_worker": worker, "stream_state": {"shard": 1, "index": 800}} for worker in (0, 1)
    ]
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
    with pytest.raises(CheckpointError) as refused:  # refused as it is loaded, before any worker starts
        _loader(ShardedRange(40)).load_state_dict(damaged)
    assert str(refused.value) == (
        "worker_states.next: 5 is not a worker whose part goes on (0 to 1, not ended); the checkpoint's stream state "
        "is not one this data can have: resume from another checkpoint or start a new run."
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


# ------------------------------------------------------------------------ a saved position from someone else
FIX = "the checkpoint's stream state is not one this data can have: resume from another checkpoint or start a new run."


def _refused(position: dict, dataset=None) -> str:
    loader = _loader(ShardedRange(40) if dataset is None else dataset)
    return _sentence(lambda: loader.load_state_dict(position))


def _sentence(call) -> str:
    """The CheckpointError ``call()`` raises, as its sentence.

    Caught with ``except ... as``, which drops the traceback, not ``pytest.raises``, which keeps it: a kept traceback
    holds the frames above the raise, and a frame holding an iterator of a loader with workers keeps them alive in a
    reference cycle. torch's DataLoader then stops them only when the garbage collector frees the cycle, after it has
    closed their queues, so it waits its 5 s timeout for each worker (torch 2.13).
    """
    try:
        call()
    except CheckpointError as error:
        return str(error)
    raise AssertionError("no CheckpointError was raised")


def test_swapped_worker_states_are_refused_and_states_saved_before_they_named_their_worker_still_resume():
    whole = [batch.tolist() for batch in _loader(ShardedRange(40))]
    head, position = _cut(lambda: ShardedRange(40), 3)  # w0, w1, w0: worker 1 is due
    states = position["worker_states"]["workers"]
    assert [state["loader_worker"] for state in states] == [0, 1]
    swapped = {**position, "worker_states": {**position["worker_states"], "workers": states[::-1]}}
    assert (
        _refused(swapped)
        == f"worker_states.workers[0].loader_worker: the state of loader worker 1 in worker 0's place; {FIX}"
    )
    bare = [state["stream_state"] for state in states]  # as positions were saved before
    resumed = _loader(ShardedRange(40))
    resumed.load_state_dict({**position, "worker_states": {**position["worker_states"], "workers": bare}})
    assert head + [batch.tolist() for batch in resumed] == whole


@pytest.mark.parametrize(
    ("edit", "sentence"),
    [
        ({"next": "1"}, "worker_states.next: '1' is not a worker whose part goes on (0 to 1, not ended)"),
        ({"ended": [1], "next": 1}, "worker_states.next: 1 is not a worker whose part goes on (0 to 1, not ended)"),
        ({"ended": [2]}, "worker_states.ended: [2] is not a list of workers 0 to 1"),
        ({"ended": [0, 0]}, "worker_states.ended: [0, 0] is not a list of workers 0 to 1"),
        ({"rows": -1}, "worker_states.rows: -1 is not a count of rows"),
        ({"extra": 1}, "worker_states: {'ended': [], 'extra': 1, 'next': 1, 'rows': 0, ...} is not a position of "
         "loader workers (workers, ended, next, rows)"),
        ({"workers": [None, "junk"]}, "worker_states.workers[1]: 'junk' is not Packed's state (documents, carry, "
         "positions, source)"),
        ({"workers": [None, {"loader_worker": 1, "stream_state": {"documents": "abc", "carry": [], "positions": [],
                                                                   "source": None}}]},
         "worker_states.workers[1].stream_state.documents: 'abc' is not a count of documents"),
    ],
)  # fmt: skip
def test_an_edited_position_of_packing_workers_is_one_sentence_naming_its_field(edit, sentence):
    def packed():
        return Packed([[1, 2, 3, 4, 5]] * 30, block_size=2)  # each worker packs all of it: its state is Packed's

    _, position = _cut(packed, 3)
    assert position["worker_states"]["next"] == 1
    assert position["worker_states"]["workers"][1]["stream_state"]["documents"] == 2
    assert (
        _refused({**position, "worker_states": {**position["worker_states"], **edit}}, packed()) == f"{sentence}; {FIX}"
    )


def test_a_state_for_an_ended_worker_and_more_rows_handed_out_than_its_batch_holds_are_refused():
    _, position = _cut(lambda: ShardedRange(30, shards=3), 6)  # worker 1's part has ended
    saved = position["worker_states"]
    assert saved["ended"] == [1] and saved["workers"][1] is None
    ended = {**position, "worker_states": {**saved, "workers": [saved["workers"][0]] * 2}}
    assert _refused(ended, ShardedRange(30, shards=3)) == (
        f"worker_states.workers[1]: {{'loader_worker': 0, 'stream_state': {{'index': 2, 'shard': 1}}}}, a state for "
        f"worker 1, whose part has ended; {FIX}"
    )
    _, position = _cut(lambda: ShardedRange(40), 3)
    skipped = {**position, "worker_states": {**position["worker_states"], "rows": 30_000}}
    loader = _loader(ShardedRange(40))
    loader.load_state_dict(skipped)  # a batch of another size may have been saved: its worker's part bounds the rows
    assert _sentence(lambda: next(iter(loader))) == (
        f"worker_states.rows: 30000 rows of loader worker 1's batch handed out, but its part ends after 16; {FIX}"
    )
