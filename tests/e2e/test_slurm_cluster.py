"""On a real Slurm cluster started on this machine (tests/slurm_cluster.py: slurmctld, four slurmd, munge; no
accounting database, so no sacct): jobs submitted with ``-m hydra/launcher=slurm_cpu``, stopped by submitit's signal
and by ``scontrol requeue`` and requeued, ending as an uninterrupted run does; a sweep whose requeues ran out,
continued by the same command without waiting (``hydra.launcher.wait=false``) and not submitted twice by it again;
``srun`` with a task per rank and a task per node; two nodes through the launcher; refusals in one sentence; a waiting
sweep whose jobs Slurm cancels (``scancel``) ends, failed in one sentence, with its summary."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.e2e.conftest import metrics, mnist_args, run_cli
from tests.preloaded import start_module
from tests.slurm_cluster import ClusterUnavailable, SlurmCluster

# Slurm jobs on the test cluster: one CPU and 2 GB each, a limit far from the test's length.
SLURM = ["-m", "hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2",
         "hydra.launcher.timeout_min=10"]  # fmt: skip
TRAIN = [*mnist_args("test[:2000]", "test[9800:]"), "trainer.checkpoint_every_n_steps=100",
         "trainer.log_every_n_steps=10", "trainer.eval_every_n_steps=50", "tracker=[csv]", "seed=3"]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        started = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    except ClusterUnavailable as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the test Slurm cluster did not start: {error}")
        pytest.skip(f"no test Slurm cluster here: {error}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(started.conf)  # inherited by every command run, sbatch and srun included
    yield started
    started.stop()
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


def _slurm(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _wait_for(predicate, what: str, launched, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while not (found := predicate()):
        assert launched.poll() is None, f"the sweep command ended before {what}: {launched.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:g} s"
        time.sleep(0.1)
    return found


def _steps(log: Path) -> list[int]:
    """The steps the run logged its training metrics at, in order, over every attempt."""
    text = log.read_text() if log.exists() else ""
    return [int(step) for step in re.findall(r"- step (\d+)/\d+ \| train/loss", text)]


def _job_id(sweep: Path) -> str | None:
    folders = [p.name for p in (sweep / ".submitit").glob("*") if p.is_dir() and p.name.isdigit()]
    return folders[0] if folders else None


def _rows(run: Path) -> list[dict[str, str]]:
    with (run / "logs" / "metrics.csv").open(newline="") as file:
        return [{k: v for k, v in row.items() if k != "train/samples_per_second"} for row in csv.DictReader(file)]


def _assert_same_run(run: Path, reference: Path) -> None:
    ours, theirs = load_file(run / "model" / "model.safetensors"), load_file(reference / "model" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert metrics(run) == metrics(reference)
    rows = _rows(run)
    assert [row["step"] for row in rows] == [row["step"] for row in _rows(reference)]  # each step once
    assert rows == _rows(reference)


def test_a_job_stopped_by_submitits_signal_and_by_scontrol_requeue_ends_as_an_uninterrupted_run(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    launched = start_module(
        "runner", *SLURM, f"hydra.sweep.dir={sweep}", *TRAIN, "trainer.max_steps=300", cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    log = sweep / "0" / "run.log"
    reference = start_module(
        "runner",
        *TRAIN,
        "trainer.max_steps=300",
        f"hydra.run.dir={tmp_path / 'reference'}",
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip, meanwhile

    # Slurm sends submitit's signal (scancel --signal, as at signal_delay_s before the time limit): the run saves at
    # the next step, submitit requeues the job, and the job starts again from that checkpoint.
    _wait_for(lambda: max(_steps(log), default=0) >= 110, "step 110", launched)
    job = _job_id(sweep)
    _slurm("scancel", "--signal=USR2", job)
    # While it waits in the queue, runner status says so, with the sentence the job left.
    _wait_for(
        lambda: (json.loads((sweep / "0" / "job.json").read_text()))["status"] == "requeued", "requeued", launched
    )
    shown = run_cli("status", str(sweep), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    line = shown.stdout.splitlines()[1]
    assert re.match(
        r"0 +requeued +\d+/300 +[0-9.]+ +\S+ +stopped by SIGUSR2 at a step all processes agreed on; "
        r"checkpoint_1 is saved; submitit requeues the job, which continues from it\.$",
        line,
    ), line
    first = _wait_for(lambda: re.search(r"Resumed at step (\d+)", log.read_text()), "the requeued job", launched)
    stopped_at = int(first.group(1))
    assert 110 <= stopped_at < 200
    # scontrol requeue: Slurm sends SIGTERM, the run saves again, and Slurm itself requeues the job.
    _wait_for(lambda: max(_steps(log), default=0) >= stopped_at + 30, "30 more steps", launched)
    _slurm("scontrol", "requeue", job)
    stdout, stderr = launched.communicate(timeout=300)
    assert launched.returncode == 0, stderr[-3000:]
    _, stderr_reference = reference.communicate(timeout=300)
    assert reference.returncode == 0, stderr_reference[-3000:]

    text = log.read_text()
    resumes = [int(step) for step in re.findall(r"Resumed at step (\d+)", text)]
    assert len(resumes) == 2 and resumes[0] == stopped_at and stopped_at + 30 <= resumes[1] < 300
    job_log = (sweep / ".submitit" / job / f"{job}_0_log.err").read_text()
    assert "runner: stopped by SIGUSR2 at a step all processes agreed on; checkpoint_1 is saved; submitit " \
           "requeues the job, which continues from it." in job_log  # fmt: skip
    assert "runner: stopped by SIGTERM at a step all processes agreed on; checkpoint_" in job_log
    assert "Traceback" not in job_log and "Traceback" not in stderr
    record = json.loads((sweep / "0" / "job.json").read_text())
    assert record["status"] == "finished" and record["resumed_from"] == f"checkpoint_{int(resumes[1] > 200) + 2}"
    assert "1 finished." in (sweep / "summary.md").read_text()
    _assert_same_run(sweep / "0", tmp_path / "reference")


def test_when_submitit_may_not_requeue_the_sweep_ends_with_a_summary_and_the_same_command_continues(cluster, tmp_path):
    sweep = tmp_path / "sweep"
    command = [*SLURM, "hydra.launcher.max_num_timeout=0", f"hydra.sweep.dir={sweep}", *TRAIN, "trainer.max_steps=200"]
    launched = start_module("runner", *command, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log = sweep / "0" / "run.log"
    _wait_for(lambda: max(_steps(log), default=0) >= 60, "step 60", launched)
    _slurm("scancel", "--signal=USR2", _job_id(sweep))
    _, stderr = launched.communicate(timeout=300)
    assert launched.returncode == 1, stderr[-3000:]
    record = json.loads((sweep / "0" / "job.json").read_text())
    assert record["status"] == "failed"
    assert re.fullmatch(
        r"stopped by SIGUSR2 at a step all processes agreed on; checkpoint_0 is saved; submitit did not requeue the "
        r"job \(Job not requeued because: timed-out too many times\); continue it with `python -m runner "
        rf"resume={re.escape(str(sweep / '0'))}`, or run the same sweep command again\.",
        record["error"],
    ), record["error"]
    assert "Traceback" not in stderr and "| 0 | failed |" in (sweep / "summary.md").read_text()
    shown = run_cli("status", str(sweep), cwd=tmp_path)
    assert re.match(r"0 +failed +\d+/200 .* submitit did not requeue the job", shown.stdout.splitlines()[1]), shown

    # The same command again, walking away (held in the queue, so that it is seen waiting there): it returns once
    # the job is queued, and says so. submitit's own files in the sweep folder are not "links in a run folder".
    assert any(path.is_symlink() for path in (sweep / ".submitit").iterdir())
    first = json.loads((sweep / "slurm_jobs.json").read_text())["0"]["slurm_job"]
    walk_away = ["hydra.launcher.wait=false", "+hydra.launcher.additional_parameters.hold=true"]
    again = run_cli(*command, *walk_away, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    queued = json.loads((sweep / "slurm_jobs.json").read_text())["0"]["slurm_job"]
    follow = f"follow the sweep with `runner status {sweep}`; its summary ({sweep / 'summary.md'}) is complete when " \
             "the last job ends."  # fmt: skip
    assert queued != first and _said(again) == [
        f"runner: submitted 1 job to Slurm ({queued}) without waiting for it; {follow}"
    ]
    assert cluster.job_state(queued) == "PENDING" and json.loads((sweep / "0" / "job.json").read_text())["status"] \
        == "failed"  # fmt: skip
    shown = run_cli("status", str(sweep), cwd=tmp_path)
    assert re.fullmatch(rf"0 +queued +\d+/200 .* submitted to Slurm as job {queued}, not started yet",
                        shown.stdout.splitlines()[1]), shown.stdout  # fmt: skip
    # And again, while that job waits: it is not submitted a second time (two Slurm jobs on one run folder).
    twice = run_cli(*command, "hydra.launcher.wait=false", cwd=tmp_path)
    assert twice.returncode == 0, twice.stderr[-3000:]
    assert f"Sweep job 0 is still in Slurm as job {queued} (PENDING): not submitting it again" in twice.stdout + \
        twice.stderr  # fmt: skip
    assert _said(twice) == [
        f"runner: submitted 0 jobs to Slurm (none) without waiting for them; 1 more still queued or running there "
        f"({queued}); {follow}"
    ]
    assert json.loads((sweep / "slurm_jobs.json").read_text())["0"]["slurm_job"] == queued
    # Released, it runs, continues from its checkpoint to its end, and writes the whole summary as the last job.
    released = time.time()
    _slurm("scontrol", "release", queued)
    deadline = time.monotonic() + 240
    while "finished" not in (shown := run_cli("status", str(sweep), cwd=tmp_path)).stdout.splitlines()[1]:
        assert re.match(r"0 +(queued|running) ", shown.stdout.splitlines()[1]), shown.stdout
        assert time.monotonic() < deadline, f"the released job did not finish within 240 s: {shown.stdout}"
        time.sleep(2)
    assert re.fullmatch(r"0 +finished +200/200 .*", shown.stdout.splitlines()[1]), shown.stdout
    # The job writes the summary after its record says finished; no command waits for it.
    deadline = time.monotonic() + 60
    summary, picture = sweep / "summary.md", sweep / "summary.png"
    while picture.stat().st_mtime <= released or "1 finished." not in summary.read_text():
        assert time.monotonic() < deadline, "the finished job did not write the sweep's summary within 60 s"
        time.sleep(0.5)
    record = json.loads((sweep / "0" / "job.json").read_text())
    assert record["status"] == "finished" and record["resumed_from"] == "checkpoint_0"
    assert metrics(sweep / "0")["step"] == 200
    rows = _rows(sweep / "0")  # a row for each logged step, and one for each evaluation: none twice
    assert [int(row["step"]) for row in rows if row["train/loss"]] == list(range(10, 201, 10))
    assert [int(row["step"]) for row in rows if row["eval/loss"]] == [50, 100, 150, 200]


def test_srun_layouts_two_nodes_through_the_launcher_and_one_sentence_refusals(cluster, tmp_path):
    runner = [sys.executable, "-m", "runner", *mnist_args("test[:512]", "test[9800:]"), "trainer.max_steps=3",
              "parallel=ddp"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def srun(*options: str, folder: str, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        command = ["srun", *options, *runner, f"hydra.run.dir={tmp_path / folder}", *extra]
        return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    per_rank = srun("-N", "1", "-n", "2", folder="per_rank")  # two tasks on one node: each task a rank
    assert per_rank.returncode == 0, per_rank.stderr[-3000:]
    per_node = srun("-N", "2", "--ntasks-per-node=1", folder="per_node")  # each task its node's launcher
    assert per_node.returncode == 0, per_node.stderr[-3000:]
    for folder in ("per_rank", "per_node"):
        manifest = json.loads((tmp_path / folder / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and metrics(tmp_path / folder)["step"] == 3
    assert "Starting 1 processes on this node (2 node(s))" in (tmp_path / "per_node" / "run.log").read_text()

    # Nodes whose names resolve nowhere: every task says so at once, before any rendezvous.
    unresolved = srun("-p", "unresolved", "-N", "2", "--ntasks-per-node=1", folder="unresolved")
    assert unresolved.returncode != 0
    sentences = [line for line in unresolved.stderr.splitlines() if line.startswith("runner: error:")]
    assert len(sentences) == 2 and all(
        re.fullmatch(
            r"runner: error: trainer\.rdzv_endpoint=n1:\d+: its host n1 \(the job's first node, from "
            r"SLURM_JOB_NODELIST\) does not resolve on \S+ \(.+\); make that name resolve on every node \(DNS or "
            r"/etc/hosts\), or give trainer\.rdzv_endpoint=ADDRESS:PORT that every node can reach\.",
            sentence,
        )
        for sentence in sentences
    ), unresolved.stderr[-3000:]
    assert "Traceback" not in unresolved.stderr

    # Two nodes through Hydra's submitit launcher: a task per node, one run folder.
    sweep = tmp_path / "two_nodes"
    two = run_cli(
        *SLURM, "hydra.launcher.nodes=2", f"hydra.sweep.dir={sweep}", *runner[3:], cwd=tmp_path,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    manifest = json.loads((sweep / "0" / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and metrics(sweep / "0")["step"] == 3

    # The GPU preset on a cluster without GPUs: sbatch refuses the job, and the sentence names the keys.
    refused = run_cli("-m", "hydra/launcher=slurm", f"hydra.sweep.dir={tmp_path / 'gpus'}", *runner[3:], cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1] == (
        "runner: error: Slurm refused the job (sbatch: error: Invalid generic resource (gres) specification); set "
        "hydra.launcher.gpus_per_node=8 to what the cluster offers (sinfo lists its partitions, CPUs, memory and "
        "GPUs) (on a cluster without GPUs, use hydra/launcher=slurm_cpu)."
    )
    assert "Traceback" not in refused.stderr

    # A plain scancel, of a running job and of one still queued: Slurm ends them without submitit's result, and
    # without sacct to ask, the waiting command still ends, with each job failed in one sentence and the summary.
    cancelled = tmp_path / "cancelled"
    args = [*mnist_args("test[:512]", "test[9800:]"), "trainer.max_steps=100000", "trainer.log_every_n_steps=10"]
    launched = start_module(
        "runner", *SLURM, "+hydra.launcher.additional_parameters.hold=true", f"hydra.sweep.dir={cancelled}", *args,
        "seed=1,2", cwd=tmp_path, env=env,
    )  # fmt: skip
    submitted = _wait_for(lambda: _submitted(cancelled, 2), "the submission", launched, timeout=120)
    _slurm("scontrol", "release", submitted[0])
    _wait_for(lambda: _steps(cancelled / "0" / "run.log"), "the first logged step", launched)
    _slurm("scancel", submitted[0].split("_")[0])  # the array: its running task and its queued one
    cancelled_at = time.monotonic()
    _, stderr = launched.communicate(timeout=120)
    assert launched.returncode == 1 and time.monotonic() - cancelled_at < 60, stderr[-3000:]
    newest = max((cancelled / "0" / "checkpoints").iterdir(), key=lambda path: int(path.name.split("_")[1])).name
    first = (
        f"Slurm ended job {submitted[0]} as CANCELLED before it finished; {newest} is its newest checkpoint; continue "
        f"it with `python -m runner resume={cancelled / '0'}`, or run the same sweep command again."
    )
    assert stderr.strip().splitlines()[-1] == (
        f"runner: error: 2 sweep job(s) failed, first {cancelled / '0'} ({' '.join(args)} seed=1): {first} (all errors "
        f"in {cancelled / 'summary.md'}; re-run the same command to retry them)."
    )
    records = [json.loads((cancelled / job / "job.json").read_text()) for job in ("0", "1")]
    assert [(record["status"], record["error"]) for record in records] == [
        ("failed", first),
        ("failed", f"Slurm ended job {submitted[1]} as CANCELLED before it started; run the same sweep command again "
                   "to run it."),
    ]  # fmt: skip
    summary = (cancelled / "summary.md").read_text()
    assert "2 failed." in summary and "| 0 | failed | 1 |" in summary and "| 1 | failed | 2 |" in summary
    assert "Traceback" not in stderr


def _said(done: subprocess.CompletedProcess) -> list[str]:
    """The lines a sweep command that does not wait printed about what it submitted."""
    return [line for line in done.stdout.splitlines() if line.startswith("runner: submitted")]


def _submitted(sweep: Path, count: int) -> list[str] | None:
    """The Slurm job ids the sweep's jobs were submitted as, once all ``count`` are recorded."""
    try:
        recorded = json.loads((sweep / "slurm_jobs.json").read_text())
    except (OSError, ValueError):
        return None
    return [recorded[str(number)]["slurm_job"] for number in range(count)] if len(recorded) == count else None
