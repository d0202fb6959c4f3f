"""The prepared (sharded) loader vs a plain DataLoader over the same dataset: batches per second.

    python bench/dataloader.py           # MNIST test split, 3 epochs per contender per round, 7 rounds
    python bench/dataloader.py --quick   # 1 epoch over 2048 images, 2 rounds (what CI runs)

Batch 64, shuffled, in the main process and with 2 loader workers. The prepared loader adds the
seeded shuffle, the global-batch slicing, the epoch bookkeeping that makes resume exact, and the
end-of-epoch flag. Target >= 0.98x the plain loader's batches/s.

MNIST is read from --data (default ../shared/data/mnist beside the checkout).
"""

from __future__ import annotations

import time

import torch
from common import Report, arguments, interleave
from torch.utils.data import DataLoader, Subset

from runner.data.mnist import MNIST
from runner.engine import Accelerator

torch.set_num_threads(1)


def seconds_per_batch(loader, epochs: int) -> float:
    """Seconds per batch over ``epochs`` full passes."""
    batches = 0
    start = time.perf_counter()
    for _ in range(epochs):
        for _images, _labels in loader:
            batches += 1
    return (time.perf_counter() - start) / batches


def main() -> None:
    args = arguments(__doc__, data=True)
    dataset = MNIST(args.data, "test")
    if args.quick:
        dataset = Subset(dataset, range(2048))
    epochs, rounds = (1, 2) if args.quick else (3, 7)
    accelerator = Accelerator(cpu=True)

    def plain(workers: int) -> DataLoader:
        options = {"num_workers": workers, "persistent_workers": workers > 0}
        return DataLoader(dataset, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0), **options)

    loaders = {
        "plain": plain(0),
        "prepared": accelerator.prepare(plain(0)),
        "plain, 2 workers": plain(2),
        "prepared, 2 workers": accelerator.prepare(plain(2)),
    }
    medians = interleave(
        {name: lambda loader=loader: seconds_per_batch(loader, epochs) for name, loader in loaders.items()}, rounds
    )

    report = Report(
        f"Loaders over {len(dataset)} MNIST images, batch 64, shuffled: {epochs} epoch(s) x {rounds} rounds"
    )
    for name, seconds in medians.items():
        report.value(f"{name} batches/s", 1 / seconds, "batches/s")
    report.ratio("prepared / plain", medians["plain"] / medians["prepared"], ">= 0.98x")
    report.ratio(
        "prepared / plain, 2 workers", medians["plain, 2 workers"] / medians["prepared, 2 workers"], ">= 0.98x"
    )
    report.finish(args.json)


if __name__ == "__main__":
    main()
