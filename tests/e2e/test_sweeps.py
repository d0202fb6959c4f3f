"""Sweeps as a user runs them: summaries, resuming a killed sweep, failed jobs, Optuna, parallel jobs."""

import csv
import hashlib
import json
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import yaml

from runner.sweeps.report import read_scalars
from tests.e2e.conftest import metrics, mnist_args, run_cli
from tests.preloaded import run_module, start_module

SMALL = ["model.channels=8", "model.hidden=32"]  # steps cost little; the sweep machinery is what is tested
TINY = [*mnist_args("test[:400]", "test[9900:]"), *SMALL, "trainer.max_steps=4", "trainer.log_every_n_steps=2"]


def _rows(sweep: Path) -> list[dict]:
    with open(sweep / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def _job(folder: Path) -> dict:
    return json.loads((folder / "job.json").read_text())


def _fingerprint(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative name -> sha256 of its bytes)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_a_2x2_grid_writes_one_summary_row_per_job_with_its_overrides(tmp_path):
    sweep = tmp_path / "sweep"
    done = run_cli("-m", *TINY, "optimizer.lr=1e-3,3e-3", "data.batch_size=16,32", f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    rows = _rows(sweep)
    assert [(r["job"], r["optimizer.lr"], r["data.batch_size"]) for r in rows] == [
        ("0", "0.001", "16"), ("1", "0.001", "32"), ("2", "0.003", "16"), ("3", "0.003", "32"),
    ]  # fmt: skip
    for row in rows:
        final = metrics(sweep / row["job"])
        assert row["status"] == "finished" and row["objective"] == "eval/accuracy"
        assert float(row["eval/accuracy"]) == final["eval/accuracy"]  # the run's own final metrics
        assert int(row["step"]) == 4 and int(row["best_step"]) == 4  # evaluated once, at the end
        assert float(row["wall_time_s"]) > 0 and row["error"] == ""
        assert _job(sweep / row["job"])["objective"]["value"] == final["eval/accuracy"]

    markdown = (sweep / "summary.md").read_text()
    assert "4 finished." in markdown
    assert "| job | status | optimizer.lr | data.batch_size | eval/accuracy |" in markdown
    best = max(rows, key=lambda r: float(r["eval/accuracy"]))
    assert f"Best: job {best['job']} (optimizer.lr={best['optimizer.lr']}, data.batch_size={best['data.batch_size']})" \
        in markdown  # fmt: skip
    png = (sweep / "summary.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    # Each job's TensorBoard run carries its hyperparameters, and declares its metrics, for the HParams tab.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(next((sweep / "3" / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["optimizer.lr"].number_value == 0.003 and start.hparams["data.batch_size"].number_value == 32
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert {"eval/accuracy", "eval/loss", "train/loss"} <= {m.name.tag for m in experiment.metric_infos}
    assert read_scalars(sweep / "3" / "logs")["eval/accuracy"] == [(4, float(rows[3]["eval/accuracy"]))]

    # runner.report rebuilds the same summary from the folders alone.
    written = {name: (sweep / name).read_text() for name in ("summary.csv", "summary.md")}
    for name in written:
        (sweep / name).unlink()
    report = run_module("runner.report", str(sweep), cwd=os.getcwd(), env=dict(os.environ))
    assert report.returncode == 0, report.stderr
    assert {name: (sweep / name).read_text() for name in written} == written
    assert report.stdout == written["summary.md"]
    again = run_module("runner", "report", str(sweep), cwd=os.getcwd(), env=dict(os.environ))  # runner report
    assert again.returncode == 0 and again.stdout == written["summary.md"], again.stderr


def test_a_killed_sweep_rerun_runs_only_the_rest_and_leaves_finished_jobs_untouched(tmp_path):
    sweep = tmp_path / "sweep"
    command = ["-m", *mnist_args("test[:2000]", "test[9900:]"), *SMALL, "trainer.max_steps=80",
               "trainer.checkpoint_every_n_steps=10", "trainer.log_every_n_steps=10", "optimizer.lr=1e-3,2e-3,3e-3",
               f"hydra.sweep.dir={sweep}"]  # fmt: skip
    process = start_module("runner", *command, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 180
    while not (sweep / "1" / "checkpoints" / "checkpoint_0" / "manifest.json").exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "job 1 never saved a checkpoint"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)  # no chance to record anything: the hardest stop
    process.communicate()
    assert _job(sweep / "0")["status"] == "finished" and _job(sweep / "1")["status"] == "running"
    assert not (sweep / "2").exists()
    before = _fingerprint(sweep / "0")
    mtimes = {path: path.stat().st_mtime_ns for path in (sweep / "0").rglob("*")}

    report = run_module("runner.report", str(sweep), "--no-plot", cwd=os.getcwd(), env=dict(os.environ))
    assert report.returncode == 0, report.stderr
    assert [(r["job"], r["status"]) for r in _rows(sweep)] == [("0", "finished"), ("1", "interrupted"),
                                                                ("2", "pending")]  # fmt: skip

    rerun = run_cli(*command, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    log = rerun.stdout + rerun.stderr
    assert "1 of 3 jobs already finished; running the other 2" in log
    assert "#0 :" not in log and "#1 :" in log and "#2 :" in log  # Hydra's launch lines, numbered as before
    assert _fingerprint(sweep / "0") == before  # the finished job: every byte as it was...
    assert {path: path.stat().st_mtime_ns for path in (sweep / "0").rglob("*")} == mtimes  # ...not even rewritten
    resumed = _job(sweep / "1")
    assert resumed["status"] == "finished" and resumed["resumed_from"].startswith("checkpoint_")
    assert "Resuming sweep job 1 from checkpoint_" in log
    assert [(r["job"], r["status"], r["step"]) for r in _rows(sweep)] == [(str(i), "finished", "80") for i in range(3)]


def test_a_failing_job_is_listed_with_its_error_and_the_others_still_run(tmp_path):
    sweep = tmp_path / "sweep"
    # The command line is checked with each sweep's first value: a bad later value fails its own job only.
    done = run_cli("-m", *TINY, "optimizer.lr=1e-3,-1.0", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert done.returncode == 1
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith(f"runner: error: 1 sweep job(s) failed, first {sweep / '1'} (")
    assert "optimizer.lr=-1.0 must be" in message and message.endswith("re-run the same command to retry them).")

    rows = _rows(sweep)
    assert [(r["job"], r["optimizer.lr"], r["status"]) for r in rows] == [("0", "0.001", "finished"),
                                                                         ("1", "-1.0", "failed")]  # fmt: skip
    rejected = "optimizer.lr=-1.0 must be a positive number, e.g. optimizer.lr=1e-3."
    assert rows[1]["error"] == rejected == _job(sweep / "1")["error"]
    markdown = (sweep / "summary.md").read_text()
    assert "1 finished, 1 failed." in markdown
    assert "## Errors" in markdown and rejected in markdown


def test_a_sweep_folder_of_another_sweep_is_refused_and_left_alone(tmp_path):
    sweep = tmp_path / "sweep"
    first = run_cli("-m", *TINY, "optimizer.lr=1e-3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    before, multirun = _fingerprint(sweep / "0"), (sweep / "multirun.yaml").read_text()

    other = run_cli("-m", *TINY, "optimizer.lr=5e-3,1e-3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert other.returncode == 2
    message = other.stderr.strip().splitlines()[-1]
    assert message.startswith(f"runner: error: hydra.sweep.dir={sweep} already holds another sweep ({sweep / '0'}")
    assert message.endswith("give this sweep a new hydra.sweep.dir.")
    assert _fingerprint(sweep / "0") == before and not (sweep / "1").exists()
    assert (sweep / "multirun.yaml").read_text() == multirun  # the first sweep's record of its command


def test_optuna_searches_three_trials_and_the_summary_ranks_them(tmp_path):
    sweep = tmp_path / "optuna"
    done = run_cli("-m", "hparams_search=mnist_optuna", "hydra.sweeper.n_trials=3", *TINY, f"hydra.sweep.dir={sweep}",
                   cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _rows(sweep)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "finished"), ("1", "finished"), ("2", "finished")]
    assert {"optimizer.lr", "optimizer.weight_decay", "data.batch_size", "model.dropout"} <= set(rows[0])
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == max(float(r["eval/accuracy"]) for r in rows)  # Optuna maximised what main returned
    best = max(rows, key=lambda r: float(r["eval/accuracy"]))
    assert result["best_params"]["data.batch_size"] == int(best["data.batch_size"])


def test_joblib_runs_ddp_jobs_at_once_within_a_thread_budget(tmp_path):
    sweep = tmp_path / "parallel"
    done = run_cli("-m", "hydra/launcher=joblib", "experiment=mnist_ddp", *TINY, "optimizer.lr=1e-3,3e-3",
                   "tracker=[tensorboard,mlflow]", f"hydra.sweep.dir={sweep}", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "validated against ConfigStore schema" not in done.stderr
    jobs = [_job(sweep / str(i)) for i in range(2)]
    assert [job["status"] for job in jobs] == ["finished", "finished"]
    # n_jobs=2 jobs of 2 processes each share the cores: cores // 2 // 2 threads per process (at least 1).
    assert [job["threads_per_process"] for job in jobs] == [max(1, (os.cpu_count() or 1) // 4)] * 2
    spans = [(datetime.fromisoformat(job["started_at"]), datetime.fromisoformat(job["ended_at"])) for job in jobs]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # the two jobs overlapped in time
    assert metrics(sweep / "0")["step"] == metrics(sweep / "1")["step"] == 4

    # tracker=mlflow: the jobs are runs of one store in the sweep folder, under one parent run, which the two
    # jobs starting at once made once (its lookup is under a lock in the sweep folder).
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{sweep / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    (parent,) = [run for run in runs if "runner.group" in run.data.tags]
    children = sorted((run for run in runs if run is not parent), key=lambda run: run.data.params["optimizer.lr"])
    assert parent.data.tags["runner.group"] == parent.info.run_name == f"{sweep.parent.name}/{sweep.name}"
    assert [run.data.tags.get("mlflow.parentRunId") for run in children] == [parent.info.run_id] * 2
    assert [run.data.params["optimizer.lr"] for run in children] == ["0.001", "0.003"]
    assert ["optimizer.lr=0.001" in children[0].info.run_name, "optimizer.lr=0.003" in children[1].info.run_name] == [
        True, True
    ]  # a job's run is named by its overrides  # fmt: skip
    for run in children:
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [4]


def test_a_stop_signal_stops_the_sweep_with_a_checkpoint_and_the_same_command_continues_it(tmp_path):
    sweep = tmp_path / "sweep"
    command = ["-m", *mnist_args("test[:2000]", "test[9900:]"), *SMALL, "trainer.max_steps=120",
               "optimizer.lr=1e-3,3e-3", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    process = start_module("runner", *command, cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 180
    while "Start-up" not in ((sweep / "1" / "run.log").read_text() if (sweep / "1" / "run.log").exists() else ""):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "job 1 never started training"
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 75, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].endswith("; run the same sweep command again to continue (exit code 75).")
    stopped = _job(sweep / "1")
    assert stopped["status"] == "stopped" and stopped["error"].startswith("stopped by SIGTERM")

    rerun = run_cli(*command, cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = _job(sweep / "1")
    assert resumed["status"] == "finished" and resumed["resumed_from"].startswith("checkpoint_")
    assert metrics(sweep / "1")["step"] == 120
