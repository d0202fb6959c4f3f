"""save_state/load_state of a ~100M-parameter model vs safetensors' save_file/load_file, and the floor.

    python bench/checkpoint.py            # ~100M parameters (400 MB in fp32), 5 rounds
    python bench/checkpoint.py --quick    # ~4M parameters, 2 rounds (what CI runs)

Each round runs the three contenders back to back in the same process (A B C A B C ...), so
machine noise hits all of them alike; the report gives medians and ratios to safetensors.
- save_state/load_state: the engine, as a training script calls it (model only, so that the same
  tensors are written), including the manifest with every file's sha256 and its verification on load.
- safetensors: save_file(model.state_dict()) / load_file() + load_state_dict(), the same tensors;
  save_file_fsync: the same file made durable as save_state makes its files (fsync, rename, fsync the folder).
- memory copy: cloning the tensors in memory, the floor no file format can beat.
- sha256: reading the weights file back and hashing it as the manifest does (32 MiB slices in
  parallel threads), the price of the manifest's checksums.
- save_state_async: save_state(async_commit=True), timed until it returns (the training loop's wait);
  rank 0 then hashes and commits in the background, awaited untimed before the next contender.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import Report, arguments
from safetensors.torch import load_file, save_file
from torch import nn

from runner.engine import Accelerator
from runner.engine.manifest import chunk_digests
from runner.files import write_atomically


def build_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def contenders(accelerator, model, state_dir: Path, file: Path, copies: dict) -> dict:
    """One round's operations, in the order they run (each load reads what its save wrote)."""
    return {
        "save_state": lambda: accelerator.save_state(state_dir),
        # The time the training loop is blocked; the commit finishes (untimed) before the next contender.
        "save_state_async": lambda: accelerator.save_state(
            state_dir.with_name(state_dir.name + "_async"), async_commit=True
        ),
        "save_file": lambda: save_file(model.state_dict(), str(file)),
        # What surviving a power loss takes (save_state does it): the same file fsynced, renamed, its folder fsynced.
        "save_file_fsync": lambda: write_atomically(file, lambda partial: save_file(model.state_dict(), str(partial))),
        "copy_save": lambda: copies.update({k: v.clone() for k, v in model.state_dict().items()}),
        "sha256": lambda: chunk_digests([state_dir / "model.safetensors"]),
        "load_state": lambda: accelerator.load_state(state_dir),
        "load_unverified": lambda: accelerator.load_state(state_dir, verify_checksums=False),
        "load_file": lambda: model.load_state_dict(load_file(str(file))),
        "copy_load": lambda: model.load_state_dict(copies),
    }


def run(width: int, depth: int, rounds: int) -> dict:
    model = build_model(width, depth)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    params = sum(p.numel() for p in model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    times: dict[str, list[float]] = {name: [] for name in contenders(None, None, Path(), Path(), {})}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for r in range(rounds):
            state_dir, file, copies = tmp / f"state_{r}", tmp / f"weights_{r}.safetensors", {}
            for name, contender in contenders(accelerator, model, state_dir, file, copies).items():
                os.sync()  # every write starts from the same clean page cache, not another's writeback
                times[name].append(timed(contender))
                accelerator.wait_for_checkpoint()
            shutil.rmtree(state_dir)
            shutil.rmtree(state_dir.with_name(state_dir.name + "_async"))
            file.unlink()
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "parameters": params,
        "megabytes": nbytes / 1e6,
        "rounds": rounds,
        "median_seconds": medians,
        "MB_per_s": {k: nbytes / 1e6 / v for k, v in medians.items()},
        "save_ratio_vs_safetensors": medians["save_state"] / medians["save_file"],
        "save_ratio_vs_durable_safetensors": medians["save_state"] / medians["save_file_fsync"],
        "async_save_ratio_vs_safetensors": medians["save_state_async"] / medians["save_file"],
        "load_ratio_vs_safetensors": medians["load_state"] / medians["load_file"],
        "load_unverified_ratio_vs_safetensors": medians["load_unverified"] / medians["load_file"],
        "save_without_hash_ratio_vs_safetensors": (medians["save_state"] - medians["sha256"]) / medians["save_file"],
        "save_ratio_vs_copy": medians["save_state"] / medians["copy_save"],
        "load_ratio_vs_copy": medians["load_state"] / medians["copy_load"],
    }


def main() -> None:
    args = arguments(__doc__)
    result = run(width=512, depth=16, rounds=2) if args.quick else run(width=2048, depth=24, rounds=5)
    size = f"{result['parameters'] / 1e6:.1f}M parameters, {result['megabytes']:.0f} MB"
    report = Report(f"Checkpoints: {size}, {result['rounds']} rounds")
    report.values.update(parameters=result["parameters"], megabytes=result["megabytes"])
    for key, seconds in result["median_seconds"].items():
        report.value(f"{key} (ms)", seconds, f"ms  {result['MB_per_s'][key]:9.0f} MB/s", scale=1e3)
    report.ratio("save_state / save_file", result["save_ratio_vs_safetensors"], "<= 1.15x")
    report.ratio("save_state / (save_file + fsync)", result["save_ratio_vs_durable_safetensors"])
    report.ratio("save_state(async_commit=True) / save_file", result["async_save_ratio_vs_safetensors"])
    report.ratio("load_state / load_file", result["load_ratio_vs_safetensors"], "<= 1.15x")
    report.ratio(
        "load_state(verify_checksums=False) / load_file", result["load_unverified_ratio_vs_safetensors"], "<= 1.15x"
    )
    report.ratio("(save_state - sha256) / save_file", result["save_without_hash_ratio_vs_safetensors"])
    report.ratio("sha256 / save_file", result["median_seconds"]["sha256"] / result["median_seconds"]["save_file"])
    report.ratio("save_state / memory copy", result["save_ratio_vs_copy"])
    report.ratio("load_state / memory copy", result["load_ratio_vs_copy"])
    report.finish(args.json)


if __name__ == "__main__":
    main()
