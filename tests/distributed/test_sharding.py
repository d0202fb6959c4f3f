"""Every way of sharding data on 2 gloo processes: split, dispatched, uneven, iterable.

Each must hand every sample out once per epoch (plus only the padding even_batches documents),
let gather_for_metrics return exactly one entry per sample, and train to the same weights as the
default sharding of the same global batches, padded alike.
"""

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from runner.engine import Accelerator, DataLoaderConfiguration
from tests.helpers import StatefulRange, regression_data, small_model, train

MODES = {
    "map": ({}, False),
    "map uneven": ({"even_batches": False}, False),
    "map dispatched": ({"dispatch_batches": True}, False),
    "stream dispatched": ({}, True),  # dispatch_batches is the default for iterable datasets
    "stream sharded": ({"dispatch_batches": False}, True),
    "stream dispatched uneven": ({"even_batches": False}, True),
}


class CountingRange(Dataset):
    """range(n) that counts the samples this process loads."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.loads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.loads += 1
        return index


class CountingStream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n
        self.loads = 0

    def __iter__(self):
        for index in range(self.n):
            self.loads += 1
            yield index


def _one_epoch(accelerator, dataset, batch_size, *, gather):
    loader = accelerator.prepare(DataLoader(dataset, batch_size=batch_size))
    mine, gathered, objects, ends = [], [], [], []
    for batch in loader:
        mine.extend(batch.tolist())
        ends.append(accelerator.gradient_state.end_of_dataloader)
        if gather:  # a collective: only when every rank runs as many steps
            gathered.extend(accelerator.gather_for_metrics(batch).tolist())
            objects.extend(accelerator.gather_for_metrics(batch.tolist(), use_gather_object=True))
    return {"mine": mine, "gathered": gathered, "objects": objects, "ends": ends, "loads": dataset.loads}


def _coverage(sizes, batch_size):
    out = {}
    for mode, (options, stream) in MODES.items():
        accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**options))
        for n in sizes:
            dataset = CountingStream(n) if stream else CountingRange(n)
            out[mode, n] = _one_epoch(accelerator, dataset, batch_size, gather="uneven" not in mode)
    return out


def test_every_sharding_hands_out_each_sample_once_and_gathers_exactly(launch):
    sizes = (97, 99, 100)
    rank0, rank1 = launch(_coverage, sizes, 8)
    for (mode, n), first in rank0.items():
        second = rank1[mode, n]
        both = first["mine"] + second["mine"]
        for result in (first, second):
            assert result["ends"] == [False] * (len(result["ends"]) - 1) + [True], (mode, n)
        if "uneven" in mode:
            assert sorted(both) == list(range(n)), (mode, n)  # no padding at all
        else:
            # Padded as Accelerate pads: dispatched, to a multiple of 2; sharded, to a whole global batch of 16.
            padding = n % 2 if "dispatched" in mode else -n % 16
            assert set(both) == set(range(n)) and len(both) - n == padding, (mode, n)
            assert len(first["ends"]) == len(second["ends"]), (mode, n)
            assert sorted(first["gathered"]) == list(range(n)), (mode, n)  # the padding dropped again
            assert first["gathered"] == second["gathered"], (mode, n)
            assert sorted(first["objects"]) == list(range(n)), (mode, n)
        if "dispatched" in mode:
            assert second["loads"] == 0, (mode, n)  # only rank 0 reads the dataset
        elif mode == "stream sharded":
            assert first["loads"] == second["loads"] == n, (mode, n)  # every rank reads the stream
        else:
            assert first["loads"] == len(first["mine"]), (mode, n)  # map-style: a rank loads only its samples


class RegressionStream(IterableDataset):
    """regression_data(n) in order, as a stream."""

    def __init__(self, n: int) -> None:
        self.data = regression_data(n)

    def __iter__(self):
        yield from (self.data[i] for i in range(len(self.data)))


def _train_in_order(options, n, batch_size, *, stream=True):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**options))
    dataset = RegressionStream(n) if stream else regression_data(n)
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=batch_size))
    for _ in range(2):
        for x, y in loader:
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    return accelerator.unwrap_model(model).state_dict()


def _weights_per_sharding():
    # 69 samples: a short last global batch of 5, padded to a whole global batch of 16 when sharded by index (as
    # Accelerate's BatchSamplerShard and IterableDatasetShard pad it) and to 6 when dispatched (as its dispatcher).
    def default(n=69):
        return train(Accelerator(), batch_size=8, n=n)

    def split():
        return train(Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True)), batch_size=16, n=69)

    def dispatched():  # whole global batches only: there the two ways of padding agree
        return train(Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True)), batch_size=8, n=64)

    return {
        "default": default(),
        "split": split(),
        "default 64": default(64),
        "dispatched": dispatched(),
        "map in order": _train_in_order({}, 69, 8, stream=False),
        "map dispatched in order": _train_in_order({"dispatch_batches": True}, 69, 8, stream=False),
        "stream dispatched": _train_in_order({}, 69, 8),
        "stream sharded": _train_in_order({"dispatch_batches": False}, 69, 8),
    }


def test_split_and_dispatched_batches_train_to_the_same_weights_as_the_default(launch):
    for weights in launch(_weights_per_sharding):
        pairs = {
            "split": "default",
            "dispatched": "default 64",
            "stream dispatched": "map dispatched in order",
            "stream sharded": "map in order",
        }
        for name, reference in pairs.items():
            for key, value in weights[reference].items():
                assert torch.equal(value, weights[name][key]), (name, key)
        assert not torch.equal(weights["map in order"]["0.weight"], weights["map dispatched in order"]["0.weight"])


def _texts(rows):
    return [row["text"] for row in rows]


def _hf_worker_stream(files, position=None, **options):
    import datasets

    stream = datasets.load_dataset("text", data_files=files, split="train", streaming=True)
    loader = Accelerator(**options).prepare(DataLoader(stream, batch_size=3, num_workers=2, collate_fn=_texts))
    if position is not None:
        loader.load_state_dict(position)
    return loader


def _resume_worker_stream(files):
    """A Hugging Face stream of 3 files that rank 0's 2 loader workers read (global batches of 6), cut and resumed."""
    uninterrupted = list(_hf_worker_stream(files))
    cuts = {}
    for taken in (1, 3, 5, 6):
        loader = _hf_worker_stream(files)
        iterator = iter(loader)
        head = [next(iterator) for _ in range(taken)]
        position = loader.state_dict()
        del iterator
        cuts[taken] = (position, head + list(_hf_worker_stream(files, position)))
    return {"uninterrupted": uninterrupted, "cuts": cuts}


def _resume_stream(files):
    result = {"workers": _resume_worker_stream(files)}
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(CountingStream(50), batch_size=4))
    uninterrupted = [batch.tolist() for batch in loader]
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    position = loader.state_dict()
    resumed = accelerator.prepare(DataLoader(CountingStream(50), batch_size=4))
    resumed.load_state_dict(position)
    result.update(position=position, uninterrupted=uninterrupted, resumed=[b.tolist() for b in resumed])
    misaligned = accelerator.prepare(DataLoader(CountingStream(50), batch_size=4))
    misaligned.load_state_dict({"epoch": 1, "samples_seen": 6})  # saved with another global batch size
    try:
        next(iter(misaligned))
    except ValueError as error:  # on every rank, so none waits for a broadcast that never comes
        result["refused"] = str(error)
    # A stream with state: rank 0 reads it, its state rides with the position, and a resume reads on from it
    for sharded in (False, True):
        config = DataLoaderConfiguration(dispatch_batches=False) if sharded else None
        accelerator = Accelerator(dataloader_config=config)
        stream = StatefulRange(50)
        loader = accelerator.prepare(DataLoader(stream, batch_size=4))
        iterator = iter(loader)
        for _ in range(3):
            next(iterator)
        again = StatefulRange(50)
        resumed = accelerator.prepare(DataLoader(again, batch_size=4))
        resumed.load_state_dict(loader.state_dict())
        result[f"stateful {sharded}"] = (loader.state_dict(), [b.tolist() for b in resumed], again.reads)
    # saved at sample 6 by a run of another global batch size (1 process, batches of 6): continued exactly
    resumed = Accelerator().prepare(DataLoader(again := StatefulRange(50), batch_size=4))
    resumed.load_state_dict({"epoch": 0, "samples_seen": 6, "dataset_state": {"next": 6}})
    result["another world size"] = ([b.tolist() for b in resumed], again.reads)
    return result


def test_a_dispatched_stream_resumes_at_its_position(launch, tmp_path):
    pytest.importorskip("datasets")
    files = []
    for part, lines in enumerate((7, 13, 17)):  # worker 0 reads files 0 and 2 (24 lines), worker 1 file 1 (13)
        files.append(str(tmp_path / f"part{part}.txt"))
        Path(files[-1]).write_text("".join(f"{part} {line}\n" for line in range(lines)))
    ranks = launch(_resume_stream, files)
    # Rank 0's workers read the stream (batches of 6, each its files), and each rank gets its 3 of each global batch
    # of 6, cut from the workers' batches in turn: 6 (w0), 6 (w1), 6, 6, 6, then w1's last line and 5 of w0's last
    # batch, then w0's last line and the epoch's first line, which pads the last global batch to a row for each rank
    streamed = [rank["workers"] for rank in ranks]
    whole = [sum(batches, []) for batches in zip(*(rank["uninterrupted"] for rank in streamed), strict=True)]
    assert [len(batch) for batch in whole] == [6, 6, 6, 6, 6, 6, 2]
    assert whole[5] == ["1 12", "2 11", "2 12", "2 13", "2 14", "2 15"] and whole[6] == ["2 16", "0 0"]
    assert sorted(sum(whole, [])[:-1]) == sorted(f"{part} {line}" for part, n in enumerate((7, 13, 17)) for line in
                                                 range(n))  # fmt: skip
    for rank, result in enumerate(streamed):
        for taken, (position, batches) in result["cuts"].items():
            assert batches == result["uninterrupted"], (rank, taken)
            if rank == 0:  # the manifest records rank 0's: its workers' states
                assert position["samples_seen"] == 6 * taken and len(position["worker_states"]["workers"]) == 2
    assert streamed[0]["cuts"][6][0]["worker_states"]["rows"] == 5  # 5 of w0's last batch were handed out
    # the same position continued on one process with 2 workers: every remaining line handed out once
    position = streamed[0]["cuts"][6][0]
    rest = sum(_hf_worker_stream(files, position), [])
    assert rest == ["2 16"]
    position = streamed[0]["cuts"][3][0]
    rest = sum(_hf_worker_stream(files, position), [])
    assert sorted(sum(whole[:3], []) + rest) == sorted(sum(whole, [])[:-1])
    for rank, result in enumerate(ranks):
        assert result["position"] == {"epoch": 1, "samples_seen": 24}
        assert result["resumed"] == result["uninterrupted"][3:]
        assert result["refused"].startswith("This iterable loader cannot resume 6 samples into an epoch")
        for sharded in (False, True):
            position, rest, reads = result[f"stateful {sharded}"]
            if sharded or rank == 0:
                assert position == {"epoch": 0, "samples_seen": 24, "dataset_state": {"next": 24}}
            else:  # dispatched: only rank 0 reads the stream, and the manifest records rank 0's position
                assert position == {"epoch": 0, "samples_seen": 24}
            expected = result["uninterrupted"][3:]
            if sharded:  # each rank keeps its whole batch of the short last one, padded (Accelerate's shard does)
                expected = expected[:-1] + [[48, 49, 0, 1] if rank == 0 else [2, 3, 4, 5]]
            assert rest == expected
            # nothing read twice: only the epoch's first global batch (8, which pads a short last one) and the rest
            assert reads == (8 + 50 - 24 if sharded or rank == 0 else 0)
    # rank 0's position continued on one process (2 -> 1): the samples after it, each once, none read again
    position = ranks[0]["stateful False"][0]
    resumed = Accelerator().prepare(DataLoader(again := StatefulRange(50), batch_size=4))
    resumed.load_state_dict(position)
    assert sum((b.tolist() for b in resumed), []) == list(range(24, 50)) and again.reads == 50 - 24
    # saved at sample 6 by a run of another global batch size: each sample after it handed out once
    rests = [result["another world size"][0] for result in ranks]
    assert rests[0][0] == [6, 7, 8, 9] and rests[1][0] == [10, 11, 12, 13]
    assert sorted(sum(rests[0] + rests[1], [])) == list(range(6, 50))
    assert [result["another world size"][1] for result in ranks] == [8 + 50 - 6, 0]
