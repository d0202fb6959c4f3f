"""The shared worker groups the multi-process tests run on (tests/distributed/groups.py): one launch, many
functions, each from a fresh worker's state, for callers with its environment; a failing rank fails its call, and
the next call gets new workers."""

import os
import random
import signal

import pytest
import torch

from runner.engine import Accelerator
from runner.engine.checkpoint import staging as checkpoint_staging
from tests.distributed import groups
from tests.distributed.groups import WorkerFailed, WorkerGroup, running


def _state():
    return {
        "pid": os.getpid(), "rank": os.environ["RANK"], "folder": os.getcwd(), "torch": torch.rand(2).tolist(),
        "python": random.random(), "threads": torch.get_num_threads(), "left": os.environ.get("LEFT_BY_A_TEST"),
        "dtype": torch.get_default_dtype(), "deterministic": torch.are_deterministic_algorithms_enabled(),
        "usr1": signal.getsignal(signal.SIGUSR1), "group": torch.distributed.is_initialized(),
        "writer": checkpoint_staging._save_object.__qualname__,
    }  # fmt: skip


def _leave_state_behind():
    Accelerator().wait_for_everyone()  # the process group stays
    os.environ["LEFT_BY_A_TEST"] = "1"
    torch.manual_seed(5)
    random.seed(5)
    torch.set_num_threads(2)
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    checkpoint_staging._save_object = print  # as a test makes one rank's writes fail
    return os.getpid()


def _fail_on_rank_one():
    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise ValueError("rank one gives up")
    accelerator.wait_for_everyone()  # rank 0 waits for rank 1 in a collective


@pytest.fixture
def group(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    group = WorkerGroup(2)
    yield group
    group.close()


def test_functions_run_one_after_another_on_the_same_workers_each_from_a_fresh_state(group, tmp_path, monkeypatch):
    first = group.run(_state, ())
    pids = group.run(_leave_state_behind, ())
    again = group.run(_state, ())
    assert [state["pid"] for state in first] == pids == [state["pid"] for state in again]
    assert [state["rank"] for state in first] == ["0", "1"]
    assert first[0]["folder"] == str(tmp_path) and first[0]["threads"] == 1 and first[0]["left"] is None
    assert first[0]["dtype"] == torch.float32 and first[0]["usr1"] == signal.SIG_DFL and not first[0]["group"]
    assert first[0]["writer"] == "_save_object"
    # Everything the second function changed is back, but the process group it created, which the next joins.
    assert [{**state, "group": False} for state in again] == first and again[0]["group"]
    # It serves only callers with the environment it was launched with.
    assert group.fits(2) and not group.fits(3)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # read when a worker's group starts
    assert not group.fits(2)


def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_the_next_call_starts_new_workers(group, monkeypatch):
    monkeypatch.setattr(groups, "FAILURE_GRACE_SECONDS", 5.0)
    pids = [state["pid"] for state in group.run(_state, ())]
    with pytest.raises(WorkerFailed) as failed:
        group.run(_fail_on_rank_one, ())
    message = str(failed.value)
    assert message.startswith("_fail_on_rank_one failed on a shared worker group:\n[rank 0] ")
    assert "\n[rank 1] Traceback (most recent call last):" in message
    assert message.rstrip().endswith("ValueError: rank one gives up")
    assert not group.alive
    assert not any(map(running, pids))  # the group's workers are gone
    fresh = WorkerGroup(2)
    try:
        assert {state["pid"] for state in fresh.run(_state, ())}.isdisjoint(pids)
    finally:
        fresh.close()
