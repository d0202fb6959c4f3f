"""Accelerate parity on 2 gloo processes: ``accelerator.state`` per rank, the last process, RNG sync, data_seed."""

import dataclasses

import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator, DataLoaderConfiguration
from runner.engine.loaders.sampling import SeedableRandomSampler
from runner.engine.utils import synchronize_rng_states

STATE_ATTRIBUTES = (
    "num_processes",
    "process_index",
    "local_process_index",
    "distributed_type",
    "mixed_precision",
    "is_main_process",
    "is_local_main_process",
    "is_last_process",
)


def _state_and_last_process():
    accelerator = Accelerator(mixed_precision="bf16")
    state = accelerator.state
    try:
        state.process_index = 5
        assignable = True
    except dataclasses.FrozenInstanceError:
        assignable = False
    ran_on = accelerator.on_last_process(lambda: accelerator.process_index)()
    return {
        "state": {name: getattr(state, name) for name in STATE_ATTRIBUTES},
        "agrees": all(getattr(state, name) == getattr(accelerator, name) for name in STATE_ATTRIBUTES),
        "device": str(state.device),
        "assignable": assignable,
        "ran_on": ran_on,
        "other": Accelerator().state.mixed_precision,  # a second Accelerator, its own state
    }


def test_state_per_rank_and_on_last_process(launch):
    rank0, rank1 = launch(_state_and_last_process)
    common = {"num_processes": 2, "distributed_type": "MULTI_CPU", "mixed_precision": "bf16"}
    assert rank0["state"] == {
        **common,
        "process_index": 0,
        "local_process_index": 0,
        "is_main_process": True,
        "is_local_main_process": True,
        "is_last_process": False,
    }
    assert rank1["state"] == {
        **common,
        "process_index": 1,
        "local_process_index": 1,
        "is_main_process": False,
        "is_local_main_process": False,
        "is_last_process": True,
    }
    assert rank0["agrees"] and rank1["agrees"] and rank0["device"] == rank1["device"] == "cpu"
    assert not rank0["assignable"] and not rank1["assignable"]
    assert (rank0["ran_on"], rank1["ran_on"]) == (None, 1)
    assert rank0["other"] == rank1["other"] == "no"


def _generator_sync_and_data_seed():
    accelerator = Accelerator()
    rank = accelerator.process_index
    synced = torch.Generator().manual_seed(100 + rank)
    synchronize_rng_states(["generator"], generator=synced)
    torch.manual_seed(200 + rank)
    left_alone = torch.Generator().manual_seed(300 + rank)
    synchronize_rng_states(["torch"], generator=left_alone)  # "generator" not listed: Accelerate leaves it
    torch_draw = torch.rand(3)
    # A different torch seed per rank: only data_seed can make the shuffle agree with the expected one.
    torch.manual_seed(400 + rank)
    config = DataLoaderConfiguration(data_seed=77)
    loader = Accelerator(dataloader_config=config).prepare(
        DataLoader(TensorDataset(torch.arange(16)), batch_size=2, shuffle=True)
    )
    epochs = [[index for batch in loader for index in batch[0].tolist()] for _ in range(2)]
    return {
        "synced": torch.rand(3, generator=synced),
        "left_alone": torch.rand(3, generator=left_alone),
        "torch_draw": torch_draw,
        "epochs": epochs,
    }


def test_synchronize_rng_states_generator_and_data_seed(launch):
    rank0, rank1 = launch(_generator_sync_and_data_seed)
    assert torch.equal(rank0["synced"], rank1["synced"])
    assert torch.equal(rank0["synced"], torch.rand(3, generator=torch.Generator().manual_seed(100)))
    assert not torch.equal(rank0["left_alone"], rank1["left_alone"])
    assert torch.equal(rank0["torch_draw"], rank1["torch_draw"])
    for epoch in range(2):
        sampler = SeedableRandomSampler(range(16), data_seed=77)
        sampler.set_epoch(epoch)
        order = list(sampler)
        # Global batches of 4: rank 0 takes the first 2 indices of each, rank 1 the next 2.
        expected0 = [i for start in range(0, 16, 4) for i in order[start : start + 2]]
        expected1 = [i for start in range(0, 16, 4) for i in order[start + 2 : start + 4]]
        assert (rank0["epochs"][epoch], rank1["epochs"][epoch]) == (expected0, expected1)
