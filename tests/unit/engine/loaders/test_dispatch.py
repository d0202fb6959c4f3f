"""Iterable datasets and dispatched batches: sharding arithmetic and single-process behaviour."""

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from runner.engine import Accelerator
from runner.engine.loaders import DataLoaderConfiguration, Sharding
from runner.engine.loaders.dispatch import (
    IterableDatasetShard,
    batch_rows,
    concat_rows,
    rebatch,
    slice_rows,
    take_rows,
)
from runner.engine.loaders.prepare import prepare_data_loader
from runner.engine.optimizer import GradientAccumulationPlugin, GradientState
from tests.helpers import StatefulRange


class Stream(IterableDataset):
    """range(n) as a stream, optionally with a length."""

    def __init__(self, n: int, *, sized: bool = True) -> None:
        self.n = n
        self.sized = sized

    def __iter__(self):
        yield from range(self.n)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no length")
        return self.n


def shard_items(n, batch_size, world, **options):
    shards = [IterableDatasetShard(Stream(n), Sharding(batch_size, world, rank, **options)) for rank in range(world)]
    return shards, [list(shard) for shard in shards]


@pytest.mark.parametrize("n", [97, 99, 100, 101, 3])
def test_iterable_shards_take_each_ranks_slice_and_pad_like_map_style(n):
    shards, items = shard_items(n, 8, 2)
    assert len(items[0]) == len(items[1]) == len(shards[0]) == len(shards[1])
    assert set(items[0] + items[1]) == set(range(n))
    assert len(items[0] + items[1]) - n == -n % 16  # padded to a whole global batch, as Accelerate's shard pads
    if n >= 16:
        assert items[0][:8] == list(range(8)) and items[1][:8] == list(range(8, 16))
    else:  # too short for a full global batch: it pads itself, over and over
        assert items == [[0, 1, 2, 0, 1, 2, 0, 1], [2, 0, 1, 2, 0, 1, 2, 0]]
    assert shards[0].remainder == (n % 16 if n % 16 else -1)


def test_iterable_shards_without_even_batches_see_each_sample_once():
    shards, items = shard_items(17, 4, 2, even_batches=False)
    assert items == [[0, 1, 2, 3, 8, 9, 10, 11, 16], [4, 5, 6, 7, 12, 13, 14, 15]]
    assert [len(shard) for shard in shards] == [9, 8]
    assert shard_items(17, 4, 2, drop_last=True)[1] == [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]


def test_an_iterable_shard_resumes_by_reading_past_the_seen_samples_and_still_pads_from_the_start():
    shards, full = shard_items(21, 4, 2)
    for shard in shards:
        shard.skip_samples = 8
    assert [list(shard) for shard in shards] == [[8, 9, 10, 11, 16, 17, 18, 19], [12, 13, 14, 15, 20, 0, 1, 2]]
    assert [list(shard) for shard in shards] == full  # the skip applied to one pass only


def test_a_prepared_stream_flags_its_last_batch_and_resumes_from_its_position():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(Stream(10), batch_size=4))
    batches, ends = [], []
    for batch in loader:
        batches.append(batch.tolist())
        ends.append(accelerator.gradient_state.end_of_dataloader)
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert ends == [False, False, True] and len(loader) == 3
    assert loader.state_dict() == {"epoch": 1, "samples_seen": 0}

    iterator = iter(loader)
    next(iterator)
    position = loader.state_dict()
    assert position == {"epoch": 1, "samples_seen": 4}
    resumed = accelerator.prepare(DataLoader(Stream(10), batch_size=4))
    resumed.load_state_dict(position)
    assert [batch.tolist() for batch in resumed] == [[4, 5, 6, 7], [8, 9]]
    assert resumed.iteration == 2


def test_a_stream_without_a_length_has_no_len_but_still_iterates():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(Stream(5, sized=False), batch_size=2))
    with pytest.raises(TypeError):
        len(loader)
    assert [batch.tolist() for batch in loader] == [[0, 1], [2, 3], [4]]


def test_sharding_a_stream_on_each_process_refuses_loader_workers():
    with pytest.raises(ValueError, match="num_workers > 0 cannot be sharded exactly on each process"):
        prepare_data_loader(
            DataLoader(Stream(8), batch_size=2, num_workers=2),
            device=None,
            num_processes=2,
            process_index=0,
            gradient_state=GradientState(GradientAccumulationPlugin()),
            config=DataLoaderConfiguration(dispatch_batches=False),
        )


def test_collated_batches_are_sliced_joined_and_regrouped_row_by_row():
    first = {"x": torch.arange(6).view(3, 2), "name": ["a", "b", "c"], "pair": (torch.ones(3), torch.zeros(3))}
    second = {"x": torch.arange(6, 10).view(2, 2), "name": ["d", "e"], "pair": (torch.ones(2), torch.zeros(2))}
    assert batch_rows(first) == 3
    joined = concat_rows(first, second)
    assert joined["x"][:, 0].tolist() == [0, 2, 4, 6, 8] and joined["name"] == ["a", "b", "c", "d", "e"]
    taken = take_rows(joined, [4, 0])
    assert taken["x"][:, 0].tolist() == [8, 0] and taken["name"] == ["e", "a"] and taken["pair"][0].shape == (2,)
    assert slice_rows(joined, 1, 3)["name"] == ["b", "c"]
    # Loader workers end their shares with short batches; regrouping restores consecutive batches of 4.
    regrouped = list(rebatch(iter([first, second, first]), 4))
    assert [batch["name"] for batch in regrouped] == [["a", "b", "c", "d"], ["e", "a", "b", "c"]]
    assert regrouped[1]["x"][:, 0].tolist() == [8, 0, 2, 4]
    exact = [{"x": torch.ones(4)}]
    assert next(rebatch(iter(exact), 4)) is exact[0]  # a full batch passes through uncopied


def test_a_stream_with_state_resumes_from_it_without_reading_what_was_seen(tmp_path, caplog):
    uninterrupted = [b.tolist() for b in Accelerator().prepare(DataLoader(StatefulRange(30), batch_size=4))]
    accelerator = Accelerator(project_dir=tmp_path)
    stream = StatefulRange(30)
    loader = accelerator.prepare(DataLoader(stream, batch_size=4))
    iterator = iter(loader)
    taken = [next(iterator).tolist() for _ in range(3)]
    # the state as of the last batch handed out, though the loader has fetched one ahead to flag the last
    assert stream.reads == 16 and loader.state_dict() == {"epoch": 0, "samples_seen": 12, "dataset_state": {"next": 12}}
    accelerator.save_state(tmp_path / "saved")
    resumed_stream = StatefulRange(30)
    resumed = Accelerator(project_dir=tmp_path)
    resumed_loader = resumed.prepare(DataLoader(resumed_stream, batch_size=4))
    resumed.load_state(tmp_path / "saved")
    assert resumed_loader.state_dict()["dataset_state"] == {"next": 12}  # loaded, not iterated yet
    rest = [b.tolist() for b in resumed_loader]
    assert taken + rest == uninterrupted and resumed_stream.reads == 30 - 12  # nothing read twice
    assert resumed_loader.state_dict() == {"epoch": 1, "samples_seen": 0}  # a new epoch starts the stream over
    assert [b.tolist() for b in resumed_loader] == uninterrupted
    assert "reading past" not in caplog.text


def test_a_stream_resumed_without_its_state_reads_past_and_says_so_once(caplog):
    accelerator = Accelerator()
    position = {"epoch": 0, "samples_seen": 8}
    for dataset, why in [(Stream(20), "it has no state_dict"), (StatefulRange(20), "the checkpoint holds no state "
                                                                                   "of it")]:  # fmt: skip
        caplog.clear()
        loader = accelerator.prepare(DataLoader(dataset, batch_size=4))
        loader.load_state_dict(position)
        assert [b.tolist() for b in loader] == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]
        assert [r.getMessage() for r in caplog.records if "reading past" in r.getMessage()] == [
            f"Resuming {type(dataset).__name__} by reading past the 8 samples already seen this epoch ({why}); a "
            "stream with state_dict() and load_state_dict() resumes at once."
        ]


def test_iterable_shards_resume_from_a_state_and_pad_from_the_epochs_start():
    for world in (1, 2):  # the state is the stream's global position: any number of processes continues it
        shards = [IterableDatasetShard(StatefulRange(21), Sharding(4, world, rank)) for rank in range(world)]
        for shard in shards:
            shard.resume_state = {"next": 8}
        items = [list(shard) for shard in shards]
        if world == 1:
            assert items == [list(range(8, 21))]
        else:  # the short last batch pads from the epoch's first global batch, read again: 8 reads more
            assert items == [[8, 9, 10, 11, 16, 17, 18, 19], [12, 13, 14, 15, 20, 0, 1, 2]]
            assert [shard.dataset.reads for shard in shards] == [8 + 13] * 2


def test_a_stream_state_that_json_cannot_hold_is_one_sentence():
    class Opaque(StatefulRange):
        def state_dict(self):
            return {"generator": torch.Generator()}

    loader = Accelerator().prepare(DataLoader(Opaque(8), batch_size=4))
    with pytest.raises(ValueError) as refused:
        next(iter(loader))
    assert str(refused.value) == (
        "Opaque.state_dict() returned what JSON cannot hold (Object of type Generator is not JSON serializable); a "
        "stream's state is recorded in the checkpoint's manifest, so return numbers, strings, lists and dicts."
    )
