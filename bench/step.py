"""A realistic step: the MNIST CNN on CPU, samples/s through the engine vs a raw PyTorch loop.

    python bench/step.py           # 1 process, then DDP on 2 processes; 24 steps per round, 5 rounds
    python bench/step.py --quick   # a narrow CNN, 3 steps per round, 2 rounds (what CI runs)

- 1 process: the runner's CNN (recipes' defaults: batch 64, AdamW) on the MNIST test split, raw loop
  vs the same loop through Accelerator.prepare/backward. Target >= 0.98x the raw loop's samples/s.
- DDP, 2 processes (1 thread each): raw DistributedDataParallel with a DistributedSampler vs the
  engine; both run in the same process group, interleaved. Target >= 0.97x.

MNIST is read from --data (default ../shared/data/mnist beside the checkout).
"""

from __future__ import annotations

import os
import time

import torch
from common import Report, arguments, interleave
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from runner.data.mnist import MNIST
from runner.engine import Accelerator
from runner.engine.launchers import debug_launcher
from runner.models.cnn import MnistCNN

BATCH = 64


def build(channels: int, hidden: int):
    torch.manual_seed(0)
    model = MnistCNN(channels=channels, hidden=hidden)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_steps(model, optimizer, loader, steps: int, backward, barrier=lambda: None) -> float:
    """Seconds per sample over ``steps`` steps (after one untimed warm-up step)."""
    model.train()
    batches = iter(loader)
    timed = 0
    for step in range(steps + 1):
        if step == 1:
            barrier()
            start = time.perf_counter()
        images, labels = next(batches)
        loss = nn.functional.cross_entropy(model(images), labels)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        timed += len(labels) * (step > 0)
    barrier()
    return (time.perf_counter() - start) / timed


def raw_single(dataset, channels, hidden, steps) -> float:
    model, optimizer = build(channels, hidden)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    return train_steps(model, optimizer, loader, steps, lambda loss: loss.backward())


def engine_single(dataset, channels, hidden, steps) -> float:
    accelerator = Accelerator(cpu=True)
    model, optimizer = build(channels, hidden)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return train_steps(model, optimizer, loader, steps, accelerator.backward)


def ddp_worker(data: str, channels: int, hidden: int, steps: int, rounds: int) -> dict[str, float]:
    import torch.distributed as dist

    accelerator = Accelerator(cpu=True)  # joins the group; the raw contender uses the same group
    dataset = MNIST(data, "test")
    barrier = dist.barrier

    def raw() -> float:
        model, optimizer = build(channels, hidden)
        ddp = nn.parallel.DistributedDataParallel(model)
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
        return train_steps(ddp, optimizer, loader, steps, lambda loss: loss.backward(), barrier)

    def engine() -> float:
        model, optimizer = build(channels, hidden)
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        seconds = train_steps(model, optimizer, loader, steps, accelerator.backward, barrier)
        accelerator.free_memory()
        return seconds

    return interleave({"raw DDP": raw, "engine DDP": engine}, rounds)


def main() -> None:
    args = arguments(__doc__, data=True)
    channels, hidden, steps, rounds = (8, 32, 3, 2) if args.quick else (32, 128, 24, 5)

    dataset = MNIST(args.data, "test")
    single = interleave(
        {
            "raw": lambda: raw_single(dataset, channels, hidden, steps),
            "engine": lambda: engine_single(dataset, channels, hidden, steps),
        },
        rounds,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two workers on the cores, as torchrun would set
    ddp = debug_launcher(ddp_worker, (args.data, channels, hidden, steps, rounds), start_method="spawn")[0]

    report = Report(f"MNIST CNN (channels={channels}, hidden={hidden}), batch {BATCH}, {steps} steps x {rounds} rounds")
    for name, seconds in {**single, **ddp}.items():
        report.value(f"{name} samples/s", 1 / seconds, "samples/s")
    report.ratio("engine / raw (1 process)", single["raw"] / single["engine"], ">= 0.98x")
    report.ratio("engine / raw DDP (2 processes)", ddp["raw DDP"] / ddp["engine DDP"], ">= 0.97x")
    report.finish(args.json)


if __name__ == "__main__":
    main()
