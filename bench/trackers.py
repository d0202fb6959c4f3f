"""Trackers: a step's time when every step logs to a tracker, against the same loop logging to none.

    python bench/trackers.py           # 15 rounds of 2048 steps per contender (tiny loop); 14 of 64 (CNN)
    python bench/trackers.py --quick   # the CNN only, 8 steps, 2 rounds (what CI runs)
    python bench/trackers.py --only tiny   # one workload alone (tiny or cnn)

Each step logs what the runner logs (train/loss, read with .item() as the runner does for its log
line, train/lr, train/samples_per_second) with ``accelerator.log``, through the engine. Two loops:
- tiny: bench/overhead.py's (nn.Linear(8, 1), batch 4, SGD, one thread): a step that is all Python
  (0.1-0.4 ms, by machine), so it shows what logging costs the loop per step in microseconds.
- cnn: the runner's MNIST CNN at 16 channels, hidden 64, batch 32, AdamW, one thread: a small real
  step (10-25 ms).
Contenders: none (``log_with=None``, the same log calls), twice (the second shows the noise);
tensorboard; csv; mlflow (its SQLite store in a temporary folder); wandb (offline); all four at once,
each in the trackers' helper process (``tracker_process=True``, the runner's default); and all four on
a thread of the training process (``tracker_process=False``, the engine's default, as Accelerate).
Each contender's trackers start once, outside the timing. A round times the steps (the loop: the
target's, <= 1.02x none), then the wait until the trackers have taken everything logged (``get_tracker``
flushes): a tracker slower than the loop has a backlog, which is reported as the drain and as the steps
a second the tracker takes, and is left to slow no other contender. ``end_training`` (the trackers'
finish) is timed apart, once. A ratio to none is the median of the rounds' ratios, each contender's round
against none's round of the same turn, so that the machine's drift over the run cancels; the quartiles of
those ratios are printed beside it. Apart from the wall clock, the work logging adds to the training process
is counted from CPU clocks: ``log()``'s own time per call, and the CPU time of handing the records to the
helper (its sender thread's, and the training thread's at the drains beyond an empty request's).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import tempfile
import threading
import time
import timeit
from pathlib import Path

import torch
from common import Report, arguments, interleave_rounds, paired_ratio
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator
from runner.models import MnistCNN

torch.set_num_threads(1)


class Loop:
    """One contender: an Accelerator with ``trackers``, started once; each call runs ``steps`` logged steps."""

    def __init__(self, workload: str, trackers: list[str] | None, folder: Path, steps: int, process: bool) -> None:
        torch.manual_seed(0)
        threads = set(threading.enumerate())
        self.accelerator = Accelerator(cpu=True, project_dir=folder, log_with=trackers, tracker_process=process)
        self.trackers = trackers or []
        self.accelerator.init_trackers("", config={"optimizer": {"lr": 0.01}, "data": {"batch_size": 4}})
        senders = [t for t in set(threading.enumerate()) - threads if t.name == "runner-trackers-sender"]
        self.sender = time.pthread_getcpuclockid(senders[0].ident) if senders else None  # the helper's, if any
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
        self.drains: list[float] = []  # seconds per step spent waiting for the trackers after each round's loop
        self.handing = 0.0  # CPU seconds this process spent handing records over: the sender's, and at the drains

    def __call__(self) -> float:
        """Seconds per step of the loop; the drain after it goes to ``drains``."""
        accelerator, model, optimizer = self.accelerator, self.model, self.optimizer
        sending = time.clock_gettime(self.sender) if self.sender is not None else 0.0
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
        looped, working = time.perf_counter(), time.thread_time()
        for name in self.trackers:  # wait until each has taken every step
            accelerator.get_tracker(name)
        self.drains.append((time.perf_counter() - looped) / len(self.loader))
        if self.sender is not None:  # the sender thread's work, and what this thread sent itself at the drain
            self.handing += time.clock_gettime(self.sender) - sending + time.thread_time() - working
        return (looped - start) / len(self.loader)

    def handing_cost(self) -> float:
        """CPU seconds per step this process spent handing the logged records to the helper: the sender thread's,
        and this thread's at the drains less what the drains' requests cost with nothing to send."""
        empty = []
        for _ in range(50):
            working = time.thread_time()
            self.accelerator.get_tracker(self.trackers[0])
            empty.append(time.thread_time() - working)
        rounds = len(self.drains)  # each drain asked every tracker once
        return (self.handing - rounds * len(self.trackers) * statistics.median(empty)) / (rounds * len(self.loader))

    def log_cost(self, calls: int) -> float:
        """Seconds one ``accelerator.log`` call of the loop's takes (best of 5 x ``calls``), the trackers' backlog
        then taken."""
        accelerator, values = self.accelerator, {"train/loss": 0.5, "train/lr": 0.01, "train/samples_per_second": 4}

        def log() -> None:
            self.step += 1
            accelerator.log(values, step=self.step)

        best = min(timeit.repeat(log, number=calls, repeat=5)) / calls
        for name in self.trackers:
            accelerator.get_tracker(name)
        return best

    def close(self) -> float:
        """Seconds end_training takes: each tracker's finish (nothing is queued any more)."""
        start = time.perf_counter()
        self.accelerator.end_training()
        return time.perf_counter() - start


def main() -> None:
    args = arguments(__doc__, workloads=("tiny", "cnn"))
    rounds = {"cnn": 2} if args.quick else {"tiny": 15, "cnn": 14}
    steps = {"cnn": 8} if args.quick else {"tiny": 2048, "cnn": 64}
    if args.only and args.only not in steps:
        raise SystemExit(f"--quick runs the cnn workload alone; leave out --only {args.only}.")
    if args.only:
        steps = {args.only: steps[args.only]}
    chosen = {"none": None, "none (again)": None, "tensorboard": ["tensorboard"], "csv": ["csv"]}
    if importlib.util.find_spec("mlflow") is not None:
        chosen["mlflow"] = ["mlflow"]
    if importlib.util.find_spec("wandb") is not None:
        chosen["wandb"] = ["wandb"]
    chosen["all"] = [name for name, trackers in chosen.items() if trackers]
    chosen["all (thread)"] = chosen["all"]
    shape = ", ".join(f"{workload} {rounds[workload]} rounds of {count} steps" for workload, count in steps.items())
    report = Report(f"Trackers: every step logs 3 scalars; {shape}")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tmp}/mlflow.db")
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", tmp)
        os.environ.setdefault("WANDB_SILENT", "true")
        for workload, count in steps.items():
            loops = {
                name: Loop(workload, trackers, Path(tmp) / workload / name, count, process="thread" not in name)
                for name, trackers in chosen.items()
            }
            samples = interleave_rounds(loops, rounds[workload])
            medians = {name: statistics.median(values) for name, values in samples.items()}
            drains = {name: statistics.median(loop.drains[1:]) for name, loop in loops.items()}  # as interleave
            handing = {name: loop.handing_cost() for name, loop in loops.items() if loop.sender is not None}
            logging = {name: loop.log_cost(50 if args.quick else 500) for name, loop in loops.items()}
            closing = {name: loop.close() for name, loop in loops.items()}
            for name, seconds in medians.items():
                report.value(f"{workload}: {name} us/step", seconds, "us", scale=1e6)
            for name in medians:
                if chosen[name]:
                    report.value(f"{workload}: {name} drain us/step", drains[name], "us", scale=1e6)
            for name, seconds in logging.items():
                report.value(f"{workload}: {name} log() us/call", seconds, "us", scale=1e6)
            for name, seconds in handing.items():
                report.value(f"{workload}: {name} handing over, CPU us/step", seconds, "us", scale=1e6)
            for name, seconds in closing.items():
                report.value(f"{workload}: {name} end_training", seconds, "ms", scale=1e3)
            spreads = []
            for name in medians:
                if name != "none":
                    target = None if "thread" in name or "again" in name else "<= 1.02x"
                    ratio, low, high = paired_ratio(samples[name], samples["none"])
                    report.ratio(f"{workload}: {name} / none", ratio, target)
                    spreads.append(f"{name} {low:.3f}-{high:.3f}")
            report.note(f"{workload}: quartiles of the rounds' ratios to none: {', '.join(spreads)}")
            added = ", ".join(f"{name} {(seconds - medians['none']) * 1e6:+.1f}" for name, seconds in medians.items())
            report.note(f"{workload}: us the loop pays per logged step against none: {added}")
            own = ", ".join(
                f"{name} {(logging[name] - logging['none']) * 1e6:.2f} + {seconds * 1e6:.2f} = "
                f"{100 * (logging[name] - logging['none'] + seconds) / medians['none']:.2f}%"
                for name, seconds in handing.items()
            )  # fmt: skip
            report.note(
                f"{workload}: this process's own work per logged step, us: log() beyond none's + handing over "
                f"(the sender thread's CPU, and this thread's at the drain) = share of none's step: {own}"
            )
            taken = ", ".join(
                f"{name} {1 / (medians[name] + drains[name]):.0f}" for name in medians if chosen[name]
            )  # fmt: skip
            report.note(f"{workload}: steps a second the trackers took (the loop's rate, or their own): {taken}")
    missing = [name for name in ("mlflow", "wandb") if name not in chosen]
    if missing:
        report.note(f"Not installed, so not measured: {', '.join(missing)}.")
    report.finish(args.json)


if __name__ == "__main__":
    main()
