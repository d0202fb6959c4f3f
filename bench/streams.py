"""Streams: how long a resumed iterable dataset takes to hand out its first batch, at the epoch's start and deep in it.

    python bench/streams.py           # positions 0 and 1,000,000 samples; 7 rounds
    python bench/streams.py --quick   # positions 0 and 10,000; 2 rounds (what CI runs)

A prepared loader (one process, batches of 32) over a stream of integers, resumed from a saved position:
- with state (``state_dict``/``load_state_dict``, as Hugging Face's ``IterableDataset`` and
  ``runner.data``'s streams have): the stream continues from its state, whatever the position;
- without (a plain ``IterableDataset``): the loader reads past every sample already seen.
Target: with state, resuming deep in the epoch costs <= 1.5x resuming at its start.
"""

from __future__ import annotations

import logging

from common import Report, arguments, interleave
from torch.utils.data import DataLoader, IterableDataset

from runner.engine import Accelerator

BATCH = 32


class Plain(IterableDataset):
    """0, 1, 2, ...: a stream that knows no position but its own iteration."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __iter__(self):
        yield from range(self.length)


class WithState(Plain):
    """The same stream, recording its position and continuing from one."""

    def __init__(self, length: int) -> None:
        super().__init__(length)
        self.position = self.start = 0

    def __iter__(self):
        start, self.start = self.start, 0
        for index in range(start, self.length):
            self.position = index + 1  # as of this sample handed out
            yield index

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["position"]


def first_batch(accelerator: Accelerator, stream: IterableDataset, position: int) -> None:
    loader = accelerator.prepare(DataLoader(stream, batch_size=BATCH))
    saved = {"epoch": 0, "samples_seen": position}
    if isinstance(stream, WithState) and position:
        saved["dataset_state"] = {"position": position}
    loader.load_state_dict(saved)
    batch = next(iter(loader))
    assert int(batch[0]) == position, (int(batch[0]), position)


def main() -> None:
    args = arguments(__doc__)
    logging.getLogger("runner").setLevel(logging.ERROR)  # the read-past warning, once per contender call
    deep = 10_000 if args.quick else 1_000_000
    length = deep + 10 * BATCH
    accelerator = Accelerator()
    medians = interleave(
        {
            "with state, at 0": lambda: first_batch(accelerator, WithState(length), 0),
            "with state, deep": lambda: first_batch(accelerator, WithState(length), deep),
            "read past, deep": lambda: first_batch(accelerator, Plain(length), deep),
        },
        rounds=2 if args.quick else 7,
    )
    report = Report(f"Resuming a stream: time to its first batch ({deep:,} samples deep, batches of {BATCH})")
    for name, seconds in medians.items():
        report.value(name, seconds, "ms", scale=1e3)
    report.ratio("with state: deep / at 0", medians["with state, deep"] / medians["with state, at 0"], "<= 1.5")
    report.ratio("read past / with state, deep", medians["read past, deep"] / medians["with state, deep"])
    report.finish(args.json)


if __name__ == "__main__":
    main()
