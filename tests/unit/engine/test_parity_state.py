"""Accelerate parity on one process: ``accelerator.state``, the last process, and seeding arguments."""

import dataclasses
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator, DataLoaderConfiguration, FullyShardedDataParallelPlugin
from runner.engine.distributed import AcceleratorState, DistributedEnvironment, DistributedType
from runner.engine.loaders.sampling import SeedableRandomSampler
from runner.engine.utils import synchronize_rng_states

STATE_ATTRIBUTES = (
    "num_processes",
    "process_index",
    "local_process_index",
    "device",
    "distributed_type",
    "mixed_precision",
    "is_main_process",
    "is_local_main_process",
    "is_last_process",
)


def test_state_answers_accelerates_attributes_as_the_accelerator_does():
    accelerator = Accelerator(mixed_precision="bf16")
    state = accelerator.state
    assert {name: getattr(state, name) for name in STATE_ATTRIBUTES} == {
        "num_processes": 1,
        "process_index": 0,
        "local_process_index": 0,
        "device": torch.device("cpu"),
        "distributed_type": DistributedType.NO,
        "mixed_precision": "bf16",
        "is_main_process": True,
        "is_local_main_process": True,
        "is_last_process": True,
    }
    assert all(getattr(state, name) == getattr(accelerator, name) for name in STATE_ATTRIBUTES)
    # The names existing code reads keep their values.
    assert (state.rank, state.local_rank, state.world_size, state.backend, state.is_distributed) == (
        0,
        0,
        1,
        None,
        False,
    )
    assert isinstance(state, DistributedEnvironment)


def test_state_is_frozen():
    state = Accelerator().state
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.mixed_precision = "fp16"
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.rank = 1


def test_each_accelerator_has_its_own_state():
    plain = Accelerator(mixed_precision="fp16")
    sharded = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    assert plain.state is not sharded.state
    assert (plain.state.mixed_precision, plain.state.distributed_type) == ("fp16", DistributedType.NO)
    assert (sharded.state.mixed_precision, sharded.state.distributed_type) == ("no", DistributedType.FSDP)
    assert sharded.distributed_type is DistributedType.FSDP


def test_the_last_process_is_the_highest_rank():
    assert AcceleratorState(rank=1, world_size=2).is_last_process
    assert not DistributedEnvironment(rank=0, world_size=2).is_last_process
    two_nodes = DistributedEnvironment(rank=2, local_rank=0, world_size=4, local_world_size=2)
    assert (two_nodes.num_processes, two_nodes.process_index, two_nodes.local_process_index) == (4, 2, 0)
    assert two_nodes.is_local_main_process and not two_nodes.is_main_process and not two_nodes.is_last_process


def test_on_last_process_runs_on_the_only_process():
    accelerator = Accelerator()
    assert accelerator.is_last_process

    @accelerator.on_last_process
    def answer(value):
        return value * 2

    assert answer(21) == 42 and answer.__name__ == "answer"


def test_synchronize_rng_states_takes_a_generator_and_checks_its_kinds():
    generator = torch.Generator().manual_seed(3)
    before = generator.get_state()
    synchronize_rng_states(["torch", "generator"], generator=generator)  # one process: nothing to synchronize
    assert torch.equal(generator.get_state(), before)
    with pytest.raises(ValueError, match=r"unknown entries \['xla'\]"):
        synchronize_rng_states(["xla"], generator=generator)


def _order(sampler, epoch=0):
    sampler.set_epoch(epoch)
    return list(sampler)


def test_seedable_sampler_data_seed_is_the_seed():
    assert _order(SeedableRandomSampler(range(30), data_seed=5)) == _order(SeedableRandomSampler(range(30), seed=5))
    assert _order(SeedableRandomSampler(range(30), data_seed=5, seed=9)) == _order(
        SeedableRandomSampler(range(30), seed=5)
    )
    assert _order(SeedableRandomSampler(range(30), seed=5), 1) != _order(SeedableRandomSampler(range(30), seed=5))


def test_seedable_sampler_without_a_seed_uses_torchs_initial_seed():
    torch.manual_seed(11)
    assert SeedableRandomSampler(range(30)).seed == 11
    assert _order(SeedableRandomSampler(range(30))) == _order(SeedableRandomSampler(range(30), seed=11))


def test_seedable_sampler_draws_from_a_given_generator_reseeded_each_epoch():
    generator = torch.Generator().manual_seed(999)
    given = SeedableRandomSampler(range(30), False, None, generator, data_seed=5)
    untouched = torch.Generator().manual_seed(999).get_state()
    assert _order(given, 2) == _order(SeedableRandomSampler(range(30), seed=5), 2)
    assert not torch.equal(generator.get_state(), untouched)  # the draws came from the caller's generator
    with_replacement = SeedableRandomSampler(range(4), replacement=True, num_samples=10, data_seed=1)
    assert len(_order(with_replacement)) == 10 and set(_order(with_replacement)) <= set(range(4))


def _epoch_orders(accelerator, epochs=2):
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=5, shuffle=True))
    return [[index for batch in loader for index in batch[0].tolist()] for _ in range(epochs)]


def test_data_seed_is_the_seed_prepared_loaders_shuffle_from():
    config = DataLoaderConfiguration(data_seed=1234)
    torch.manual_seed(1)
    first = _epoch_orders(Accelerator(dataloader_config=config))
    torch.manual_seed(2)  # torch's seed no longer matters
    assert _epoch_orders(Accelerator(dataloader_config=DataLoaderConfiguration(data_seed=1234))) == first
    assert first == [_order(SeedableRandomSampler(range(20), data_seed=1234), epoch) for epoch in range(2)]


def test_without_data_seed_prepared_loaders_shuffle_as_the_plain_loader_and_seedable_ones_from_torchs_seed():
    assert DataLoaderConfiguration().data_seed is None and not DataLoaderConfiguration().use_seedable_sampler
    torch.manual_seed(1)
    plain = DataLoader(TensorDataset(torch.arange(20)), batch_size=5, shuffle=True)
    expected = [[index for batch in plain for index in batch[0].tolist()] for _ in range(2)]
    torch.manual_seed(1)
    assert _epoch_orders(Accelerator()) == expected
    torch.manual_seed(1)
    seedable = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    assert _epoch_orders(seedable) == [_order(SeedableRandomSampler(range(20), seed=1), epoch) for epoch in range(2)]


def test_gradient_state_names_the_loader_being_iterated():
    accelerator = Accelerator()
    first, second = accelerator.prepare(DataLoader(range(4), batch_size=2), DataLoader(range(2), batch_size=1))
    state = accelerator.gradient_state
    assert state.active_dataloader is None and not state.in_dataloader
    inner = []
    for _ in first:
        assert state.active_dataloader is first and state.in_dataloader
        inner.extend(state.active_dataloader is second for _ in second)
        assert state.active_dataloader is first
    assert inner == [True] * 4 and state.active_dataloader is None


def test_an_accelerator_and_its_loaders_pickle():
    accelerator = Accelerator(mixed_precision="bf16")
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=2, shuffle=True))
    copy = pickle.loads(pickle.dumps(accelerator))
    assert copy.state == accelerator.state and copy.mixed_precision == "bf16"
    again = pickle.loads(pickle.dumps(loader))
    assert sorted(i for (batch,) in again for i in batch.tolist()) == list(range(6))


def test_a_seedable_sampler_in_a_plain_loader_moves_to_the_next_epoch_after_each_pass():
    sampler = SeedableRandomSampler(range(10), data_seed=3)
    loader = DataLoader(range(10), batch_size=5, sampler=sampler)
    passes = [[i for batch in loader for i in batch.tolist()] for _ in range(2)]
    expected = [torch.randperm(10, generator=torch.Generator().manual_seed(3 + epoch)).tolist() for epoch in (0, 1)]
    assert passes == expected and sampler.epoch == 2
    assert isinstance(sampler, torch.utils.data.RandomSampler) and sampler.initial_seed == 3  # Accelerate's names


def test_partial_state_is_one_shared_state_with_accelerates_verbs():
    from runner.engine import PartialState, ops

    PartialState._reset_state()
    try:
        first, second = PartialState(), PartialState()
        facts = (first.num_processes, first.process_index, first.distributed_type, first.is_main_process)
        assert facts == (1, 0, DistributedType.NO, True) and first.device == Accelerator().device
        assert not first.debug and not ops.is_debug_mode()
        second.debug = True  # one state: the first sees it, and so do the collectives
        assert first.debug and ops.is_debug_mode()
        with first.split_between_processes([1, 2, 3]) as mine:
            assert mine == [1, 2, 3]
        assert first.on_main_process(lambda: "ran")() == "ran"
        PartialState._reset_state()
        assert not ops.is_debug_mode()
        with pytest.raises(ValueError) as refused:
            PartialState(cpu=True, bogus=1)
        assert str(refused.value) == (
            "PartialState got unknown arguments ['bogus']; it takes cpu, backend, init_method and timeout."
        )
    finally:
        PartialState._reset_state()


def test_accelerates_singleton_idiom_for_the_accelerator_state_is_one_sentence():
    from runner.engine.state import AcceleratorState as Exported

    assert Exported is AcceleratorState
    with pytest.raises(ValueError) as refused:
        AcceleratorState()
    assert str(refused.value) == (
        "AcceleratorState() is not the live state here: each Accelerator holds its own; read accelerator.state, or "
        "PartialState() for this process's rank, device and group."
    )
    state = Accelerator().state
    assert pickle.loads(pickle.dumps(state)) == state and dataclasses.replace(state, rank=0) == state
