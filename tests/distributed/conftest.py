"""One fixture for every multi-process test: real gloo groups started by torch's elastic launcher."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest

from runner.engine.launchers import debug_launcher
from runner.launch import preload
from tests.distributed.groups import WorkerGroup


def launch_workers(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local workers of one elastic job; return their results by rank.

    ``fn`` must be a module-level function (workers import it by name). The workers are forked
    from the forkserver a run's workers fork from (one per test process, with the same modules
    preloaded), each in this process's environment of the launch (as spawned workers would be, in a
    fraction of the time). A worker that raises fails the test with that worker's traceback.
    """
    preload.start()
    try:
        return debug_launcher(fn, args, num_processes=nproc, start_method="forkserver")
    finally:
        # The elastic agent ran in this process: free what it left in reference cycles (its store, with a C++
        # thread) here and now. Left to the garbage collector, it could be collected in a process that a later
        # test forks from this one (a DataLoader worker), where destroying a thread that was never there aborts it.
        gc.collect()


@pytest.fixture(scope="session")
def _worker_groups():
    """This test process's shared worker groups, by number of workers (see tests/distributed/groups.py)."""
    groups: dict[int, WorkerGroup] = {}
    yield groups
    for group in groups.values():
        group.close()


@pytest.fixture
def launch(monkeypatch, _worker_groups):
    """``launch(fn, *args, nproc=2)``: ``fn(*args)`` on ``nproc`` workers, their results by rank.

    The workers are a shared group's (:class:`WorkerGroup`), launched once and reused by test after test (a test
    of what only a new process shows, its start, its exit, a failing rank as the launcher reports it, calls
    :func:`launch_workers` itself).
    """
    # One thread per worker: two workers on two cores must not oversubscribe (torchrun does the same).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def run(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
        group = _worker_groups.get(nproc)
        if group is None or not group.fits(nproc):
            if group is not None:
                group.close()
            group = _worker_groups[nproc] = WorkerGroup(nproc)
        return group.run(fn, args)

    yield run
