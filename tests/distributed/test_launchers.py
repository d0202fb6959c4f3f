"""notebook_launcher and debug_launcher start real process groups and hand back each rank's result."""

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from runner.engine import Accelerator
from runner.engine.launchers import debug_launcher, notebook_launcher


def _describe(offset):
    accelerator = Accelerator()
    total = accelerator.reduce(torch.tensor([accelerator.process_index + offset]))
    return accelerator.process_index, accelerator.num_processes, accelerator.mixed_precision, total.item()


def _fail_on_rank_one():
    if Accelerator().process_index == 1:
        raise RuntimeError("rank one gives up")
    return "fine"


def test_notebook_launcher_runs_a_function_on_two_processes_and_returns(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = notebook_launcher(_describe, args=(10,), num_processes=2, mixed_precision="bf16")
    assert results == [(0, 2, "bf16", 21), (1, 2, "bf16", 21)]


def test_notebook_launcher_with_one_process_runs_in_this_process():
    assert notebook_launcher(_describe, args=(5,), num_processes=1) == [(0, 1, "no", 5)]


def test_debug_launcher_uses_the_cpu_and_reports_a_failing_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert debug_launcher(_describe, args=(0,)) == [(0, 2, "no", 1), (1, 2, "no", 1)]
    with pytest.raises(ChildFailedError, match="rank one gives up"):
        debug_launcher(_fail_on_rank_one)
