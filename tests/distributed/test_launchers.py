"""notebook_launcher and debug_launcher start real process groups and hand back each rank's result."""

import os
import socket

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from runner.engine import Accelerator
from runner.engine.constants import USE_CPU_ENV
from runner.engine.launchers import debug_launcher, notebook_launcher


def _describe(offset):
    accelerator = Accelerator()
    total = accelerator.reduce(torch.tensor([accelerator.process_index + offset]))
    return accelerator.process_index, accelerator.num_processes, accelerator.mixed_precision, total.item()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


def _where_it_runs():
    return (os.environ.get("RUNNER_TEST_LAUNCH"), os.environ["RANK"], os.environ.get(USE_CPU_ENV), os.getcwd(),
            torch.get_num_threads(), os.getppid())  # fmt: skip


def test_forkserver_workers_run_in_the_environment_and_folder_of_each_launch(monkeypatch, tmp_path):
    here = os.getcwd()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("RUNNER_TEST_LAUNCH", "first")
    first = debug_launcher(_where_it_runs, start_method="forkserver")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("RUNNER_TEST_LAUNCH", "second")
    monkeypatch.chdir(tmp_path)
    second = debug_launcher(_where_it_runs, start_method="forkserver")
    assert [worker[:5] for worker in first] == [("first", str(rank), "1", here, 2) for rank in (0, 1)]
    assert [worker[:5] for worker in second] == [("second", str(rank), "1", str(tmp_path), 1) for rank in (0, 1)]
    parents = {worker[5] for worker in first + second}
    assert len(parents) == 1 and os.getpid() not in parents  # all four forked by one server, not by this process


def test_notebook_launcher_takes_accelerates_rendezvous_arguments(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    results = notebook_launcher(
        _describe,
        args=(1,),
        num_processes=2,
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        rdzv_conf={"timeout": 120},
        rdzv_id="parity",
        log_line_prefix_template="[worker ${rank}] ",
    )
    assert results == [(0, 2, "no", 3), (1, 2, "no", 3)]


def test_notebook_launcher_hands_the_rendezvous_to_torchs_launch_config(monkeypatch):
    import torch.distributed.launcher.api as api

    seen = {}

    def fake_launch(config, entrypoint):
        seen["config"] = config
        return lambda *args: {0: "a", 1: "b"}

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    results = notebook_launcher(
        _describe,
        num_processes=2,
        num_nodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        use_port=29600,
        rdzv_conf={"timeout": 60},
        rdzv_id="job-7",
        log_line_prefix_template="[${rank}] ",
    )
    config = seen["config"]
    assert results == ["a", "b"]
    assert (config.rdzv_backend, config.rdzv_endpoint, config.run_id) == ("static", "10.0.0.1:29600", "job-7")
    assert config.rdzv_configs == {"timeout": 60, "rank": 1}
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert config.log_line_prefix_template == "[${rank}] "
