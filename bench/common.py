"""What every benchmark shares: interleaved rounds, medians, ratios, and one report format.

Contenders run in the same process, in turn (A B A B ...), so the machine's noise hits them alike;
only medians and their ratios are reported. Each benchmark's ``--json`` writes the same numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/x.py` from a checkout without an install
    sys.path.insert(0, str(ROOT))


def arguments(
    doc: str, *, data: bool = False, dataset: str = "mnist", workloads: tuple[str, ...] = ()
) -> argparse.Namespace:
    """``--quick`` and ``--json`` for every benchmark; ``--data`` (the ``dataset`` folder) and ``--only``
    (one of ``workloads``) where asked."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small version that runs in seconds (CI)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    if data:
        parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / dataset), help=f"{dataset} folder")
    if workloads:
        parser.add_argument("--only", choices=workloads, help="run this workload alone")
    return parser.parse_args()


def interleave(contenders: dict[str, Callable[[], float | None]], rounds: int, warmup: int = 1) -> dict[str, float]:
    """Run every contender once per round, in turn; return each one's median (see :func:`interleave_rounds`)."""
    samples = interleave_rounds(contenders, rounds, warmup)
    return {name: statistics.median(values) for name, values in samples.items()}


def interleave_rounds(
    contenders: dict[str, Callable[[], float | None]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Run every contender once per round, in turn; return each one's measurement of every round.

    A contender returns the quantity it measured itself (seconds per step, say), or None to be
    timed whole. The first ``warmup`` rounds are discarded. Each round starts one contender further
    along (round r runs them from the r-th on, cyclically), so no contender always runs first, after
    the others' work (a loop's first contender ran up to 2% slower than an identical second one).
    """
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(warmup + rounds):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            contender = contenders[name]
            start = time.perf_counter()
            measured = contender()
            elapsed = time.perf_counter() - start
            if round_ >= warmup:
                samples[name].append(elapsed if measured is None else measured)
    return samples


def paired_ratio(samples: list[float], baseline: list[float]) -> tuple[float, float, float]:
    """The median of the ratios of ``samples`` to ``baseline`` taken round by round, with their quartiles.

    Pairing rounds cancels what drifts over a run, which the ratio of two medians keeps: the machine's
    pace moves by several percent within a minute, and two identical contenders' medians once differed
    by 17%.
    """
    ratios = [sample / base for sample, base in zip(samples, baseline, strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    low, _, high = statistics.quantiles(ratios, n=4)
    return statistics.median(ratios), low, high


@dataclass
class Report:
    """Lines of a benchmark's printed report and the matching JSON."""

    title: str
    values: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, dict] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def value(self, name: str, number: float, unit: str, *, scale: float = 1.0) -> None:
        self.values[name] = number
        self.lines.append(f"  {name:<48} {number * scale:12.2f} {unit}")

    def ratio(self, name: str, number: float, target: str | None = None) -> None:
        met = None if target is None else _meets(number, target)
        self.ratios[name] = {"ratio": number, "target": target, "met": met}
        suffix = "" if target is None else f"   target {target}: {'met' if met else 'MISSED'}"
        self.lines.append(f"  {name:<48} {number:12.3f}x{suffix}")

    def note(self, text: str) -> None:
        self.lines.append(f"  {text}")

    def finish(self, json_path: Path | None) -> None:
        print(self.title)
        print("\n".join(self.lines))
        if json_path is not None:
            results = {"title": self.title, "values": self.values, "ratios": self.ratios}
            json_path.write_text(json.dumps(results, indent=2))


def _meets(number: float, target: str) -> bool:
    operator, bound = target.split()
    return number <= float(bound.rstrip("x")) if operator == "<=" else number >= float(bound.rstrip("x"))
