"""Faults injected into real runs: stop signals (preemption), and what resuming after them gives."""

import os
import re
import signal
import subprocess
import time

import pytest
import torch
from safetensors.torch import load_file

from runner.cli.checkpoints import describe
from tests.e2e.conftest import metrics, mnist_args, run_cli
from tests.preloaded import start_module


def _start(args, cwd):
    return start_module("runner", *args, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _workers(launcher: int) -> list[int]:
    """The training processes of the run ``launcher`` started, oldest first: the children of its forkserver (the
    launcher's one child with children of its own; its resource tracker has none)."""

    def children(pid: int) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True)
        return sorted(map(int, found.stdout.split()))

    return [worker for server in children(launcher) for worker in children(server)]


def _wait_for_training(run, process, timeout=120):
    deadline = time.monotonic() + timeout
    while "Start-up: first optimizer step" not in ((run / "run.log").read_text() if (run / "run.log").exists() else ""):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run never reached its first step"
        time.sleep(0.1)


DDP_RUN = ["experiment=mnist_ddp", *mnist_args("test[:4000]", "test[9800:]"), "trainer.max_steps=60"]


@pytest.fixture(scope="module")
def uninterrupted_ddp(tmp_path_factory):
    """DDP_RUN from start to end: what every interrupted DDP run below must end up equal to."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    done = run_cli(*DDP_RUN, f"hydra.run.dir={folder / 'run'}", cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def _preempt_and_resume(tmp_path, common, stop, full=None, stopped_by="SIG"):
    cut = tmp_path / "cut"
    if full is None:
        full = tmp_path / "full"
        done = run_cli(*common, f"hydra.run.dir={full}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]

    process = _start([*common, f"hydra.run.dir={cut}"], tmp_path)
    _wait_for_training(cut, process)
    stop(process.pid)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr[-3000:]
    message = stderr.strip().splitlines()[-1]
    assert message.startswith(f"runner: stopped by {stopped_by}") and message.endswith(
        f"is saved; continue with `python -m runner resume={cut}` (exit code 75)."
    )
    # The run's log ends with the same account: how long it ran, what stopped it, what is saved, how to go on.
    ending = r"\]\[WARNING\] - Stopped after [^:]+: " + re.escape(message.removeprefix("runner: ")) + r"\n$"
    assert re.search(ending, (cut / "run.log").read_text()), (cut / "run.log").read_text()[-2000:]
    records = describe(cut)
    assert records and all(record["status"] == "intact" for record in records)  # nothing half-written counts
    assert not (cut / "metrics.json").exists()

    resumed = run_cli(f"resume={cut}", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metrics(cut) == metrics(full)
    expected, got = load_file(full / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bit-identical to the uninterrupted run
    return records


def test_signals_to_the_launcher_stop_both_ranks_at_one_step_and_resume_is_exact(tmp_path, uninterrupted_ddp):
    def stop(pid):
        os.kill(pid, signal.SIGUSR1)  # what Slurm sends before the time limit
        time.sleep(0.05)
        os.kill(pid, signal.SIGTERM)  # a second signal while the checkpoint is being written

    # Checkpoints change nothing in the training; written in the background, the stop waits for the last one.
    common = [*DDP_RUN, "trainer.checkpoint_every_n_steps=5", "trainer.async_checkpoint=true"]
    records = _preempt_and_resume(tmp_path, common, stop, uninterrupted_ddp)
    assert records[-1]["step"] < 60 and records[-1]["step"] % 10 == 0  # ranks agree every 10th step


def test_sigusr1_to_a_single_process_run_saves_and_resumes_exactly(tmp_path):
    common = [*mnist_args("test[:4000]", "test[9800:]"), "trainer.max_steps=60"]
    records = _preempt_and_resume(tmp_path, common, lambda pid: os.kill(pid, signal.SIGUSR1))
    assert len(records) == 1 and records[0]["step"] < 60  # one checkpoint, at the next step (alone: any step)


def test_sigterm_to_one_worker_stops_every_rank_at_the_same_step(tmp_path, uninterrupted_ddp):
    def stop(pid):
        os.kill(_workers(pid)[-1], signal.SIGTERM)  # the last rank started

    records = _preempt_and_resume(tmp_path, DDP_RUN, stop, uninterrupted_ddp, "a stop signal to the workers")
    assert len(records) == 1 and records[0]["step"] < 60 and records[0]["step"] % 10 == 0


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path, uninterrupted_ddp):
    common = [*DDP_RUN, "trainer.checkpoint_every_n_steps=5", "trainer.max_restarts=1"]
    full, cut = uninterrupted_ddp, tmp_path / "cut"

    process = _start([*common, f"hydra.run.dir={cut}"], tmp_path)
    deadline = time.monotonic() + 120
    while not (cut / "checkpoints" / "checkpoint_1" / "manifest.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(_workers(process.pid)[0], signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    log = (cut / "run.log").read_text()
    assert "Restart 1: resuming from" in log
    assert metrics(cut) == metrics(full)
    expected, got = load_file(full / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # bit-identical to the uninterrupted run


def test_a_worker_that_keeps_dying_fails_the_run_naming_its_rank(tmp_path):
    process = _start(
        ["experiment=mnist_ddp", *mnist_args("test[:4000]", "test[9800:]"), "trainer.max_steps=400",
         f"hydra.run.dir={tmp_path / 'run'}"],
        tmp_path,
    )  # fmt: skip
    _wait_for_training(tmp_path / "run", process)
    os.kill(_workers(process.pid)[-1], signal.SIGKILL)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1
    assert stderr.strip().splitlines()[-1].startswith("runner: error: Worker rank 1 failed: ")


def test_two_nodes_on_localhost_train_as_one_job(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    project = tmp_path / "project"

    def node(rank):
        return _start(
            ["parallel=ddp", "trainer.num_nodes=2", f"trainer.node_rank={rank}", "trainer.num_processes=1",
             f"trainer.rdzv_endpoint=127.0.0.1:{port}", f"project.project_dir={project}",
             *mnist_args("test[:1000]", "test[9800:]"), "trainer.max_steps=5",
             f"hydra.run.dir={tmp_path / f'node{rank}'}"],
            tmp_path,
        )  # fmt: skip

    # Node 0 hosts the rendezvous (it checks that the port is free); on one machine, start it first.
    nodes = [node(0)]
    log = tmp_path / "node0" / "run.log"
    deadline = time.monotonic() + 60
    while "Starting 1 processes" not in (log.read_text() if log.exists() else ""):
        assert nodes[0].poll() is None and time.monotonic() < deadline, nodes[0].communicate()[1][-3000:]
        time.sleep(0.05)
    nodes.append(node(1))
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr[-3000:]
    manifest = (project / "checkpoints" / "checkpoint_0" / "manifest.json").read_text()
    assert '"world_size": 2' in manifest and metrics(project)["step"] == 5
    assert (tmp_path / "node0" / ".hydra").is_dir() and (tmp_path / "node1" / ".hydra").is_dir()
