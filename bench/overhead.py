"""Per-step overhead: a step whose compute is ~0, through the engine vs the same raw PyTorch loop.

    python bench/overhead.py           # 4096 steps per contender per round, 7 rounds
    python bench/overhead.py --quick   # 256 steps, 2 rounds (what CI runs)

nn.Linear(8, 1), batch 4, SGD and a StepLR, a shuffled DataLoader over an in-memory dataset; one
thread. Whatever the engine adds per step (the loader wrapper, backward, the optimizer and scheduler
wrappers, accumulate) is nearly all of the difference. Contenders:
- raw: the plain PyTorch loop.
- engine: the same loop after accelerator.prepare, with accelerator.backward.
- engine + accumulate: the same inside `with accelerator.accumulate(model)` (Accelerate's idiom).
- accelerate: HF Accelerate's engine on the accumulate loop, only when it happens to be installed.
"""

from __future__ import annotations

import importlib.util
import time

import torch
from common import Report, arguments, interleave
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator

torch.set_num_threads(1)


def build(n: int):
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1000)
    data = TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0))
    return model, optimizer, scheduler, loader


def raw(n: int) -> float:
    model, optimizer, scheduler, loader = build(n)
    start = time.perf_counter()
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / len(loader)


def engine(n: int, *, accumulate: bool, accelerator_class=Accelerator) -> float:
    accelerator = accelerator_class(cpu=True)
    model, optimizer, scheduler, loader = accelerator.prepare(*build(n))
    start = time.perf_counter()
    if accumulate:
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    else:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return (time.perf_counter() - start) / len(loader)


def main() -> None:
    args = arguments(__doc__)
    samples, rounds = (1024, 2) if args.quick else (16384, 7)
    contenders = {
        "raw": lambda: raw(samples),
        "engine": lambda: engine(samples, accumulate=False),
        "engine + accumulate": lambda: engine(samples, accumulate=True),
    }
    if importlib.util.find_spec("accelerate") is not None:
        from accelerate import Accelerator as HFAccelerator

        contenders["accelerate"] = lambda: engine(samples, accumulate=True, accelerator_class=HFAccelerator)
    medians = interleave(contenders, rounds)
    report = Report(f"Per-step overhead: {samples // 4} steps of Linear(8, 1), batch 4, {rounds} rounds")
    for name, seconds in medians.items():
        report.value(f"{name} us/step", seconds, "us", scale=1e6)
    report.ratio("engine / raw", medians["engine"] / medians["raw"], "<= 1.25x")
    report.ratio("engine + accumulate / raw", medians["engine + accumulate"] / medians["raw"], "<= 1.25x")
    if "accelerate" in medians:
        report.ratio("accelerate / raw", medians["accelerate"] / medians["raw"])
    else:
        report.note("HF Accelerate is not installed; its row is skipped.")
    report.finish(args.json)


if __name__ == "__main__":
    main()
