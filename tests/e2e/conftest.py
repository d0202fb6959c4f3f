"""Helpers for end-to-end tests: run ``python -m runner ...`` as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.training.startup import STARTUP_ENV
from tests.preloaded import run_module
from tests.shared_data import MNIST

REPO = Path(__file__).resolve().parents[2]


def run_cli(
    *args: str, cwd: Path, timeout: int = 600, module: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m runner *args`` in ``cwd`` (with ``env`` added to the environment); return the finished
    process (stdout and stderr as text).

    The command is forked from an interpreter that has imported torch already (:mod:`tests.preloaded`);
    ``module=False`` runs ``python *args`` in a fresh interpreter instead, for what a fresh start must show.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    env.pop(STARTUP_ENV, None)  # a command's start-up record is its own, as from a shell (tests stamp in-process)
    if module:
        return run_module("runner", *args, cwd=cwd, env=env, timeout=timeout)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


_CLI_DRIVER = """
import contextlib, io, json, sys, traceback
import runner.cli
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv, stderr, code = ["runner", *argv], io.StringIO(), 0
    with contextlib.redirect_stderr(stderr):
        try:
            runner.cli.main()
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
    results.append({"returncode": code, "stderr": stderr.getvalue()})
print(json.dumps(results))
"""


def run_cli_refusals(
    commands: list[list[str]], *, cwd: Path, timeout: int = 600, env: dict[str, str] | None = None
) -> list[dict]:
    """Run each command line through ``runner``'s entry point, all in one fresh Python process (torch is
    imported once), for command lines refused before anything starts; returns each one's returncode and
    stderr. A command that starts a run would run it here, so give only ones that must be refused.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    env.pop(STARTUP_ENV, None)  # a command's start-up record is its own, as from a shell (tests stamp in-process)
    command = [sys.executable, "-c", _CLI_DRIVER, json.dumps(commands)]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def mnist_args(train: str = "test[:2000]", evaluation: str = "test[9000:]") -> list[str]:
    """Offline MNIST on slices of the real test split (Hydra needs the inner quotes around brackets)."""
    return [f"data.root={MNIST}", f'data.train_split="{train}"', f'data.eval_split="{evaluation}"']


def metrics(run_dir: Path) -> dict:
    """The run's final metrics: metrics.json without the command's own times (wall_time_s, time_to_first_step_s),
    which differ from one run to the next (tests/e2e/test_runner.py checks them)."""
    found = json.loads((run_dir / "metrics.json").read_text())
    return {key: value for key, value in found.items() if key not in ("wall_time_s", "time_to_first_step_s")}


@pytest.fixture(autouse=True)
def _needs_mnist():
    if not MNIST.is_dir():
        pytest.skip(f"the MNIST test split is not at {MNIST}")
