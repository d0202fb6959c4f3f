"""LocalSGD on one process (a no-op that counts steps) and its refusals."""

import pytest
import torch

from runner.engine import Accelerator, FullyShardedDataParallelPlugin
from runner.engine.local_sgd import LocalSGD


def test_one_process_counts_steps_and_leaves_the_parameters_alone():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    weight = model.weight.detach().clone()
    with LocalSGD(accelerator, model, local_sgd_steps=2) as local_sgd:
        for _ in range(3):
            local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 3
    assert torch.equal(model.weight, weight)


def test_refuses_sharded_models_and_bad_step_counts():
    sharded = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin())
    with pytest.raises(NotImplementedError, match=r"distributed_type=FSDP .* prepare the model with plain DDP"):
        LocalSGD(sharded, torch.nn.Linear(2, 1), local_sgd_steps=2, enabled=False)
    with pytest.raises(ValueError, match=r"local_sgd_steps=0; pass a positive integer"):
        LocalSGD(Accelerator(cpu=True), torch.nn.Linear(2, 1), local_sgd_steps=0)
