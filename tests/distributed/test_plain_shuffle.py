"""A prepared shuffled loader on 2 gloo processes deals out Accelerate's order, and resumes it exactly.

With a generator, N processes x batch b see, step by step, the batches one process sees with the plain
loader and batch N*b. Without one, as in Accelerate, the sampler gets a generator for all passes, seeded
as prepare() runs by one draw of torch's generator. Either way the ranks start from rank 0's, whatever
their own.
"""

import torch
from torch.utils.data import DataLoader, RandomSampler

from runner.engine import Accelerator

SAMPLES, PER_RANK = 24, 3


def _plain(generator, batch_size):
    return DataLoader(torch.arange(SAMPLES), batch_size=batch_size, shuffle=True, generator=generator)


def _epochs(loader, epochs=2):
    return [[batch.tolist() for batch in loader] for _ in range(epochs)]


def _orders_and_a_saved_pass(folder):
    accelerator = Accelerator(project_dir=folder)
    rank = accelerator.process_index
    # Each rank seeds its own way: rank 0's generator, and rank 0's torch seed, are everyone's.
    with_generator = accelerator.prepare(_plain(torch.Generator().manual_seed(5 + rank), PER_RANK))
    torch.manual_seed(100 + rank)
    without = accelerator.prepare(_plain(None, PER_RANK))
    result = {"with_generator": _epochs(with_generator), "without": _epochs(without)}
    third = iter(with_generator)  # a third pass, saved after two steps
    result["saved"] = [next(third).tolist() for _ in range(2)]
    accelerator.save_state(f"{folder}/checkpoint")
    result["rest"] = [batch.tolist() for batch in third]
    return result


def _resumed(folder):
    accelerator = Accelerator(project_dir=folder)
    loader = accelerator.prepare(_plain(torch.Generator().manual_seed(77), PER_RANK))  # the seed is the saved one
    accelerator.prepare(_plain(None, PER_RANK))  # the saved run's second loader
    accelerator.load_state(f"{folder}/checkpoint")
    return [batch.tolist() for batch in loader] + [batch.tolist() for batch in loader]


def test_two_ranks_deal_out_the_plain_loaders_order_and_resume_it_on_any_world_size(launch, tmp_path):
    world = 2
    global_batch = world * PER_RANK
    with_generator = _epochs(_plain(torch.Generator().manual_seed(5), global_batch), epochs=4)
    torch.manual_seed(100)
    persistent = torch.Generator().manual_seed(int(torch.empty((), dtype=torch.int64).random_()))
    sampler = RandomSampler(range(SAMPLES), generator=persistent)
    without = [[order[i : i + global_batch] for i in range(0, SAMPLES, global_batch)] for order in
               (list(sampler) for _ in range(2))]  # fmt: skip

    ranks = launch(_orders_and_a_saved_pass, str(tmp_path))

    def slices(epochs, rank):
        return [[batch[rank * PER_RANK : (rank + 1) * PER_RANK] for batch in epoch] for epoch in epochs]

    for rank, result in enumerate(ranks):
        assert result["with_generator"] == slices(with_generator[:2], rank)
        assert result["without"] == slices(without, rank)
        assert result["saved"] + result["rest"] == slices(with_generator[2:3], rank)[0]

    # The same world size continues exactly: the rest of the third pass, then the fourth.
    resumed = launch(_resumed, str(tmp_path))
    for rank, rest in enumerate(resumed):
        assert rest == slices([with_generator[2][2:] + with_generator[3]], rank)[0]

    # One process continues the same global order after the 2 x 2 x 3 samples already seen, then the fourth pass.
    alone = _resumed(str(tmp_path))
    remaining = [i for batch in with_generator[2] for i in batch][2 * global_batch :]
    fourth = [i for batch in with_generator[3] for i in batch]
    chunks = [remaining[i : i + PER_RANK] for i in range(0, len(remaining), PER_RANK)]
    assert alone == chunks + [fourth[i : i + PER_RANK] for i in range(0, SAMPLES, PER_RANK)]


def _saved_alone(folder):
    """One process, no generator: a pass saved after 2 batches of 6 (each pass draws a new generator's seed)."""
    torch.manual_seed(100)
    accelerator = Accelerator(project_dir=folder)
    loader = accelerator.prepare(_plain(None, 2 * PER_RANK))
    passes = _epochs(loader, epochs=1)
    third = iter(loader)
    saved = [next(third).tolist() for _ in range(2)]
    accelerator.save_state(f"{folder}/checkpoint")
    return passes, saved + [batch.tolist() for batch in third]


def _resumed_on_two(folder):
    accelerator = Accelerator(project_dir=folder)
    loader = accelerator.prepare(_plain(None, PER_RANK))  # on two processes it gets a generator of its own
    accelerator.load_state(f"{folder}/checkpoint")
    return [batch.tolist() for batch in loader], [batch.tolist() for batch in loader]


def test_a_pass_saved_by_one_process_continues_on_two_in_the_saved_runs_way_of_drawing(launch, tmp_path):
    _, second = _saved_alone(str(tmp_path))
    rest = [i for batch in second[2:] for i in batch]  # the 12 samples after the saved position
    ranks = launch(_resumed_on_two, str(tmp_path))
    for rank, (resumed, _) in enumerate(ranks):
        assert resumed == [rest[i + rank * PER_RANK : i + (rank + 1) * PER_RANK] for i in range(0, 12, 2 * PER_RANK)]
    # The next pass draws a new generator's seed, rank 0's, as the saved run did: one order cut between the ranks.
    after = [ranks[0][1][step] + ranks[1][1][step] for step in range(len(ranks[0][1]))]
    assert sorted(i for batch in after for i in batch) == list(range(SAMPLES))
