"""Debug mode: gather, reduce, broadcast and pad_across_processes check shapes across processes first. The group
these workers start also shows InitProcessGroupKwargs at work."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import runner.engine
import runner.engine.utils
from runner.engine import Accelerator, InitProcessGroupKwargs
from runner.engine.constants import ACCELERATE_DEBUG_MODE_ENV, DEBUG_MODE_ENV
from runner.engine.ops import DistributedOperationException, is_debug_mode
from tests.distributed.conftest import launch_workers


def _error(operation, *args, **kwargs):
    try:
        operation(*args, **kwargs)
    except DistributedOperationException as error:
        return str(error)
    return None


def _matching_calls(accelerator, rank):
    """Every verified operation on shapes that work together; returns the results and the object all-gathers run."""
    calls = []
    all_gather_object = dist.all_gather_object

    def counting(*args, **kwargs):
        calls.append(1)
        return all_gather_object(*args, **kwargs)

    dist.all_gather_object = counting
    try:
        value = torch.tensor([rank + 10])
        results = {
            "gather": accelerator.gather({"a": torch.tensor([rank, rank]), "b": torch.ones(1, 2) * rank})["a"].tolist(),
            "reduce": accelerator.reduce(torch.tensor([1.0, rank]), reduction="sum").tolist(),
            "broadcast": runner.engine.utils.broadcast(value, from_process=1).tolist(),
            "pad": accelerator.pad_across_processes(torch.ones(rank + 1, 2)).shape,  # sizes may differ
        }
    finally:
        dist.all_gather_object = all_gather_object
    return results, len(calls)


def _debug_mode_on_two_processes():
    accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=42))])
    rank = accelerator.process_index
    out = {"off": _matching_calls(accelerator, rank)}
    out["group"] = (dist.get_backend(), dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout)

    os.environ[ACCELERATE_DEBUG_MODE_ENV] = "1"
    out["gather"] = _error(accelerator.gather, torch.zeros(2, 3) if rank == 0 else torch.zeros(3))
    out["gather_for_metrics"] = _error(accelerator.gather_for_metrics, torch.zeros(rank + 1))
    out["reduce"] = _error(accelerator.reduce, (torch.zeros(2), torch.zeros(4 + rank)))
    out["broadcast"] = _error(runner.engine.utils.broadcast, {"x": torch.zeros(rank + 1)}, from_process=1)
    out["pad"] = _error(accelerator.pad_across_processes, torch.zeros(2, 2) if rank == 0 else torch.zeros(2))
    out["on"] = _matching_calls(accelerator, rank)  # every rank raised before its collective: the group still works
    del os.environ[ACCELERATE_DEBUG_MODE_ENV]

    os.environ[DEBUG_MODE_ENV] = "Yes"
    out["ours"] = _error(accelerator.gather, [torch.zeros(1)] * (rank + 1))
    del os.environ[DEBUG_MODE_ENV]
    return out


@pytest.fixture(scope="module")
def results():
    # One group for the whole module, so not the per-test `launch` fixture; its environment, by hand.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        for name in ("RANK", "WORLD_SIZE", DEBUG_MODE_ENV, ACCELERATE_DEBUG_MODE_ENV):
            env.delenv(name, raising=False)
        yield launch_workers(_debug_mode_on_two_processes)


def test_the_group_is_joined_with_the_init_process_group_kwargs_given(results):
    assert [result["group"] for result in results] == [("gloo", timedelta(seconds=42))] * 2


def test_mismatched_gather_raises_on_every_rank_with_each_process_shapes(results):
    expected = (
        "Cannot apply gather: the tensors' shapes differ across processes (all must match): process 0: [2, 3]; "
        "process 1: [3]. Make them equal on every process; pad_across_processes evens out one dimension."
    )
    assert [result["gather"] for result in results] == [expected, expected]
    for result in results:
        assert "process 0: [1]; process 1: [2]" in result["gather_for_metrics"]
        assert "process 0: [1]; process 1: [1], [1]" in result["ours"]  # RUNNER_DEBUG_MODE, another nest length


def test_mismatched_reduce_broadcast_and_pad_raise_on_every_rank(results):
    for result in results:
        assert result["reduce"].startswith("Cannot apply reduce: the tensors' shapes differ across processes")
        assert "process 0: [2], [4]; process 1: [2], [5]." in result["reduce"]
        assert result["broadcast"].startswith("Cannot apply broadcast: ")
        assert "(all must match the source, process 1): process 0: [1]; process 1: [2]." in result["broadcast"]
        assert result["pad"].startswith("Cannot apply pad_across_processes: the tensors' numbers of dimensions differ")
        assert "process 0: [2, 2]; process 1: [2]." in result["pad"]


def test_matching_shapes_give_the_usual_results_with_one_shape_exchange_per_call(results):
    for result in results:
        on, shape_exchanges = result["on"]
        assert on == result["off"][0]
        assert on == {"gather": [0, 0, 1, 1], "reduce": [2.0, 1.0], "broadcast": [11], "pad": torch.Size([2, 2])}
        assert shape_exchanges == 4


def test_without_debug_mode_no_collective_is_added(results):
    assert [result["off"][1] for result in results] == [0, 0]


@pytest.mark.parametrize(
    ("name", "value", "on"),
    [
        (ACCELERATE_DEBUG_MODE_ENV, "1", True),
        (ACCELERATE_DEBUG_MODE_ENV, "TRUE", True),
        (DEBUG_MODE_ENV, "yes", True),
        (DEBUG_MODE_ENV, "0", False),
        (ACCELERATE_DEBUG_MODE_ENV, "false", False),
        (DEBUG_MODE_ENV, "", False),
    ],
)
def test_debug_mode_is_read_from_either_variable(monkeypatch, name, value, on):
    monkeypatch.delenv(DEBUG_MODE_ENV, raising=False)
    monkeypatch.delenv(ACCELERATE_DEBUG_MODE_ENV, raising=False)
    monkeypatch.setenv(name, value)
    assert is_debug_mode() is on


def test_one_process_has_nothing_to_check(monkeypatch):
    monkeypatch.setenv(ACCELERATE_DEBUG_MODE_ENV, "1")
    assert runner.engine.utils.gather(torch.zeros(2)).tolist() == [0.0, 0.0]
    assert runner.engine.utils.reduce(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]


def test_exception_is_exported_under_accelerates_names():
    assert runner.engine.DistributedOperationException is DistributedOperationException
    assert runner.engine.utils.DistributedOperationException is DistributedOperationException
    assert issubclass(DistributedOperationException, Exception)


def test_accelerator_state_says_whether_debug_mode_was_on(monkeypatch):
    monkeypatch.delenv(DEBUG_MODE_ENV, raising=False)
    monkeypatch.delenv(ACCELERATE_DEBUG_MODE_ENV, raising=False)
    assert Accelerator().state.debug is False
    monkeypatch.setenv(ACCELERATE_DEBUG_MODE_ENV, "1")
    state = Accelerator().state
    assert state.debug is True
    with pytest.raises(AttributeError):
        state.debug = False  # immutable, as the rest of the state


def _partial_state_switches_debug_mode():
    from runner.engine import PartialState
    from runner.engine.utils import pad_across_processes

    accelerator = Accelerator()
    state = PartialState()
    agrees = [getattr(state, name) for name in ("num_processes", "process_index", "device", "distributed_type")] == [
        getattr(accelerator, name) for name in ("num_processes", "process_index", "device", "distributed_type")
    ]
    mismatched = torch.zeros(1, 5) if state.process_index == 0 else torch.zeros(1, 1, 6)  # as Accelerate's test_ops
    state.debug = True  # Accelerate's switch: every collective of the process checks first
    try:
        checked = _error(pad_across_processes, mismatched, dim=0)
    finally:
        PartialState._reset_state()
    return {"agrees": agrees, "checked": checked is not None, "debug_after_reset": is_debug_mode()}


def test_partial_state_agrees_with_the_accelerator_and_switches_debug_mode(launch):
    for rank in launch(_partial_state_switches_debug_mode):
        assert rank == {"agrees": True, "checked": True, "debug_after_reset": False}
