"""The step loop every recipe shares: step budget, cadences, the end-of-epoch rule, the running loss."""

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf

from runner.engine import Accelerator, ProjectConfiguration
from runner.training.loop import ProgressReporter, TrainingLoop, TrainingProgress


def run_loop(tmp_path, *, batches: int, steps: int, accumulation: int = 1, **cadence):
    """Drive a TrainingLoop over a loader of ``batches`` batches; return (evaluated steps, saved steps, loop)."""
    accelerator = Accelerator(
        gradient_accumulation_steps=accumulation,
        project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True),
    )
    model = torch.nn.Linear(1, 1)
    torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)  # a zero loss: the step count shows
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    data = torch.utils.data.TensorDataset(torch.ones(2 * batches, 1), torch.zeros(2 * batches, 1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, torch.utils.data.DataLoader(data, batch_size=2))
    trainer = {"log_every_n_steps": None, "eval_every_n_steps": None, "checkpoint_every_n_steps": None,
               "async_checkpoint": False, "progress_bar": False, **cadence}  # fmt: skip
    cfg = OmegaConf.create({"trainer": trainer, "resume": None})
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    evaluated = []
    loop = TrainingLoop(
        accelerator, cfg, progress=progress, total_steps=steps,
        evaluate=lambda: evaluated.append(progress.step) or {"eval/loss": float(progress.step)},
    )  # fmt: skip
    while loop.step < steps:  # the recipes' loop
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets) + progress.step  # tells the steps apart
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            loop.micro_step(loss, samples=len(inputs))
            if not accelerator.sync_gradients:
                continue
            loop.optimizer_step(lr=0.0)
            if loop.evaluation_due():
                loop.evaluate()
            if loop.checkpoint_due():
                loop.checkpoint()
            if loop.step >= steps:
                break
        else:
            if loop.evaluation_due(epoch_ended=True):
                loop.evaluate()
            if loop.checkpoint_due(epoch_ended=True):
                loop.checkpoint()
    if not loop.evaluated:
        loop.evaluate()
    if not loop.saved:
        loop.checkpoint()
    loop.close()
    accelerator.wait_for_checkpoint()  # the recipes' end_training does
    manifests = sorted((tmp_path / "checkpoints").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime_ns)
    saved = [json.loads(p.read_text())["step"] for p in manifests]
    return evaluated, saved, loop


@pytest.mark.parametrize(
    ("cadence", "evaluated", "saved"),
    [
        ({}, [5, 10, 12], [5, 10, 12]),  # null cadences: at each epoch's end, and the last step
        ({"eval_every_n_steps": 4, "checkpoint_every_n_steps": 6}, [4, 8, 12], [6, 12]),
        ({"eval_every_n_steps": 5}, [5, 10, 12], [5, 10, 12]),
        ({"checkpoint_every_n_steps": 6, "async_checkpoint": True}, [5, 10, 12], [6, 12]),  # saved in the background
    ],
)
def test_evaluations_and_checkpoints_fall_on_their_cadence_and_the_last_step(tmp_path, cadence, evaluated, saved):
    got_evaluated, got_saved, loop = run_loop(tmp_path, batches=5, steps=12, **cadence)
    assert (got_evaluated, got_saved) == (evaluated, saved)
    assert loop.step == 12 and loop.metrics == {"eval/loss": 12.0} and loop.objective("eval/loss") == 12.0


def test_the_running_loss_is_the_mean_over_the_micro_batches_since_the_last_log(tmp_path):
    _, _, loop = run_loop(tmp_path, batches=6, steps=3, accumulation=2, log_every_n_steps=3)
    # Steps 0, 1, 2 each took two micro-batches of loss 0 + the step count before them.
    assert loop.metrics["train/loss"] == pytest.approx((0 + 0 + 1 + 1 + 2 + 2) / 6)
    assert loop.objective("eval/accuracy") is None


class FakeAccelerator:
    def __init__(self, main_process):
        self.is_main_process = main_process


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(monkeypatch, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="runner"):
        plain = ProgressReporter(FakeAccelerator(True), total=10, initial=0)
        assert plain.bar is None  # pytest's stderr is not a terminal
        plain.report(5, {"train/loss": 0.25})
        ProgressReporter(FakeAccelerator(False), total=10, initial=0).report(5, {"train/loss": 9.0})
    assert [r.getMessage() for r in caplog.records] == ["step 5/10 | train/loss 0.25"]

    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    bar = ProgressReporter(FakeAccelerator(True), total=10, initial=3)
    assert bar.bar is not None and bar.bar.n == 3
    bar.advance()
    bar.report(4, {"eval/accuracy": 0.5})
    assert bar.bar.n == 4
    bar.close()
    assert ProgressReporter(FakeAccelerator(True), total=10, initial=0, enabled=False).bar is None
    assert ProgressReporter(FakeAccelerator(False), total=10, initial=0).bar is None
