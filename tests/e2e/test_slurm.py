"""`srun python -m runner ...`, with the SLURM_* variables Slurm sets, as two tasks on this machine."""

import json
import os
import subprocess
import sys
import time

from tests.e2e.conftest import metrics, mnist_args, run_cli


def _srun_task(tmp_path, job, rank, nodes, extra=()):
    env = {
        **os.environ,
        "SLURM_JOB_ID": str(job), "SLURM_JOB_NODELIST": "localhost", "SLURM_NTASKS": "2",
        "SLURM_NNODES": str(nodes), "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank if nodes == 2 else 0),
        "SLURM_LOCALID": str(0 if nodes == 2 else rank), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    }  # fmt: skip
    command = [sys.executable, "-m", "runner", *mnist_args("test[:512]", "test[9800:]"), "trainer.max_steps=3", *extra]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(tasks):
    for task in tasks:
        _, stderr = task.communicate(timeout=300)
        assert task.returncode == 0, stderr[-3000:]


def test_one_srun_task_per_process_forms_one_group(tmp_path):
    job = 30000 + os.getpid() % 9000  # its port (20000 + job % 20000) differs between concurrent test runs
    _finish([_srun_task(tmp_path, job, rank, nodes=1) for rank in (0, 1)])
    run = tmp_path / "outputs" / f"slurm-{job}"
    manifest = json.loads((run / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and metrics(run)["step"] == 3
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [f"slurm-{job}"]


def test_one_srun_task_per_node_launches_each_nodes_workers(tmp_path):
    job = 40000 + os.getpid() % 9000
    first = _srun_task(tmp_path, job, 0, nodes=2, extra=["parallel=ddp"])
    log = tmp_path / "outputs" / f"slurm-{job}" / "run.log"
    deadline = time.monotonic() + 60  # node 0 hosts the rendezvous: on one machine, let it start first
    while "Starting 1 processes" not in (log.read_text() if log.exists() else ""):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
        time.sleep(0.05)
    _finish([first, _srun_task(tmp_path, job, 1, nodes=2, extra=["parallel=ddp"])])
    run = tmp_path / "outputs" / f"slurm-{job}"
    manifest = json.loads((run / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and metrics(run)["step"] == 3


def test_jobs_submitted_through_hydras_submitit_launcher_train(tmp_path):
    # submitit's local executor runs the jobs the way its Slurm executor does (a pickled Hydra task per
    # job), without a cluster: the path hydra/launcher=slurm takes once the job starts.
    sweep = tmp_path / "sweep"
    result = run_cli(
        "-m", "hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}", *mnist_args("test[:512]", "test[9800:]"),
        "trainer.max_steps=2", "optimizer.lr=1e-3,3e-3", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert [metrics(sweep / job)["step"] for job in ("0", "1")] == [2, 2]


def test_the_slurm_preset_composes_with_the_plugin(tmp_path):
    composed = run_cli("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "--cfg", "hydra", cwd=tmp_path)
    assert composed.returncode == 0, composed.stderr[-3000:]
    launcher = composed.stdout.split("  launcher:\n", 1)[1]
    assert "SlurmLauncher" in launcher and "partition: gpu" in launcher and "signal_delay_s: 120" in launcher
