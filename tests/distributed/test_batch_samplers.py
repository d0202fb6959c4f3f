"""A user's batch sampler on 2 gloo processes: each rank gets whole batches, every batch once, in step."""

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

from runner.engine import Accelerator, DataLoaderConfiguration


class MyBatches(BatchSampler):
    """A batch sampler of another class than torch's: sharded by batches, not by samples."""


VARYING = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]


class Varying(torch.utils.data.Sampler):
    def __iter__(self):
        return iter(VARYING)

    def __len__(self):
        return len(VARYING)


def _user_loaders():
    data = torch.arange(11)
    return {
        "sampler=BatchSampler": (DataLoader(data, sampler=BatchSampler(range(10), 4, False), batch_size=None), {}),
        "custom batch_sampler": (DataLoader(data, batch_sampler=MyBatches(SequentialSampler(range(10)), 4, False)), {}),
        "split_batches": (DataLoader(data, batch_sampler=MyBatches(range(10), 4, False)), {"split_batches": True}),
        "varying, uneven": (DataLoader(data, batch_sampler=Varying()), {"even_batches": False}),
        "shuffled": (DataLoader(data, batch_sampler=MyBatches(RandomSampler(range(11)), 3, False)), {}),
    }


def _one_epoch_each():
    out = {}
    for name, (user, options) in _user_loaders().items():
        accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(**options))
        loader = accelerator.prepare(user)
        mine, gathered, ends = [], [], []
        for batch in loader:
            mine.append(batch.tolist())
            ends.append(accelerator.gradient_state.end_of_dataloader)
            if options.get("even_batches", True):  # a collective: only when the ranks run as many steps
                gathered.extend(accelerator.gather_for_metrics(batch).tolist())
        out[name] = {"mine": mine, "gathered": gathered, "ends": ends, "len": len(loader)}
    return out


def test_each_rank_gets_its_share_of_the_users_batches(launch):
    rank0, rank1 = launch(_one_epoch_each)
    # Accelerate's BatchSamplerShard: batches r, r + 2, ...; the last step completed from the epoch's start.
    assert rank0["sampler=BatchSampler"]["mine"] == [[0, 1, 2, 3], [8, 9, 0, 1]]
    assert rank1["sampler=BatchSampler"]["mine"] == [[4, 5, 6, 7], [2, 3, 4, 5]]
    assert rank0["custom batch_sampler"]["mine"] == rank0["sampler=BatchSampler"]["mine"]
    assert rank1["custom batch_sampler"]["mine"] == rank1["sampler=BatchSampler"]["mine"]
    assert rank0["split_batches"]["mine"] == [[0, 1], [4, 5], [8, 9]]
    assert rank1["split_batches"]["mine"] == [[2, 3], [6, 7], [0, 1]]
    assert rank0["varying, uneven"]["mine"] == [[0, 1, 2], [4, 5], [10]]
    assert rank1["varying, uneven"]["mine"] == [[3], [6, 7, 8, 9]]
    for name in _user_loaders():
        first, second = rank0[name], rank1[name]
        for result in (first, second):
            assert result["len"] == len(result["mine"]), name
            assert result["ends"] == [False] * (len(result["ends"]) - 1) + [True], name
        if name != "varying, uneven":
            assert len(first["mine"]) == len(second["mine"]), name  # even_batches: the ranks stay in step
            samples = 11 if name == "shuffled" else 10
            assert sorted(first["gathered"]) == list(range(samples)) == sorted(second["gathered"]), name
    shuffled = rank0["shuffled"]["mine"] + rank1["shuffled"]["mine"]  # 3 + 3 + 3 + 2 samples, the 2 padded by one
    assert [len(batch) for batch in shuffled] == [3, 3, 3, 3]
    assert len({i for batch in shuffled for i in batch}) == 11  # the ranks shuffled alike: every sample is there
    varying = rank0["varying, uneven"]["mine"] + rank1["varying, uneven"]["mine"]
    assert sorted(varying) == sorted(VARYING)  # the union is the user's batches, each once


def _save_then_resume(folder):
    def build():  # seedable: set_epoch(0) replays the first epoch
        config = DataLoaderConfiguration(use_seedable_sampler=True)
        accelerator = Accelerator(project_dir=folder, dataloader_config=config)
        user = DataLoader(torch.arange(24), batch_sampler=MyBatches(RandomSampler(range(24)), 2, False))
        return accelerator, accelerator.prepare(user)

    accelerator, loader = build()
    whole = [batch.tolist() for batch in loader]
    loader.set_epoch(0)
    iterator = iter(loader)
    first = [next(iterator).tolist() for _ in range(2)]
    accelerator.save_state(f"{folder}/checkpoint")
    accelerator, resumed = build()
    accelerator.load_state(f"{folder}/checkpoint")
    return {"whole": whole, "first": first, "rest": [batch.tolist() for batch in resumed]}


def test_a_users_batch_sampler_resumes_exactly_on_two_processes(launch, tmp_path):
    for result in launch(_save_then_resume, str(tmp_path)):
        assert len(result["whole"]) == 6
        assert result["first"] + result["rest"] == result["whole"]
