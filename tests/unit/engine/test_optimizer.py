"""The prepared optimizer's train/eval modes, with a schedule-free optimizer (the schedulefree package, a dev extra)."""

import copy

import torch
from schedulefree import AdamWScheduleFree
from torch import nn

from runner.engine import Accelerator

BATCHES = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(4)]


def _prepared(seed: int):
    accelerator = Accelerator(gradient_accumulation_steps=2)
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    return accelerator, *accelerator.prepare(model, AdamWScheduleFree(model.parameters(), lr=0.1, warmup_steps=2))


def _steps_through_the_engine(accelerator, model, optimizer, batches):
    for x in batches:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).pow(2).mean())
            optimizer.step()  # a no-op on the micro-steps that accumulate
            optimizer.zero_grad()


def _steps_by_hand(model, optimizer, batches):
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        for x in (first, second):
            (model(x).pow(2).mean() / 2).backward()
        optimizer.step()
        optimizer.zero_grad()


def _modes(optimizer) -> list[bool]:
    return [group["train_mode"] for group in optimizer.param_groups]


def _same(model, other) -> bool:
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


def test_a_schedule_free_optimizer_switches_modes_steps_and_round_trips_as_without_the_engine(tmp_path):
    accelerator, model, optimizer = _prepared(seed=0)
    plain_model = copy.deepcopy(model)
    plain = AdamWScheduleFree(plain_model.parameters(), lr=0.1, warmup_steps=2)
    assert _modes(optimizer) == [False]  # the library starts in eval mode, and steps only in train mode
    optimizer.train()
    plain.train()
    assert _modes(optimizer) == [True]

    _steps_through_the_engine(accelerator, model, optimizer, BATCHES)  # 2 optimizer steps of 2 micro-batches
    _steps_by_hand(plain_model, plain, BATCHES)
    assert optimizer.param_groups[0]["k"] == 2 and _same(model, plain_model)

    # eval() moves the parameters to the averaged weights z was kept for; train() moves them back.
    training_weights = model.weight.detach().clone()
    optimizer.eval()
    plain.eval()
    assert _modes(optimizer) == [False] and not torch.equal(model.weight, training_weights)
    assert _same(model, plain_model)
    accelerator.save_state(tmp_path / "checkpoint")  # in eval mode, as the library advises
    optimizer.train()
    torch.testing.assert_close(model.weight.detach(), training_weights)
    assert _modes(optimizer) == [True]

    # Another run loads the state, mode included, and trains on exactly as the uninterrupted optimizer.
    resumed_accelerator, resumed_model, resumed = _prepared(seed=1)
    resumed_accelerator.load_state(tmp_path / "checkpoint")
    assert _modes(resumed) == [False] and _same(resumed_model, plain_model)
    saved, loaded = plain.state_dict(), resumed.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    assert all(torch.equal(loaded["state"][0][key], value) for key, value in saved["state"][0].items())
    resumed.train()
    plain.train()
    _steps_through_the_engine(resumed_accelerator, resumed_model, resumed, BATCHES[:2])
    _steps_by_hand(plain_model, plain, BATCHES[:2])
    assert resumed.param_groups[0]["k"] == 3 and _same(resumed_model, plain_model)


def test_a_prepared_scheduler_steps_after_real_optimizer_steps_once_or_once_per_process():
    """Accelerate's count: a schedule in one process's batches advances ``num_processes`` times per optimizer step;
    ``step_scheduler_per_optimizer_step`` advances it once (a schedule in optimizer steps). Never on a micro-step."""
    from runner.engine.optimizer import AcceleratedScheduler

    accelerator = Accelerator(gradient_accumulation_steps=2, step_scheduler_per_optimizer_step=True)
    model = nn.Linear(3, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    prepared = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0))
    assert prepared.steps_per_call == 1
    counted = {}
    for per_optimizer_step in (False, True):
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda step: 1.0)
        scheduler = AcceleratedScheduler(
            schedule, optimizers=[optimizer], gradient_state=accelerator.gradient_state, num_processes=2,
            per_optimizer_step=per_optimizer_step,
        )  # fmt: skip
        counted[per_optimizer_step] = []
        for x in BATCHES:
            with accelerator.accumulate(model):
                accelerator.backward(model(x).pow(2).mean())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            counted[per_optimizer_step].append(schedule.last_epoch)
    assert counted == {False: [0, 2, 2, 4], True: [0, 1, 1, 2]}
