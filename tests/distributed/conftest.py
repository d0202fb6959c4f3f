"""One fixture for every multi-process test: real gloo groups started by torch's elastic launcher."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest

from runner.engine.launchers import debug_launcher
from runner.launch import forkserver


def launch_workers(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local workers of one elastic job; return their results by rank.

    ``fn`` must be a module-level function (workers import it by name). The workers are forked
    from the forkserver a run's workers fork from (one per test process, with the same modules
    preloaded), each in this process's environment of the launch (as spawned workers would be, in a
    fraction of the time). A worker that raises fails the test with that worker's traceback.
    """
    forkserver.start()
    return debug_launcher(fn, args, num_processes=nproc, start_method="forkserver")


@pytest.fixture
def launch(monkeypatch):
    # One thread per worker: two workers on two cores must not oversubscribe (torchrun does the same).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yield launch_workers
    # The elastic agent ran in this process: free what it left in reference cycles (its store, with a C++
    # thread) here and now. Left to the garbage collector, it could be collected in a process that a later test
    # forks from this one (a DataLoader worker), where destroying a thread that was never there aborts it.
    gc.collect()
