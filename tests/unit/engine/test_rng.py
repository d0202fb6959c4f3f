import random

import torch

from runner.engine import set_seed
from runner.engine.distributed import DistributedEnvironment


def _draws() -> tuple[float, float]:
    return torch.rand(1).item(), random.random()


def test_device_specific_seeds_add_the_process_index_of_the_engines_environment(monkeypatch):
    set_seed(10)
    on_rank_0 = _draws()
    set_seed(13)
    expected = _draws()
    set_seed(10, device_specific=True, env=DistributedEnvironment(rank=3, world_size=4))
    assert _draws() == expected
    monkeypatch.setenv("RANK", "3")  # without env=, read from the environment as an Accelerator reads it
    monkeypatch.setenv("WORLD_SIZE", "4")
    set_seed(10, device_specific=True)
    assert _draws() == expected
    set_seed(10, device_specific=False)
    assert _draws() == on_rank_0
