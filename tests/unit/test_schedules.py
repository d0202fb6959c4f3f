import math

import pytest
import torch

from runner.config import ConfigError
from runner.schedules import constant, warmup_cosine
from runner.training.loop import build_scheduler, every, total_optimizer_steps


def lrs(scheduler, optimizer, steps):
    values = []
    for _ in range(steps):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return values


def sgd(lr=1.0):
    return torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=lr)


def test_warmup_cosine_shape():
    optimizer = sgd()
    values = lrs(warmup_cosine(optimizer, total_steps=10, warmup_steps=2, min_lr_ratio=0.1), optimizer, 11)
    assert values[:3] == [0.5, 1.0, 1.0]
    assert values[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert values[10] == pytest.approx(0.1)


def test_a_resumed_schedule_keeps_its_step_and_takes_its_length_from_the_new_config():
    optimizer = sgd()
    scheduler = warmup_cosine(optimizer, total_steps=10)
    lrs(scheduler, optimizer, 5)
    state = scheduler.state_dict()
    longer = warmup_cosine(sgd(), total_steps=20)
    longer.load_state_dict(state)
    assert longer.last_epoch == 5
    assert longer.lr_lambdas[0](5) == pytest.approx(0.5 * (1 + math.cos(math.pi * 5 / 20)))


def test_build_scheduler_passes_total_steps_only_where_accepted():
    from omegaconf import OmegaConf

    optimizer = sgd()
    cosine = OmegaConf.create({"_target_": "runner.schedules.warmup_cosine", "_partial_": True, "warmup_steps": 1})
    assert build_scheduler(cosine, optimizer, 7).lr_lambdas[0].keywords["total_steps"] == 7
    step_lr = OmegaConf.create({"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True, "step_size": 3})
    assert isinstance(build_scheduler(step_lr, optimizer, 7), torch.optim.lr_scheduler.StepLR)
    assert build_scheduler(None, optimizer, 7) is None
    flat = sgd(0.3)
    assert lrs(constant(flat, total_steps=4), flat, 3) == [0.3, 0.3, 0.3]


def test_step_budget_and_cadence():
    from omegaconf import OmegaConf

    trainer = OmegaConf.create({"max_steps": None, "max_epochs": 3, "gradient_accumulation_steps": 4})
    assert total_optimizer_steps(trainer, batches_per_epoch=10) == 9  # 3 epochs x ceil(10 / 4)
    assert total_optimizer_steps(trainer, batches_per_epoch=list(range(10))) == 9  # a loader: its length
    with pytest.raises(ConfigError) as refused:  # a stream without a length, and no max_steps
        total_optimizer_steps(trainer, batches_per_epoch=iter(range(10)))
    assert str(refused.value) == (
        "trainer.max_steps is null and data.train is a stream without a length, so the number of steps is not known "
        "before the stream ends; set trainer.max_steps."
    )
    trainer.max_steps = 5
    assert total_optimizer_steps(trainer, batches_per_epoch=10) == 5
    assert total_optimizer_steps(trainer, batches_per_epoch=iter(range(10))) == 5
    assert [every(3, s) for s in (1, 3, 6)] == [False, True, True] and not every(None, 3)
