"""Run every benchmark in turn: python bench/all.py [--quick] [--json-dir DIR] [NAME ...].

Each benchmark is its own process (as when run alone), so one's memory or threads never colour
another's numbers. Prints each report, then the ratios with their targets. Names (e.g. ``checkpoint
startup``) run only those.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
BENCHMARKS = ("overhead", "step", "startup", "checkpoint", "dataloader", "memory", "tokens", "trackers", "streams")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every benchmark's quick mode (what CI runs)")
    parser.add_argument("--json-dir", type=Path, help="write each benchmark's results there as NAME.json")
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"only these benchmarks (default: all of {', '.join(BENCHMARKS)})"
    )
    args = parser.parse_args()
    if unknown := sorted(set(args.names) - set(BENCHMARKS)):
        parser.error(f"no benchmark named {', '.join(unknown)}; the benchmarks are {', '.join(BENCHMARKS)}")
    chosen = [name for name in BENCHMARKS if name in args.names] if args.names else list(BENCHMARKS)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.json_dir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        failed = []
        for name in chosen:
            command = [sys.executable, str(BENCH / f"{name}.py"), "--json", str(out / f"{name}.json")]
            if subprocess.run(command + ["--quick"] * args.quick).returncode != 0:
                failed.append(name)
        print("\nRatios against the baselines:")
        for name in chosen:
            path = out / f"{name}.json"
            ratios = json.loads(path.read_text()).get("ratios", {}) if path.exists() else {}
            for label, ratio in ratios.items():
                target = (
                    f"  (target {ratio['target']}: {'met' if ratio['met'] else 'MISSED'})" if ratio["target"] else ""
                )
                print(f"  {name:<11} {label:<44} {ratio['ratio']:7.3f}x{target}")
    if failed:
        sys.exit(f"benchmarks that failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
