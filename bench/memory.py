"""Peak resident memory of a training process: the engine's loop vs the same raw PyTorch loop.

    python bench/memory.py           # the MNIST CNN, 60 steps per process, 5 processes per contender
    python bench/memory.py --quick   # a narrow CNN, 5 steps, 1 process each (what CI runs)

Peak RSS belongs to a whole process, so each run is a fresh interpreter (started in turn: raw,
engine, raw, engine, ...) that imports what its loop needs, trains, evaluates once, saves a
checkpoint-sized copy of its weights, and reports its ru_maxrss. Target <= 1.05x.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, Report, interleave


def child(kind: str, data: str, channels: int, steps: int, out: str) -> None:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from runner.data.mnist import MNIST
    from runner.models.cnn import MnistCNN

    torch.manual_seed(0)
    train_set, eval_set = MNIST(data, "test[:8000]"), MNIST(data, "test[8000:]")
    model = MnistCNN(channels=channels, hidden=4 * channels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train = DataLoader(train_set, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    evaluation = DataLoader(eval_set, batch_size=256)
    if kind == "engine":
        from runner.engine import Accelerator

        accelerator = Accelerator(cpu=True)
        model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
        backward = accelerator.backward
    else:
        backward = torch.Tensor.backward
    batches = iter(train)
    for _ in range(steps):
        images, labels = next(batches)
        backward(nn.functional.cross_entropy(model(images), labels))
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        hits = sum((model(images).argmax(-1) == labels).sum().item() for images, labels in evaluation)
    if kind == "engine":
        accelerator.save_state(str(Path(out) / "state"))
    else:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, Path(out) / "state.pt")
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, hits)


def peak_bytes(kind: str, data: str, channels: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run(
            [sys.executable, __file__, "--child", kind, "--data", data, "--channels", str(channels),
             "--steps", str(steps), "--out", out],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
        )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"the {kind} process failed:\n{result.stderr[-3000:]}")
    return float(result.stdout.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a narrow CNN and a few steps (CI)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "mnist"), help="MNIST IDX folder")
    parser.add_argument("--child", choices=["raw", "engine"], help=argparse.SUPPRESS)
    parser.add_argument("--channels", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=60, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.data, args.channels, args.steps, args.out)
        return
    channels, steps, rounds = (8, 5, 1) if args.quick else (32, 60, 5)
    medians = interleave(
        {kind: lambda kind=kind: peak_bytes(kind, args.data, channels, steps) for kind in ("raw", "engine")},
        rounds,
        warmup=0,
    )
    report = Report(f"Peak RSS, MNIST CNN (channels={channels}), {steps} steps, {rounds} processes each")
    for kind, peak in medians.items():
        report.value(f"{kind} peak RSS", peak / 2**20, "MiB")
    report.ratio("engine / raw", medians["engine"] / medians["raw"], "<= 1.05x")
    report.finish(args.json)


if __name__ == "__main__":
    main()
