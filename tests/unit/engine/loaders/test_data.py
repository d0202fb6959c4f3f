import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler, SubsetRandomSampler, TensorDataset

from runner.engine import Accelerator, DataLoaderConfiguration
from runner.engine.loaders import SeedableRandomSampler, ShardedBatchSampler, Sharding, batch_seed


def samplers(n, batch_size, world, **kwargs):
    """One ShardedBatchSampler per rank over range(n)."""
    options = {"drop_last": False, **kwargs}
    return [
        ShardedBatchSampler(
            SequentialSampler(range(n)), batch_size=batch_size, num_processes=world, process_index=rank, **options
        )  # fmt: skip
        for rank in range(world)
    ]


def shards(n, batch_size, world, **kwargs):
    """Every rank's batches of one epoch over range(n)."""
    return [list(sampler) for sampler in samplers(n, batch_size, world, **kwargs)]


def test_ranks_take_consecutive_slices_of_each_global_batch():
    rank0, rank1 = shards(16, 4, 2)
    assert rank0 == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert rank1 == [[4, 5, 6, 7], [12, 13, 14, 15]]


@pytest.mark.parametrize("dispatched", [False, True])
@pytest.mark.parametrize("n", [97, 100, 101, 3])
def test_even_batches_pad_the_last_global_batch_from_the_start(n, dispatched):
    batches = shards(n, 8, 2, dispatched=dispatched)
    assert len(batches[0]) == len(batches[1])
    seen = [i for rank in batches for batch in rank for i in batch]
    assert set(seen) == set(range(n))
    duplicates = len(seen) - n
    # As Accelerate pads it: sharded by index, to a whole global batch (each rank keeps its whole batch of 8);
    # dispatched by rank 0, only to a multiple of the world size.
    assert duplicates == (n % 2 if dispatched else -n % 16)
    sampler = samplers(n, 8, 2, dispatched=dispatched)[0]
    assert sampler.remainder == (n % 16 if (n % 2 if dispatched else n % 16) else -1)
    assert len(sampler) == len(batches[0])
    if n == 3:  # shorter than one global batch: it pads itself, over and over
        assert batches == (
            [[[0, 1]], [[2, 0]]] if dispatched else [[[0, 1, 2, 0, 1, 2, 0, 1]], [[2, 0, 1, 2, 0, 1, 2, 0]]]
        )


def test_without_even_batches_ranks_may_get_fewer_batches():
    assert shards(18, 4, 2, even_batches=False) == [  # rank 0 keeps the short last batch whole, as in Accelerate
        [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17]],
        [[4, 5, 6, 7], [12, 13, 14, 15]],
    ]
    uneven = samplers(17, 4, 2, even_batches=False)
    assert [list(s) for s in uneven] == [[[0, 1, 2, 3], [8, 9, 10, 11], [16]], [[4, 5, 6, 7], [12, 13, 14, 15]]]
    assert [len(s) for s in uneven] == [3, 2]


def test_drop_last_drops_the_short_global_batch():
    dropping = samplers(20, 4, 2, drop_last=True)
    assert [list(s) for s in dropping] == [[[0, 1, 2, 3], [8, 9, 10, 11]], [[4, 5, 6, 7], [12, 13, 14, 15]]]
    assert [len(s) for s in dropping] == [2, 2] and dropping[0].remainder == -1


def test_split_batches_divides_the_loader_batch():
    assert shards(8, 4, 2, split_batches=True) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    with pytest.raises(ValueError, match="batch size divisible by the 2 processes, got 3"):
        samplers(8, 3, 2, split_batches=True)


def test_a_pass_can_start_mid_epoch_and_still_pad_from_the_epoch_start():
    rank0, rank1 = samplers(21, 4, 2)
    rank0.skip_samples = rank1.skip_samples = 8  # resume after the first global batch
    assert [list(rank0), list(rank1)] == [[[8, 9, 10, 11], [16, 17, 18, 19]], [[12, 13, 14, 15], [20, 0, 1, 2]]]
    assert rank0.num_batches(8) == 2 and rank0.remainder_after(8) == 5
    assert list(rank0) == [[0, 1, 2, 3], [8, 9, 10, 11], [16, 17, 18, 19]]  # the skip applied to one pass only


def test_seeded_shuffle_is_identical_across_ranks_and_new_each_epoch():
    orders = []
    for _ in range(2):  # two "ranks" built independently from the same seed
        sampler = SeedableRandomSampler(range(50), seed=7)
        per_epoch = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            per_epoch.append(list(sampler))
        orders.append(per_epoch)
    assert orders[0] == orders[1]
    assert sorted(orders[0][0]) == list(range(50))
    assert orders[0][0] != orders[0][1] != orders[0][2]


def seedable() -> Accelerator:
    return Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))


def test_prepared_loader_draws_each_pass_as_the_plain_loader_does_and_set_epoch_keeps_its_order():
    dataset = TensorDataset(torch.arange(12))
    plain = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    expected = [[b[0].tolist() for b in plain] for _ in range(3)]
    assert expected[0] != expected[1]
    loader = Accelerator().prepare(
        DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    )
    first = [b[0].tolist() for b in loader]
    loader.set_epoch(0)  # as for torch's loader, the next pass draws on from the generator
    assert [first, [b[0].tolist() for b in loader], [b[0].tolist() for b in loader]] == expected
    assert loader.iteration == 2


def test_prepared_loader_without_a_generator_draws_from_torchs_as_the_plain_loader_does():
    dataset = TensorDataset(torch.arange(12))
    torch.manual_seed(8)
    expected = [[b[0].tolist() for b in DataLoader(dataset, batch_size=4, shuffle=True)] for _ in range(2)]
    after = torch.rand(3)
    loader = Accelerator().prepare(DataLoader(dataset, batch_size=4, shuffle=True))
    torch.manual_seed(8)
    assert [[b[0].tolist() for b in loader] for _ in range(2)] == expected
    assert torch.equal(torch.rand(3), after)  # the same draws from torch's generator, no more


def test_seedable_prepared_loader_reshuffles_each_pass_and_set_epoch_replays_one():
    accelerator = seedable()
    dataset = TensorDataset(torch.arange(12))
    loader = accelerator.prepare(DataLoader(dataset, batch_size=4, shuffle=True))
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    assert first != second
    loader.set_epoch(0)
    assert [b[0].tolist() for b in loader] == first
    assert loader.iteration == 1


def test_the_shuffle_seed_comes_from_the_loader_generator_or_the_torch_seed():
    accelerator = Accelerator()
    dataset = TensorDataset(torch.arange(30))

    def order(generator=None):
        loader = accelerator.prepare(DataLoader(dataset, batch_size=30, shuffle=True, generator=generator))
        return next(iter(loader))[0].tolist()

    assert order(torch.Generator().manual_seed(5)) == order(torch.Generator().manual_seed(5))
    torch.manual_seed(11)
    seeded = order()
    torch.manual_seed(11)
    assert order() == seeded
    torch.manual_seed(12)
    assert order() != seeded


def test_loaders_that_cannot_be_sharded_are_refused():
    accelerator = Accelerator()
    with pytest.raises(ValueError, match="needs a batched DataLoader; set batch_size"):
        accelerator.prepare(DataLoader(range(4), batch_size=None))


def test_eval_loop_inside_an_epoch_does_not_end_the_training_loader():
    accelerator = Accelerator()
    train = accelerator.prepare(DataLoader(TensorDataset(torch.arange(6)), batch_size=2))
    evaluation = accelerator.prepare(DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    ends = []
    for _ in train:
        ends.append(accelerator.gradient_state.end_of_dataloader)
        for _ in evaluation:
            pass
        ends.append(accelerator.gradient_state.end_of_dataloader)
    assert ends == [False, False, False, False, True, True]


class Draws(torch.utils.data.Dataset):
    """Each item is its index and a number drawn from torch's RNG where it is loaded."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return index, torch.rand(())


def _mark_worker(worker_id):
    torch.utils.data.get_worker_info().dataset.marked_by = worker_id


def _draws(loader):
    return {int(i): float(x) for ids, xs in loader for i, x in zip(ids, xs, strict=True)}


def test_loader_workers_draw_per_batch_whatever_worker_loads_it_and_wherever_a_pass_starts():
    accelerator = seedable()  # the same order for each loader below, so their draws compare

    def prepared(num_workers, **options):
        loader = DataLoader(Draws(), batch_size=4, shuffle=True, num_workers=num_workers, **options)
        return accelerator.prepare(loader)

    two = _draws(prepared(2))
    assert _draws(prepared(1)) == two  # another worker count: the same batches, the same draws
    resumed = prepared(2)
    resumed.load_state_dict({"epoch": 0, "samples_seen": 12})
    later = _draws(resumed)
    assert len(later) == 12 and all(two[i] == x for i, x in later.items())
    assert len(set(two.values())) == 24  # nothing repeats: every batch has its own seed
    marked = prepared(2, worker_init_fn=_mark_worker)
    assert _draws(marked) == two  # the user's worker_init_fn still runs, before the seeding
    assert not hasattr(marked.dataset, "marked_by")  # in the workers' copies only


def test_batch_seeds_differ_by_epoch_position_and_rank():
    seeds = {batch_seed(7, epoch, offset, rank) for epoch in (0, 1) for offset in (0, 8) for rank in (0, 1)}
    assert len(seeds) == 8 and batch_seed(7, 1, 8, 1) == batch_seed(7, 1, 8, 1)
    first, second = samplers(16, 4, 2)
    first.seed = second.seed = 7
    assert [b.seed for b in first] == [batch_seed(7, 0, 0, 0), batch_seed(7, 0, 8, 0)]
    assert [b.seed for b in second] == [batch_seed(7, 0, 0, 1), batch_seed(7, 0, 8, 1)]


def test_a_plain_shuffles_position_that_does_not_fit_the_loader_is_one_sentence():
    dataset = TensorDataset(torch.arange(12))

    def prepared(accelerator, generator):
        return accelerator.prepare(DataLoader(dataset, batch_size=4, shuffle=True, generator=generator))

    with_generator = prepared(Accelerator(), torch.Generator().manual_seed(1))
    first_pass = iter(with_generator)
    next(first_pass)
    state = with_generator.state_dict()
    assert len(state["generators"]) == 1 and state["draw_seed"] is None
    with pytest.raises(ValueError, match=r"shuffles from 0 generator\(s\) but its saved position records 1 generator"):
        prepared(Accelerator(), None).load_state_dict(state)
    with pytest.raises(ValueError, match=r"saved generator state is damaged"):
        prepared(Accelerator(), torch.Generator()).load_state_dict({**state, "generators": ["AAAA"]})
    with pytest.raises(ValueError, match=r"records the generators of a plain shuffle, but this loader shuffles with"):
        prepared(seedable(), torch.Generator()).load_state_dict(state)
    resumed = prepared(Accelerator(), torch.Generator().manual_seed(99))
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in first_pass]


def test_real_rows_count_each_ranks_samples_before_the_padding():
    whole = [Sharding(4, 2, rank) for rank in (0, 1)]  # 5 real samples padded to 8: rank 0's 4, rank 1's first
    assert [sharding.real_rows(5, 4) for sharding in whole] == [4, 1]
    assert [sharding.real_rows(3, 4) for sharding in whole] == [3, 0]
    dispatched = [Sharding(4, 2, rank, dispatched=True) for rank in (0, 1)]  # 5 padded to 6, rows of 3
    assert [sharding.real_rows(5, 3) for sharding in dispatched] == [3, 2]
    accelerator = Accelerator()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(5)), batch_size=4))
    assert [loader.real_rows(len(batch)) for (batch,) in loader] == [4, 1]  # one process: never padded


def _subset_run(folder, *, stop=None, resume=False):
    """Two epochs over a SubsetRandomSampler, which draws from torch's generator itself; saved after ``stop``
    batches, or resumed from that save. Returns the batches and torch's next draw after the last pass."""
    torch.manual_seed(5)
    accelerator = Accelerator()
    loader = accelerator.prepare(
        DataLoader(TensorDataset(torch.arange(12)), batch_size=2, sampler=SubsetRandomSampler(range(12)))
    )
    if resume:
        accelerator.load_state(f"{folder}/checkpoint")
    seen = []
    for _ in range(1 if resume else 2):
        for (batch,) in loader:
            seen.append(batch.tolist())
            if len(seen) == stop:
                accelerator.save_state(f"{folder}/checkpoint")
                return seen, None
    if resume:  # the rest of the saved epoch was the pass above; then the next epoch
        seen += [batch.tolist() for (batch,) in loader]
    return seen, torch.rand(1).item()


def test_a_subset_random_samplers_pass_resumes_from_torchs_generator_as_the_pass_began(tmp_path):
    full, after = _subset_run(tmp_path / "full")
    plain_generator = torch.manual_seed(5)
    plain = DataLoader(range(12), batch_size=2, sampler=SubsetRandomSampler(range(12)))
    assert full == [batch.tolist() for _ in range(2) for batch in plain]  # the plain loader's draws
    assert after == torch.rand(1, generator=plain_generator).item()
    first, _ = _subset_run(tmp_path, stop=3)
    rest, resumed_after = _subset_run(tmp_path, resume=True)
    assert first + rest == full and resumed_after == after


def test_a_damaged_global_generator_state_in_a_position_is_one_sentence():
    loader = Accelerator().prepare(DataLoader(range(8), batch_size=2, sampler=SubsetRandomSampler(range(8))))
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    assert isinstance(state["global_state"], str)
    with pytest.raises(ValueError) as refused:
        loader.load_state_dict({**state, "global_state": "AAAA"})
    assert str(refused.value).startswith("This loader's saved generator state is damaged (")
