"""One fixture for every multi-process test: real gloo groups started by torch's elastic launcher."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runner.engine.launchers import debug_launcher


def launch_workers(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local workers of one elastic job; return their results by rank.

    ``fn`` must be a module-level function (workers are spawned and import it). A worker that
    raises fails the test with that worker's traceback.
    """
    return debug_launcher(fn, args, num_processes=nproc, start_method="spawn")


@pytest.fixture
def launch(monkeypatch):
    # One thread per worker: two workers on two cores must not oversubscribe (torchrun does the same).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return launch_workers
