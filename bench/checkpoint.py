"""save_state/load_state of a ~100M-parameter model and its AdamW moments, each against what it must beat.

    python bench/checkpoint.py            # 24 x Linear(2048, 2048): 100.7M parameters, 1.2 GB with the moments
    python bench/checkpoint.py --quick    # 16 x Linear(512, 512): 50 MB, 2 rounds, 1 of the resumes (CI)

The model is trained one step with AdamW, so the optimizer holds exp_avg and exp_avg_sq. Each round
runs every in-process contender once, back to back, with ``os.sync()`` (untimed) before each, so
one's writeback never lands on the next; within each group below the order is reversed every other
round (A B C, C B A, ...), so no contender always follows the same one (on this VM the first touch
of fresh memory is slow, and who freed memory last decides who gets it back). The report gives
medians, and ratios as the headline (absolute times on these VMs wander by 2x).

1. Sync save: ``save_state(dir)`` (it fsyncs every file itself) against safetensors' ``save_file``
   of the same tensors (the state dict, and the moments in a second file) followed by ``os.sync()``,
   the cheapest way to the same durability. The ``os.sync()`` after ``save_state`` is timed apart.
   The pair is timed again at the end of the round, once the disk has written the round's three
   other checkpoints (3.6 GB at full size): saves that follow others, as in a run that saves often.
2. Verified load: ``load_state(dir)`` (every slice hashed and checked first) against ``load_file``
   of those two files + ``load_state_dict`` + ``copy_`` into the optimizer's moments; also without
   verification, and the hashing alone (``manifest.hash_slices`` of every listed slice) with
   xxh3_128 and sha256. Within ``load_state``, the time in ``verify_together`` and in ``torch.load``
   (the engine's read of its optimizer and RNG files) is timed by wrapping them.
3. Resume on 2 processes: the checkpoint above loaded by 2 gloo CPU processes, against 1 process
   started the same way (``debug_launcher``, OMP_NUM_THREADS=1); inside the workers, after a barrier,
   ``load_state`` is timed as in row 2 (the slowest rank's), then the baseline load of row 2 into the
   same live tensors, then ``load_state`` again: the first allocates the optimizer's moments (the
   fresh process holds none), the second copies into them, as the baseline does. Each worker counts
   the bytes it hashes (wrapping ``manifest.slice_digest``): together the ranks must hash every
   listed byte exactly once, which is asserted.
4. Async save: how long ``save_state(dir, async_save=True)`` blocks, against cloning the same tensors
   in memory and against merely zeroing as many fresh bytes; ``wait_for_checkpoint()`` (the
   background write, hash, fsync and commit) is timed apart. The first round's save (which allocates
   the host copies) is reported apart from the later ones (which copy into them).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from unittest.mock import patch

import torch
from common import Report, arguments
from safetensors.torch import load_file, save_file
from torch import nn

from runner.engine import Accelerator
from runner.engine.checkpoint import loading
from runner.engine.checkpoint import manifest as manifests
from runner.engine.checkpoint.manifest_schema import CHECKSUMS
from runner.engine.constants import MANIFEST_NAME
from runner.engine.environment import patch_environment
from runner.engine.launchers import debug_launcher

MOMENTS = ("exp_avg", "exp_avg_sq")
BASELINE_FILES = ("model.safetensors", "moments.safetensors")
UNVERIFIED = "load_state(verify_checksums=False)"
LOAD_PARTS = ("verify_together", "torch.load")  # what timed_load_state times inside load_state
AGAIN = "after other saves"
Measure = Callable[[], dict[str, float]]  # a contender: what it measured, by name


def build(width: int, depth: int, *, train: bool) -> tuple[nn.Module, torch.optim.AdamW]:
    """The model and its AdamW; ``train``: one step taken, so the optimizer holds its moments."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if train:
        model(torch.randn(8, width)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def moments(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's moment tensors by name (looked up afresh: ``load_state`` replaces them)."""
    return {
        f"{moment}.{i}": optimizer.state[parameter][moment]
        for i, parameter in enumerate(optimizer.param_groups[0]["params"])
        for moment in MOMENTS
    }


def seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    del result  # freeing what fn returned (copies, say) is not part of it
    return elapsed


def save_baseline(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    folder.mkdir()
    save_file(model.state_dict(), str(folder / BASELINE_FILES[0]))
    save_file(moments(optimizer), str(folder / BASELINE_FILES[1]))
    os.sync()


def load_baseline(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    model.load_state_dict(load_file(str(folder / BASELINE_FILES[0])))
    live = moments(optimizer)
    for key, value in load_file(str(folder / BASELINE_FILES[1])).items():
        live[key].copy_(value)


def timed_load_state(accelerator: Accelerator, checkpoint: Path) -> dict[str, float]:
    """``load_state``'s time, and within it: ``verify_together``'s, ``torch.load``'s (the engine reads its
    optimizer and RNG files with it), and the slices this process hashed with their bytes."""
    spent, lock = {"slices": 0, "bytes": 0, "verify_together": 0.0, "torch.load": 0.0}, threading.Lock()

    def timing(fn: Callable, key: str) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spent[key] += time.perf_counter() - start

        return timed

    def counting(path, offset, length, checksum):
        with lock:  # hash_slices calls it from several threads
            spent["slices"] += 1
            spent["bytes"] += length
        return slice_digest(path, offset, length, checksum)

    slice_digest = manifests.slice_digest
    with (
        patch.object(manifests, "slice_digest", counting),
        patch.object(loading, "verify_together", timing(loading.verify_together, "verify_together")),
        patch.object(torch, "load", timing(torch.load, "torch.load")),
    ):
        spent["load_state"] = seconds(partial(accelerator.load_state, checkpoint))
    return spent


def hash_checkpoint(checkpoint: Path, checksum: str) -> None:
    manifest = json.loads((checkpoint / MANIFEST_NAME).read_text())
    manifests.hash_slices(checkpoint, manifests.manifest_slices(manifest), checksum)


def listed_bytes(checkpoint: Path) -> int:
    return sum(entry["bytes"] for entry in json.loads((checkpoint / MANIFEST_NAME).read_text())["files"].values())


FIRST_ASYNC = "first save_state(async_save=True) returns"
ASYNC = "later save_state(async_save=True) returns"


def contender_groups(accelerator, model, optimizer, folder: Path, first: bool) -> list[list[Measure]]:
    """One round's contenders, by group (each load reads what this round's saves wrote; ``first``: the first round,
    whose async save allocates the host copies the later ones copy into)."""
    state, baseline, background = folder / "state", folder / "safetensors", folder / "async"
    tensors = [*model.state_dict().values(), *moments(optimizer).values()]
    tensor_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def save_state() -> dict[str, float]:
        saved = seconds(lambda: accelerator.save_state(state))
        return {"save_state": saved, "os.sync() after save_state": seconds(os.sync)}

    def save_state_again() -> dict[str, float]:
        return {f"save_state, {AGAIN}": seconds(lambda: accelerator.save_state(folder / "state_again"))}

    def save_async() -> dict[str, float]:
        stall = seconds(lambda: accelerator.save_state(background, async_save=True))
        return {FIRST_ASYNC if first else ASYNC: stall, "wait_for_checkpoint()": seconds(
            accelerator.wait_for_checkpoint
        )}  # fmt: skip

    def clone() -> list[dict[str, torch.Tensor]]:
        return [
            {key: value.clone() for key, value in model.state_dict().items()},
            {key: value.clone() for key, value in moments(optimizer).items()},
        ]

    def parts(loaded: dict[str, float]) -> list[tuple[str, float]]:
        return [("", loaded["load_state"]), *((f", of which {key}", loaded[key]) for key in LOAD_PARTS)]

    def measure(name: str, fn: Callable[[], object]) -> Measure:
        return lambda: {name: seconds(fn)}

    return [
        [save_state, measure("save_file + os.sync()", lambda: save_baseline(model, optimizer, baseline))],
        [
            save_async,
            measure("clone of the same tensors", clone),
            measure("torch.zeros of as many bytes", lambda: torch.zeros(tensor_bytes // 4)),
        ],
        [
            lambda: {f"load_state{part}": value for part, value in parts(timed_load_state(accelerator, state))},
            measure(UNVERIFIED, partial(accelerator.load_state, state, verify_checksums=False)),
            measure("load_file + copy into model and moments", lambda: load_baseline(model, optimizer, baseline)),
        ],
        [
            measure(f"hash every slice, {checksum}", lambda checksum=checksum: hash_checkpoint(state, checksum))
            for checksum in CHECKSUMS
        ],
        [  # the disk has written 3 checkpoints this round: saves that come after others
            save_state_again,
            measure(f"save_file + os.sync(), {AGAIN}", lambda: save_baseline(model, optimizer, folder / "again")),
        ],
    ]


def in_process(width: int, depth: int, rounds: int, folder: Path) -> tuple[dict[str, float], dict]:
    """The medians of rows 1, 2 and 4, and facts of the model; the last round's files stay in ``folder``."""
    model, optimizer = build(width, depth, train=True)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    samples: dict[str, list[float]] = {}
    for round_ in range(rounds):
        here = folder / f"round_{round_}"
        here.mkdir()
        for group in contender_groups(accelerator, model, optimizer.optimizer, here, first=round_ == 0):
            for contender in group if round_ % 2 == 0 else reversed(group):
                os.sync()  # every contender starts with nothing dirty in the page cache
                for name, value in contender().items():
                    samples.setdefault(name, []).append(value)
        if round_ + 1 < rounds:
            shutil.rmtree(here)
    facts = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "checkpoint": here / "state",
        "baseline": here / "safetensors",
    }
    return {name: statistics.median(values) for name, values in samples.items()}, facts


def resume_worker(checkpoint: str, baseline: str, width: int, depth: int) -> dict[str, float]:
    """On each launched process: build and prepare the model and optimizer, time ``load_state`` (and what it
    spends hashing and in ``torch.load``), then the baseline load into the same live tensors."""
    model, optimizer = build(width, depth, train=False)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.wait_for_everyone()  # every rank starts at once, as they would on a resume
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a 1-process checkpoint on 2 processes warns that RNG streams are re-derived
        loaded = timed_load_state(accelerator, Path(checkpoint))
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    files = seconds(lambda: load_baseline(unwrapped, optimizer.optimizer, Path(baseline)))
    accelerator.wait_for_everyone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = timed_load_state(accelerator, Path(checkpoint))["load_state"]  # into the tensors the first left
    return {"rank": accelerator.process_index, "load_file": files, **loaded, "again": again}


def resumes(facts: dict, width: int, depth: int, rounds: int) -> dict[int, list[list[dict]]]:
    """Every round's per-rank results of the resume on 1 process, then on 2 (interleaved)."""
    results: dict[int, list[list[dict]]] = {1: [], 2: []}
    arguments_ = (str(facts["checkpoint"]), str(facts["baseline"]), width, depth)
    # One thread per worker, as tests/distributed does: two workers on two cores do not oversubscribe.
    with patch_environment(omp_num_threads=1):
        for _ in range(rounds):
            for processes, runs in results.items():
                os.sync()
                runs.append(debug_launcher(resume_worker, arguments_, num_processes=processes, start_method="spawn"))
    return results


def check_hashed_once(results: dict[int, list[list[dict]]], listed: int) -> None:
    """Every resume hashed each listed byte exactly once in total (the test of verify_together's split)."""
    for processes, runs in results.items():
        for workers in runs:
            hashed = sum(worker["bytes"] for worker in workers)
            assert hashed == listed, f"{processes} process(es) hashed {hashed} bytes, not the {listed} listed"


class Rows:
    """The report's lines for the in-process medians: a time with its throughput, or a ratio of two."""

    def __init__(self, report: Report, medians: dict[str, float], megabytes: float) -> None:
        self.report, self.medians, self.megabytes = report, medians, megabytes

    def time(self, name: str, *, rate: bool = True) -> None:
        unit = f"ms  {self.megabytes / self.medians[name]:8.0f} MB/s" if rate else "ms"
        self.report.value(f"{name} (ms)", self.medians[name], unit, scale=1e3)

    def ratio(self, label: str, numerator: str | float, denominator: str, target: str | None = None) -> None:
        above = self.medians[numerator] if isinstance(numerator, str) else numerator
        self.report.ratio(label, above / self.medians[denominator], target)


def report_save(rows: Rows) -> None:
    rows.report.note("1. Sync save (durable on return: the engine fsyncs its files, the baseline calls os.sync())")
    rows.time("save_state")
    rows.time("os.sync() after save_state", rate=False)
    rows.time("save_file + os.sync()")
    rows.ratio("save_state / (save_file + os.sync())", "save_state", "save_file + os.sync()", "<= 1.3x")
    then_sync = rows.medians["save_state"] + rows.medians["os.sync() after save_state"]
    rows.ratio("(save_state + os.sync) / (save_file + os.sync)", then_sync, "save_file + os.sync()")
    rows.time(f"save_state, {AGAIN}")
    rows.time(f"save_file + os.sync(), {AGAIN}")
    rows.ratio(f"the same, {AGAIN}", f"save_state, {AGAIN}", f"save_file + os.sync(), {AGAIN}", "<= 1.3x")


def report_load(rows: Rows) -> None:
    baseline = "load_file + copy into model and moments"
    rows.report.note("2. Verified load (from the page cache)")
    rows.time("load_state")
    for part in LOAD_PARTS:
        rows.time(f"load_state, of which {part}", rate=False)
    for name in (UNVERIFIED, baseline):
        rows.time(name)
    for checksum in CHECKSUMS:
        rows.time(f"hash every slice, {checksum}")
    rows.ratio("load_state / (load_file + copy)", "load_state", baseline, "<= 1.5x")
    rows.ratio("load_state(unverified) / (load_file + copy)", UNVERIFIED, baseline)
    rows.ratio("sha256 / xxh3_128 (hashing time)", "hash every slice, sha256", "hash every slice, xxh3_128")


def report_resume(report: Report, resumed: dict[int, list[list[dict]]], megabytes: float) -> None:
    report.note("3. Resume: inside debug_launcher workers, the slowest rank, 1 vs 2 processes")
    labels = {"load_state": "load_state", **{part: f"  of which {part}" for part in LOAD_PARTS}}
    labels["load_file"] = "load_file + copy"
    labels["again"] = "load_state again"
    slowest = {
        (processes, key): statistics.median(max(worker[key] for worker in run) for run in runs)
        for processes, runs in resumed.items()
        for key in labels
    }
    for key, label in labels.items():
        for processes in resumed:
            on = "1 process" if processes == 1 else f"{processes} processes"
            report.value(f"{label}, {on} (ms)", slowest[processes, key], "ms", scale=1e3)
    last = resumed[2][-1]
    for worker in last:
        slices = f"MB  {worker['slices']} slices"
        report.value(f"hashed by rank {worker['rank']} of 2 (MB)", worker["bytes"] / 1e6, slices)
    report.value("hashed by the 2 ranks together (MB)", sum(worker["bytes"] for worker in last) / 1e6, "MB")
    report.value("listed in the manifest (MB)", megabytes, "MB")
    report.ratio("load_state, 2 processes / 1 process", slowest[2, "load_state"] / slowest[1, "load_state"], "<= 1.2x")
    report.ratio("load_file + copy, 2 processes / 1 process", slowest[2, "load_file"] / slowest[1, "load_file"])
    report.ratio("load_state again, 2 processes / 1 process", slowest[2, "again"] / slowest[1, "again"])


def report_async(rows: Rows) -> None:
    rows.report.note("4. Async save (the first allocates its host copies; the later ones copy into them)")
    names = (FIRST_ASYNC, ASYNC, "clone of the same tensors", "torch.zeros of as many bytes", "wait_for_checkpoint()")
    for name in names:
        if name in rows.medians:  # one round: no later save
            rows.time(name)
    stall = ASYNC if ASYNC in rows.medians else FIRST_ASYNC
    in_all = rows.medians[stall] + rows.medians["wait_for_checkpoint()"]
    rows.report.value("async save in all (returns + wait) (ms)", in_all, "ms", scale=1e3)
    rows.ratio("first save_state(async_save=True) returns / clone", FIRST_ASYNC, "clone of the same tensors")
    if ASYNC in rows.medians:
        rows.ratio("later save_state(async_save=True) returns / clone", ASYNC, "clone of the same tensors", "<= 1.3x")
    rows.ratio("async save in all / save_state", in_all, "save_state")


def main() -> None:
    args = arguments(__doc__)
    width, depth, rounds, resume_rounds = (512, 16, 2, 1) if args.quick else (2048, 24, 5, 3)
    with tempfile.TemporaryDirectory() as tmp:
        medians, facts = in_process(width, depth, rounds, Path(tmp))
        facts["checkpoint_bytes"] = listed_bytes(facts["checkpoint"])
        resumed = resumes(facts, width, depth, resume_rounds)
    check_hashed_once(resumed, facts["checkpoint_bytes"])
    report = Report(
        f"Checkpoints: {facts['parameters'] / 1e6:.1f}M parameters + AdamW moments, fp32, "
        f"{facts['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, {rounds} rounds ({resume_rounds} of the resumes), "
        f"{os.cpu_count()} cores"
    )
    report.values.update(parameters=facts["parameters"], megabytes=facts["checkpoint_bytes"] / 1e6)
    rows = Rows(report, medians, facts["checkpoint_bytes"] / 1e6)
    report_save(rows)
    report_load(rows)
    report_resume(report, resumed, rows.megabytes)
    report_async(rows)
    report.finish(args.json)


if __name__ == "__main__":
    main()
