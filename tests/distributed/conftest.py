"""One fixture for every multi-process test: real gloo groups started by torch's elastic launcher."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


def launch_workers(fn: Callable[..., Any], *args: Any, nproc: int = 2) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local workers of one elastic job; return their results by rank.

    ``fn`` must be a module-level function (workers are spawned and import it). A worker that
    raises fails the test with that worker's traceback.
    """
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"test-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.05,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(),
    )
    results = elastic_launch(config, fn)(*args)
    return [results[rank] for rank in range(nproc)]


@pytest.fixture
def launch(monkeypatch):
    # One thread per worker: two workers on two cores must not oversubscribe (torchrun does the same).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return launch_workers
