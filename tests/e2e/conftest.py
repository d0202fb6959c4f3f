"""Helpers for end-to-end tests: run ``python -m runner ...`` as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MNIST = REPO.parent / "shared" / "data" / "mnist"


def run_cli(*args: str, cwd: Path, timeout: int = 600, module: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m runner *args`` in ``cwd``; return the finished process (stdout and stderr as text)."""
    command = [sys.executable, "-m", "runner", *args] if module else [sys.executable, *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def mnist_args(train: str = "test[:2000]", evaluation: str = "test[9000:]") -> list[str]:
    """Offline MNIST on slices of the real test split (Hydra needs the inner quotes around brackets)."""
    return [f"data.root={MNIST}", f'data.train_split="{train}"', f'data.eval_split="{evaluation}"']


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


@pytest.fixture(autouse=True)
def _needs_mnist():
    if not MNIST.is_dir():
        pytest.skip(f"the MNIST test split is not at {MNIST}")
