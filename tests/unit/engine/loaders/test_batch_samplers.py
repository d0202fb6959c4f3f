"""Loaders with a batch sampler of the user's: its batches are kept whole and dealt out to the ranks.

The expected shards are Accelerate 1.x's ``BatchSamplerShard`` on the same batches.
"""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, SequentialSampler

from runner.engine import Accelerator, DataLoaderConfiguration
from runner.engine.loaders.batch_shards import BatchSamplerShard
from runner.engine.loaders.prepare import prepare_data_loader
from runner.engine.optimizer import GradientAccumulationPlugin, GradientState

VARYING = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]


class Varying(Sampler):
    """Batches of varying sizes, and no batch_size (a bucketing sampler, say); records set_epoch."""

    def __init__(self, batches=VARYING):
        self.batches = batches
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class MyBatches(BatchSampler):
    """A batch sampler of another class than torch's: sharded by batches."""


def sequential(n, batch_size, drop_last=False):
    return BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)


def shards(batch_sampler, world=2, **options):
    return [
        list(BatchSamplerShard(batch_sampler, num_processes=world, process_index=r, **options)) for r in range(world)
    ]


def prepared(loader, *, world=1, rank=0, **config):
    return prepare_data_loader(
        loader,
        device=None,
        num_processes=world,
        process_index=rank,
        gradient_state=GradientState(GradientAccumulationPlugin()),
        config=DataLoaderConfiguration(**config),
        broadcast_seed=lambda seed: 1234,
    )


def listed(loader):
    return [batch.tolist() for batch in loader]


@pytest.mark.parametrize("as_sampler", [True, False])
def test_on_one_process_the_loader_yields_exactly_the_users_batches(as_sampler):
    accelerator = Accelerator()
    data = torch.arange(10) * 10
    if as_sampler:
        user = DataLoader(data, sampler=sequential(10, 4), batch_size=None)
    else:
        user = DataLoader(data, batch_sampler=MyBatches(SequentialSampler(range(10)), 4, False))
    loader = accelerator.prepare(user)
    ends = []
    batches = []
    for batch in loader:
        batches.append(batch.tolist())
        ends.append(accelerator.gradient_state.end_of_dataloader)
    assert batches == listed(user) == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90]]
    assert ends == [False, False, True] and len(loader) == 3 and loader.total_batch_size == 4


def test_varying_batch_sizes_pass_through_whole():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(list(range(11)), batch_sampler=Varying()))
    assert listed(loader) == VARYING and len(loader) == 5 and loader.total_batch_size is None


def test_ranks_take_every_nth_batch_and_even_batches_cycle_from_the_start():
    assert shards(sequential(10, 4)) == [[[0, 1, 2, 3], [8, 9, 0, 1]], [[4, 5, 6, 7], [2, 3, 4, 5]]]
    assert shards(sequential(12, 4)) == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [0, 1, 2, 3]]]
    assert shards(sequential(10, 4), even_batches=False) == [[[0, 1, 2, 3], [8, 9]], [[4, 5, 6, 7]]]
    assert shards(sequential(10, 4, drop_last=True)) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # Fewer samples than one step needs: the first batches are reused as often as it takes.
    assert shards(sequential(3, 4), world=3) == [[[0, 1, 2, 0]], [[1, 2, 0, 1]], [[2, 0, 1, 2]]]


def test_split_batches_cut_every_batch_into_one_slice_per_rank():
    assert shards(sequential(10, 4), split_batches=True) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    uneven = shards(sequential(10, 4), split_batches=True, even_batches=False)
    assert uneven == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]
    with pytest.raises(ValueError, match="needs a batch size divisible by the 2 processes, but BatchSampler has"):
        BatchSamplerShard(sequential(10, 3), num_processes=2, process_index=0, split_batches=True)


def test_padding_is_recorded_so_gather_for_metrics_can_drop_it():
    batches = BatchSamplerShard(sequential(10, 4), num_processes=2, process_index=1)
    list(batches)
    assert batches.remainder == 2  # the last step holds the samples 8 and 9, then padding
    full = BatchSamplerShard(sequential(16, 4), num_processes=2, process_index=1)
    list(full)
    assert full.remainder == -1


class Bucketing(Varying):
    """Varying batch sizes below a batch_size of 3 (a bucketing sampler that declares its largest batch)."""

    batch_size = 3


def test_a_last_step_whose_last_batch_is_full_is_not_padded_and_padding_comes_last():
    full_last = BatchSamplerShard(Bucketing([[0, 1, 2], [3, 4, 5], [6], [7, 8, 9]]), num_processes=2, process_index=0)
    assert shards(full_last.batch_sampler) == [[[0, 1, 2], [6]], [[3, 4, 5], [7, 8, 9]]]
    list(full_last)
    assert full_last.remainder == -1  # nothing padded: gather_for_metrics keeps every sample once
    short_last = Bucketing([[0, 1, 2], [3, 4, 5], [6], [7]])
    assert shards(short_last) == [[[0, 1, 2], [6]], [[3, 4, 5], [7, 0, 1]]]  # [6] stays; [7] is filled
    sharded = BatchSamplerShard(short_last, num_processes=2, process_index=1)
    list(sharded)
    assert sharded.remainder == 2  # the gathered last step [6, 7, 0, 1] keeps its first 2: samples 6 and 7


def test_a_sampler_without_batch_size_needs_even_batches_off_on_several_processes():
    with pytest.raises(ValueError, match="even_batches needs a batch size, and the batch sampler Varying has no"):
        prepared(DataLoader(list(range(11)), batch_sampler=Varying()), world=2)
    assert shards(Varying(), even_batches=False) == [[[0, 1, 2], [4, 5], [10]], [[3], [6, 7, 8, 9]]]


def test_the_prepared_loader_yields_each_ranks_share_with_equal_counts():
    user = DataLoader(torch.arange(10), sampler=sequential(10, 4), batch_size=None)
    ranks = [listed(prepared(user, world=2, rank=r)) for r in range(2)]
    assert ranks == [[[0, 1, 2, 3], [8, 9, 0, 1]], [[4, 5, 6, 7], [2, 3, 4, 5]]]
    assert [len(prepared(user, world=2, rank=r)) for r in range(2)] == [2, 2]


def test_shuffled_batches_are_the_plain_loaders_cut_between_ranks_and_resume_exactly():
    def user():
        generator = torch.Generator().manual_seed(4)
        return DataLoader(
            list(range(12)), batch_sampler=MyBatches(RandomSampler(range(12), generator=generator), 3, False)
        )

    plain = user()
    expected = [[batch.tolist() for batch in plain] for _ in range(2)]
    assert expected[0] != expected[1]
    one = prepared(user())
    assert [listed(one) for _ in range(2)] == expected  # on one process: the plain loader's batches
    ranks = [prepared(user(), world=2, rank=r) for r in range(2)]
    for epoch in range(2):  # on two: the same batches, dealt out in turn
        first, second = (listed(loader) for loader in ranks)
        assert first == expected[epoch][0::2] and second == expected[epoch][1::2]
    third = iter(one)
    next(third)  # a third pass, saved after its first batch
    resumed = prepared(user())
    resumed.load_state_dict(one.state_dict())
    assert listed(resumed) == [batch.tolist() for batch in third]


def test_seedable_shuffled_batches_are_the_same_on_every_rank_and_new_each_epoch():
    user = DataLoader(list(range(12)), batch_sampler=MyBatches(RandomSampler(range(12)), 3, False))
    loaders = [prepared(user, world=2, rank=r, use_seedable_sampler=True) for r in range(2)]
    epochs = [[listed(loader) for loader in loaders] for _ in range(2)]
    for first, second in epochs:
        assert sorted(i for batch in first + second for i in batch) == list(range(12))
    assert epochs[0] != epochs[1]
    loaders[0].set_epoch(0)
    assert listed(loaders[0]) == epochs[0][0]
    assert type(user.batch_sampler.sampler) is RandomSampler  # the user's loader is left as it was


def test_set_epoch_reaches_the_users_batch_sampler():
    sampler = Varying()
    loader = prepared(DataLoader(list(range(11)), batch_sampler=sampler))
    loader.set_epoch(3)
    list(loader)
    list(loader)
    assert loader.batches.batch_sampler.epochs == [3, 4] and sampler.epochs == [3, 4]


def test_a_position_counts_the_users_batches_and_resumes_exactly():
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(list(range(11)), batch_sampler=Varying()))
    iterator = iter(loader)
    next(iterator), next(iterator)
    position = loader.state_dict()
    assert position == {"epoch": 0, "batches_seen": 2, "samples_seen": 2}
    resumed = accelerator.prepare(DataLoader(list(range(11)), batch_sampler=Varying()))
    resumed.load_state_dict(position)
    assert listed(resumed) == VARYING[2:]
    assert listed(accelerator.skip_first_batches(resumed, 4)) == VARYING[4:]
    with pytest.raises(ValueError, match="position has no 'batches_seen'"):
        resumed.load_state_dict({"epoch": 0, "samples_seen": 4})


def test_two_ranks_resume_at_the_same_step():
    user = DataLoader(torch.arange(10), sampler=sequential(10, 2), batch_size=None)
    whole = [listed(prepared(user, world=2, rank=r)) for r in range(2)]
    for rank in range(2):
        loader = prepared(user, world=2, rank=rank)
        loader.load_state_dict({"epoch": 0, "batches_seen": 2, "samples_seen": 4})  # one step of 2 batches
        assert listed(loader) == whole[rank][1:]
        assert loader.state_dict() == {"epoch": 1, "batches_seen": 0, "samples_seen": 0}


def test_dispatch_batches_is_refused_for_batches_kept_whole():
    with pytest.raises(
        ValueError, match="dispatch_batches=True cannot send the batches of the batch sampler MyBatches"
    ):
        prepared(
            DataLoader(list(range(4)), batch_sampler=MyBatches(range(4), 2, False)), world=2, dispatch_batches=True
        )
