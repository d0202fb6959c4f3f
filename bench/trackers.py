"""Trackers: a step's time when every step logs to a tracker, against the same loop logging to none.

    python bench/trackers.py           # 7 rounds (tiny loop: 4096 steps per contender per round; CNN: 128)
    python bench/trackers.py --quick   # the CNN only, 8 steps, 2 rounds (what CI runs)

Each step logs what the runner logs (train/loss, read with .item() as the runner does for its log
line, train/lr, train/samples_per_second) with ``accelerator.log``, through the engine. Two loops:
- tiny: bench/overhead.py's (nn.Linear(8, 1), batch 4, SGD, one thread): a step of ~0.2 ms that is all
  Python, so it shows each tracker's own cost per logged step in microseconds.
- cnn: the runner's MNIST CNN at 16 channels, hidden 64, batch 32, AdamW, one thread: a small real
  step (a few ms), the one the target is for.
Contenders, all in this process: none (``log_with=None``, the same log calls); tensorboard; csv; mlflow
(its SQLite store in a temporary folder); wandb (offline); and all four at once. Each contender's
trackers start once, outside the timing; a round is its steps plus the wait until the trackers have
taken everything logged (``get_tracker`` flushes), so a tracker that falls behind is charged for it, and
no contender's backlog is left to slow the next one. ``end_training`` (the trackers' finish) is timed
apart, once.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time
from pathlib import Path

import torch
from common import Report, arguments, interleave
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator
from runner.models import MnistCNN

torch.set_num_threads(1)


class Loop:
    """One contender: an Accelerator with ``trackers``, started once; each call runs ``steps`` logged steps."""

    def __init__(self, workload: str, trackers: list[str] | None, folder: Path, steps: int) -> None:
        torch.manual_seed(0)
        self.accelerator = Accelerator(cpu=True, project_dir=folder, log_with=trackers)
        self.trackers = trackers or []
        self.accelerator.init_trackers("", config={"optimizer": {"lr": 0.01}, "data": {"batch_size": 4}})
        if workload == "tiny":
            model, batch = nn.Linear(8, 1), 4
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            data = TensorDataset(torch.randn(steps * batch, 8), torch.randn(steps * batch, 1))
            self.loss = nn.functional.mse_loss
        else:
            model, batch = MnistCNN(channels=16, hidden=64), 32
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            data = TensorDataset(torch.randn(steps * batch, 1, 28, 28), torch.randint(0, 10, (steps * batch,)))
            self.loss = nn.functional.cross_entropy
        loader = DataLoader(data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
        self.model, self.optimizer, self.loader = self.accelerator.prepare(model, optimizer, loader)
        self.batch, self.step = batch, 0

    def __call__(self) -> float:
        accelerator, model, optimizer = self.accelerator, self.model, self.optimizer
        start = time.perf_counter()
        for x, y in self.loader:
            loss = self.loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            self.step += 1
            accelerator.log(
                {"train/loss": loss.item(), "train/lr": 0.01, "train/samples_per_second": self.batch * self.step},
                step=self.step,
            )
        for name in self.trackers:  # wait until each has taken every step
            accelerator.get_tracker(name)
        return (time.perf_counter() - start) / len(self.loader)

    def close(self) -> float:
        """Seconds end_training takes: each tracker's finish (nothing is queued any more)."""
        start = time.perf_counter()
        self.accelerator.end_training()
        return time.perf_counter() - start


def main() -> None:
    args = arguments(__doc__)
    rounds = 2 if args.quick else 7
    steps = {"cnn": 8} if args.quick else {"tiny": 4096, "cnn": 128}
    chosen = {"none": None, "tensorboard": ["tensorboard"], "csv": ["csv"]}
    if importlib.util.find_spec("mlflow") is not None:
        chosen["mlflow"] = ["mlflow"]
    if importlib.util.find_spec("wandb") is not None:
        chosen["wandb"] = ["wandb"]
    chosen["all"] = [name for name, trackers in chosen.items() if trackers]
    report = Report(f"Trackers: every step logs 3 scalars; {rounds} rounds")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", tmp)
        os.environ.setdefault("WANDB_SILENT", "true")
        for workload, count in steps.items():
            loops = {
                name: Loop(workload, trackers, Path(tmp) / workload / name, count) for name, trackers in chosen.items()
            }
            medians = interleave(loops, rounds)
            closing = {name: loop.close() for name, loop in loops.items()}
            for name, seconds in medians.items():
                report.value(f"{workload}: {name} us/step", seconds, "us", scale=1e6)
            for name, seconds in closing.items():
                report.value(f"{workload}: {name} end_training", seconds, "ms", scale=1e3)
            for name in medians:
                if name != "none":
                    target = "<= 1.02x" if workload == "cnn" and name != "all" else None
                    report.ratio(f"{workload}: {name} / none", medians[name] / medians["none"], target)
            added = ", ".join(f"{name} {(seconds - medians['none']) * 1e6:+.0f}" for name, seconds in medians.items())
            report.note(f"{workload}: us added per step against none: {added}")
    missing = [name for name in ("mlflow", "wandb") if name not in chosen]
    if missing:
        report.note(f"Not installed, so not measured: {', '.join(missing)}.")
    report.finish(args.json)


if __name__ == "__main__":
    main()
