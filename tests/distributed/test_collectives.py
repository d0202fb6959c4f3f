"""gather, gather_for_metrics, pad_across_processes, reduce and broadcast on 2 gloo processes."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator


def _gather_for_metrics(sizes, batch_size):
    accelerator = Accelerator()
    out = {}
    for n in sizes:
        for shuffle in (False, True):
            dataset = TensorDataset(torch.arange(n))
            loader = accelerator.prepare(DataLoader(dataset, batch_size=batch_size, shuffle=shuffle))
            tensors, objects, per_rank = [], [], 0
            for (batch,) in loader:
                per_rank += len(batch)
                tensors.append(accelerator.gather_for_metrics(batch))
                objects.extend(accelerator.gather_for_metrics(batch.tolist(), use_gather_object=True))
            out[(n, shuffle)] = (torch.cat(tensors).tolist(), objects, len(loader), per_rank)
    return out


@pytest.mark.parametrize("nproc", [1, 2])
def test_gather_for_metrics_returns_every_item_exactly_once(launch, nproc):
    results = launch(_gather_for_metrics, (97, 100, 101), 8, nproc=nproc)
    for result in results:
        for (n, _shuffle), (tensors, objects, batches, _per_rank) in result.items():
            assert sorted(tensors) == list(range(n))
            assert sorted(objects) == list(range(n))
            assert batches == -(-n // (8 * nproc))  # the same number of batches on every rank
    if nproc == 2:
        # Both ranks saw the same number of samples: 7 batches of 8 each (padding makes the last global batch whole).
        assert [r[(97, True)][3] for r in results] == [56, 56]


def _collectives():
    accelerator = Accelerator()
    rank = accelerator.process_index
    padded = accelerator.pad_across_processes(torch.arange(1, rank + 2))  # lengths 1 and 2
    padded_first = accelerator.pad_across_processes(torch.ones(rank + 1, 3), dim=0, pad_index=-1, pad_first=True)
    nested = accelerator.gather({"a": torch.tensor([rank]), "b": (torch.tensor(float(rank)), torch.ones(2, 2) * rank)})
    summed = accelerator.reduce(torch.tensor([1.0, rank]), reduction="sum")
    mean = accelerator.reduce(torch.tensor([2.0 * rank]), reduction="mean")
    value = torch.tensor([rank + 10])
    from runner.engine.utils import broadcast, broadcast_object_list, gather_object

    broadcast(value, from_process=1)
    objects = broadcast_object_list([f"from {rank}"], from_process=0)
    return {
        "padded": padded.tolist(),
        "padded_first": padded_first[:, 0].tolist(),
        "nested_a": nested["a"].tolist(),
        "nested_b0": nested["b"][0].tolist(),
        "nested_b1": nested["b"][1].shape,
        "sum": summed.tolist(),
        "mean": mean.tolist(),
        "broadcast": value.tolist(),
        "objects": objects,
        "gather_object": gather_object([rank, f"r{rank}"]),
    }


def test_collectives_on_two_processes(launch):
    rank0, rank1 = launch(_collectives)
    assert rank0["padded"] == [1, 0] and rank1["padded"] == [1, 2]
    assert rank0["padded_first"] == [-1, 1] and rank1["padded_first"] == [1, 1]
    for result in (rank0, rank1):
        assert result["nested_a"] == [0, 1]
        assert result["nested_b0"] == [0.0, 1.0]
        assert result["nested_b1"] == torch.Size([4, 2])
        assert result["sum"] == [2.0, 1.0]
        assert result["mean"] == [1.0]
        assert result["broadcast"] == [11]
        assert result["objects"] == ["from 0"]
        assert result["gather_object"] == [0, "r0", 1, "r1"]


def _random_samplers():
    accelerator = Accelerator()
    dataset = TensorDataset(torch.arange(32))
    loaders = {
        "subset": torch.utils.data.SubsetRandomSampler(range(16, 32)),
        "weighted": torch.utils.data.WeightedRandomSampler([1.0] * 32, num_samples=16, replacement=False),
    }
    seen = {}
    for name, sampler in loaders.items():
        loader = accelerator.prepare(DataLoader(dataset, batch_size=2, sampler=sampler))
        seen[name] = [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]  # two epochs
    return seen


def test_samplers_with_their_own_generator_shard_without_overlap(launch):
    rank0, rank1 = launch(_random_samplers)
    for name in ("subset", "weighted"):
        for epoch in (0, 1):
            both = rank0[name][epoch] + rank1[name][epoch]
            assert len(both) == 16 and len(set(both)) == 16, (name, epoch)  # no sample twice, none lost
        assert rank0[name][0] != rank0[name][1]  # a new order each epoch
    assert set(rank0["subset"][0] + rank1["subset"][0]) == set(range(16, 32))


def _split_and_decorators():
    accelerator = Accelerator()
    with accelerator.split_between_processes(list(range(5)), apply_padding=True) as mine:
        gathered = accelerator.gather(torch.tensor(mine))
    ran = accelerator.on_process(lambda: accelerator.process_index, process_index=1)()
    main = accelerator.on_main_process(lambda: "main")()
    return mine, gathered.tolist(), ran, main


def test_split_between_processes_and_process_decorators_on_two_processes(launch):
    rank0, rank1 = launch(_split_and_decorators)
    assert rank0[0] == [0, 1, 2] and rank1[0] == [3, 4, 4]  # padded so both can be gathered
    assert rank0[1] == rank1[1] == [0, 1, 2, 3, 4, 4]
    assert (rank0[2], rank1[2]) == (None, 1)
    assert (rank0[3], rank1[3]) == ("main", None)
