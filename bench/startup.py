"""Start-up: --help and config checks without torch, the engine's import cost, and command to first step.

    python bench/startup.py           # 5 rounds of the quick commands, 3 runs of each training command
    python bench/startup.py --quick   # 1 round, 1 run each (what CI runs)

- `python -m runner --help` and a rejected override (`trainer.max_step=3`, exit code 2): wall time
  per command (target < 0.5 s), and whether torch was imported (it must not be: `-X importtime`).
- `from runner.engine import Accelerator` vs `import torch`, each in a fresh interpreter, interleaved (target <=
  1.1x): ``import runner.engine`` alone imports nothing (its names load on first use).
- `python -m runner` and `experiment=mnist_ddp` (1 step, small MNIST slices) from the command to the
  first optimizer step, split into the phases the runner stamps (see runner/training/startup.py), and from the
  command to its first line (the run folder), against `python -c "import torch; print()"` to its line.
- The other end: seconds from the command's last line of output to its exit (its work after its last log line,
  then the interpreter's end), against a plain script that imports what a run imports (torch, torch._dynamo,
  torchmetrics), prints a line and ends.

MNIST is read from --data (default ../shared/data/mnist beside the checkout).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Report, arguments, interleave

STARTUP_LINE = re.compile(r"Start-up: first optimizer step ([\d.]+) s after the command \((.*)\)")


PLAIN_SCRIPT = "import torch, torch._dynamo, torchmetrics; print('done', flush=True)"
ACCELERATOR = "from runner.engine import Accelerator"


def python(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def timed_lines(*args: str, cwd: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float, float]:
    """``python ARGS`` run to its end (stdout and stderr as one), the seconds from its last line to its exit, and
    the seconds from its start to its first line."""
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, last, first = [], time.perf_counter(), None
    for line in process.stdout:
        lines.append(line)
        last = time.perf_counter()
        first = last - started if first is None else first
    process.wait(timeout=600)
    ended = time.perf_counter()
    result = subprocess.CompletedProcess(process.args, process.returncode, "".join(lines), "")
    return result, ended - last, first if first is not None else ended - started


def imports_torch(*args: str, cwd: Path) -> bool:
    result = python("-X", "importtime", *args, cwd=cwd)
    modules = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line]
    return any(module.split(".")[0] == "torch" for module in modules)


def first_step(overrides: list[str], data: str, cwd: Path) -> dict[str, float]:
    """Seconds from launching the command to the first optimizer step, per phase, and from its last line to its
    exit."""
    env = {**os.environ, "RUNNER_STARTUP": f"spawned={time.time():.6f}"}
    args = ["-m", "runner", *overrides, f"data.root={data}", 'data.train_split="test[:1024]"',
            'data.eval_split="test[1024:1280]"', "trainer.max_steps=1", "trainer.progress_bar=false"]  # fmt: skip
    result, after_last_line, first_line = timed_lines(*args, cwd=cwd, env=env)
    match = STARTUP_LINE.search(result.stdout)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"python -m runner {' '.join(overrides)} failed:\n{result.stdout[-3000:]}")
    phases = {"total": float(match.group(1)), "exit": after_last_line, "first line": first_line}
    for part in match.group(2).split(", "):
        name, seconds, _ = part.rsplit(" ", 2)
        phases[name] = float(seconds)
    return phases


def main() -> None:
    args = arguments(__doc__, data=True)
    rounds, runs = (1, 1) if args.quick else (5, 3)
    report = Report("Start-up")
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        quick = interleave(
            {
                "python -c pass": lambda: python("-c", "pass", cwd=cwd) and None,
                "python -m runner --help": lambda: python("-m", "runner", "--help", cwd=cwd) and None,
                "rejected override": lambda: python("-m", "runner", "trainer.max_step=3", cwd=cwd) and None,
                "import torch": lambda: python("-c", "import torch", cwd=cwd) and None,
                "import the Accelerator": lambda: python("-c", ACCELERATOR, cwd=cwd) and None,
            },
            rounds,
        )
        for name, seconds in quick.items():
            report.value(f"{name} (s)", seconds, "s")
        report.value("--help imports torch", float(imports_torch("-m", "runner", "--help", cwd=cwd)), "(0 = no)")
        rejected = imports_torch("-m", "runner", "trainer.max_step=3", cwd=cwd)
        report.value("rejected override imports torch", float(rejected), "(0 = no)")
        report.ratio("import the Accelerator / import torch", quick["import the Accelerator"] / quick["import torch"],
                     "<= 1.1x")  # fmt: skip
        plain = statistics.median(timed_lines("-c", PLAIN_SCRIPT, cwd=cwd)[1] for _ in range(runs))
        torch_seconds = statistics.median(timed_lines("-c", "import torch; print('done')", cwd=cwd)[2]
                                          for _ in range(runs))  # fmt: skip
        report.value("python -c 'import torch; print()': its line (s)", torch_seconds, "s")
        report.value("plain script with a run's imports: last line to exit (s)", plain, "s")
        for label, overrides in {"python -m runner": [], "experiment=mnist_ddp": ["experiment=mnist_ddp"]}.items():
            samples = [first_step(overrides, args.data, cwd) for _ in range(runs)]
            medians = {phase: statistics.median(s[phase] for s in samples) for phase in samples[0]}
            report.value(f"{label}: to first step (s)", medians.pop("total"), "s")
            exit_seconds, first_line = medians.pop("exit"), medians.pop("first line")
            # The run's first line (its folder) comes before the config's targets are imported: within 3 s here.
            report.value(f"{label}: to its first line (s)", first_line, "s")
            report.ratio(f"{label}: first line / import torch's line", first_line / torch_seconds)
            for phase, seconds in medians.items():
                report.value(f"  {phase}", seconds, "s")
            report.value(f"{label}: last line to exit (s)", exit_seconds, "s")
            report.ratio(f"{label}: last line to exit / plain script's", exit_seconds / plain)
    report.finish(args.json)


if __name__ == "__main__":
    main()
