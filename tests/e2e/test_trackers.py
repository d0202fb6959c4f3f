"""``tracker=``: TensorBoard, CSV, MLflow (its own SQLite store), W&B (offline) and your own trackers at once on 2
processes; a resume continues the same tracked runs with no step missing or repeated; a tracker that fails is
warned about once and the run goes on. Read back with each library's own reader (MlflowClient, W&B's record
schema, TensorBoard's EventAccumulator). A sweep's jobs as MLflow runs under one parent: tests/e2e/test_sweeps.py."""

from __future__ import annotations

import csv
import json
import math

import pytest

from tests.e2e.conftest import metrics, mnist_args, run_cli
from tests.wandb_records import offline_runs, read_run

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")

# Your own trackers, in the folder the runs start from (as a user's package beside their configs).
MY_TRACKERS = '''
import json
from pathlib import Path

from runner.engine import GeneralTracker


class FileTracker(GeneralTracker):
    """Appends each call as a JSON line to ``path``."""

    name = "file"
    requires_logging_directory = False

    def __init__(self, path):
        super().__init__()
        self.path = Path(path)

    def start(self):
        self.file = self.path.open("a")

    def store_init_configuration(self, values):
        import multiprocessing  # where the runner calls its trackers: their helper process, by default

        self.file.write(json.dumps({"seed": values["seed"], "process": multiprocessing.current_process().name}) + "\\n")

    def log(self, values, step=None, **kwargs):
        import multiprocessing
        import threading

        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
        where = f"{multiprocessing.current_process().name}/{threading.current_thread().name}"
        self.file.write(json.dumps({"step": step, "where": where, **numbers}) + "\\n")
        self.file.flush()

    def finish(self):
        self.file.write(json.dumps({"finished": True}) + "\\n")
        self.file.close()


class BrokenTracker(GeneralTracker):
    """Its server goes away at step ``fail_at``."""

    name = "broken"
    requires_logging_directory = False

    def __init__(self, fail_at):
        super().__init__()
        self.fail_at = fail_at

    def log(self, values, step=None, **kwargs):
        if step is not None and step >= self.fail_at:
            raise ConnectionError("the server went away")
'''
CUT, END = 4, 8


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 2-process run with every tracker, cut at step 4 (checkpoint 2 and 4), then resumed to step 8 with the
    trackers on a thread of the training process instead of their helper process."""
    base = tmp_path_factory.mktemp("trackers")
    (base / "my_trackers.py").write_text(MY_TRACKERS)
    run = base / "run"
    arguments = [
        *mnist_args("test[:512]", "test[9900:]"), "trainer.num_processes=2", "parallel=ddp",
        "trainer.log_every_n_steps=1", "trainer.eval_every_n_steps=2", "trainer.checkpoint_every_n_steps=2",
        "tracker=[tensorboard,csv,mlflow,wandb]", "tracker.wandb.mode=offline",
        "+tracker.file._target_=my_trackers.FileTracker", f"+tracker.file.path={base / 'file.jsonl'}",
        "+tracker.broken._target_=my_trackers.BrokenTracker", "+tracker.broken.fail_at=3",
    ]  # fmt: skip
    cut = run_cli(*arguments, f"trainer.max_steps={CUT}", f"hydra.run.dir={run}", cwd=base)
    assert cut.returncode == 0, cut.stderr[-3000:]
    resumed = run_cli(f"resume={run}", f"trainer.max_steps={END}", "trainer.tracker_process=false", cwd=base)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return base, run, cut.stderr + resumed.stderr


def _every_step_once(steps: list[int]) -> None:
    assert steps == list(range(1, END + 1)), steps


def test_mlflow_run_holds_the_config_every_step_and_the_artifacts_and_the_resume_continues_it(tracked):
    _, run, _ = tracked
    recorded = json.loads((run / "trackers.json").read_text())["mlflow"]
    assert recorded["tracking_uri"] == f"sqlite:///{run / 'mlflow.db'}"  # the default: a SQLite file in the run
    client = mlflow.MlflowClient(recorded["tracking_uri"])
    (only,) = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    assert only.info.run_id == recorded["run_id"]  # the resume continued the run: one run, not two
    assert only.info.status == "FINISHED" and only.info.run_name == f"{run.parent.name}/{run.name}"
    params = only.data.params
    assert params["trainer.num_processes"] == "2" and params["parallel.strategy"] == "ddp"
    assert params["project.project_dir"] == str(run)  # the run folder
    assert params["trainer.max_steps"] == str(CUT)  # a param never changes in MLflow: the change is a tag
    assert only.data.tags["changed_on_resume.trainer.max_steps"] == str(END)
    losses = client.get_metric_history(only.info.run_id, "train/loss")
    _every_step_once([metric.step for metric in losses])
    evals = client.get_metric_history(only.info.run_id, "eval/accuracy")
    assert [metric.step for metric in evals] == [2, 4, 6, 8]
    final = metrics(run)
    assert evals[-1].value == pytest.approx(final["eval/accuracy"]) and final["step"] == END
    assert losses[-1].value == pytest.approx(final["train/loss"])
    artifacts = {entry.path for entry in client.list_artifacts(only.info.run_id)}
    assert artifacts == {"metrics.json", "model"}
    model = {entry.path for entry in client.list_artifacts(only.info.run_id, "model")}
    assert "model/model.safetensors" in model
    local = mlflow.artifacts.download_artifacts(
        run_id=only.info.run_id, artifact_path="metrics.json", tracking_uri=recorded["tracking_uri"]
    )
    assert json.loads(open(local).read()) == json.loads((run / "metrics.json").read_text())  # the file, times too
    assert (run / "mlartifacts").is_dir()  # the artifacts stay in the run folder too


def test_csv_has_a_column_per_metric_and_each_step_once(tracked):
    _, run, _ = tracked
    with (run / "logs" / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0])[:4] == ["step", "train/loss", "train/lr", "train/samples_per_second"]
    assert {"eval/loss", "eval/accuracy"} <= set(rows[0])
    train = [row for row in rows if row["train/loss"]]
    _every_step_once([int(row["step"]) for row in train])
    assert [int(row["step"]) for row in rows if row["eval/accuracy"]] == [2, 4, 6, 8]
    assert float(train[-1]["train/loss"]) == pytest.approx(metrics(run)["train/loss"], rel=1e-12)


def test_wandb_offline_runs_hold_the_history_and_the_resume_continues_the_same_run(tracked):
    _, run, _ = tracked
    recorded = json.loads((run / "trackers.json").read_text())["wandb"]
    attempts = [read_run(path) for path in offline_runs(run)]
    assert len(attempts) == 2 and {attempt["id"] for attempt in attempts} == {recorded["run_id"]}
    assert all(attempt["name"] == f"{run.parent.name}/{run.name}" for attempt in attempts)
    steps = [row["_step"] for attempt in attempts for row in attempt["history"] if "train/loss" in row]
    _every_step_once(steps)  # `wandb sync` of both offline folders makes one run with no gap and no repeat
    last = attempts[-1]["history"][-1]
    assert last["eval/accuracy"] == pytest.approx(metrics(run)["eval/accuracy"])
    assert attempts[0]["config"]["trainer"]["num_processes"] == 2
    final = attempts[-1]["artifacts"]
    assert {(a["type"], tuple(a["files"])) for a in final} >= {("file", ("metrics.json",))}
    assert any(a["type"] == "model" and "model.safetensors" in a["files"] for a in final)


def test_tensorboard_gets_every_step_once_across_the_resume(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, _ = tracked
    steps = []
    for events in sorted((run / "logs").glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        steps += [event.step for event in accumulator.Scalars("train/loss")]
    _every_step_once(steps)


def test_own_tracker_gets_every_call_and_a_failing_one_is_warned_about_once(tracked):
    base, run, stderr = tracked
    lines = [json.loads(line) for line in (base / "file.jsonl").read_text().splitlines()]
    started = [line for line in lines if "seed" in line]  # by each attempt: in the helper, then in the worker
    assert [line["seed"] for line in started] == [42, 42] and started[0]["process"] == "runner-trackers"
    worker = started[1]["process"]
    assert worker != "runner-trackers"
    assert sum(line == {"finished": True} for line in lines) == 2
    logged = [line for line in lines if "train/loss" in line]
    _every_step_once([line["step"] for line in logged])
    assert {line["where"] for line in logged if line["step"] <= CUT} == {"runner-trackers/MainThread"}
    assert {line["where"] for line in logged if line["step"] > CUT} == {f"{worker}/runner-trackers"}  # the thread
    warning = "The broken tracker failed (ConnectionError: the server went away) and logs nothing more in this run"
    log = (run / "run.log").read_text()
    assert log.count(warning) == 2 and stderr.count(warning) == 2  # once per attempt, and nothing else broke
    assert "Traceback" not in stderr
    final = metrics(run)
    assert final["step"] == END and math.isfinite(final["eval/loss"])  # metrics.json is complete


def _contents(run) -> dict[str, str]:
    """Every file of the run folder but its log, by its path in the folder: its digest."""
    import hashlib

    files = (path for path in sorted(run.rglob("*")) if path.is_file() and path.name != "run.log")
    return {str(path.relative_to(run)): hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def test_runner_eval_stopped_by_sigterm_says_so_and_leaves_the_run_as_it_was(tracked):
    import os
    import signal
    import time

    from tests.preloaded import start_module

    base, run, _ = tracked
    before, log = _contents(run), (run / "run.log").read_text()
    # All of the test split in small batches: the evaluation runs for seconds, so the signal comes during it.
    evaluation = start_module(
        "runner", "eval", str(run), 'data.eval_split="test[:10000]"', "data.eval_batch_size=64",
        cwd=base, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while "Resumed at step" not in (run / "run.log").read_text()[len(log) :]:  # the evaluation starts next
        assert evaluation.poll() is None, evaluation.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the evaluation never started"
        time.sleep(0.1)
    evaluation.send_signal(signal.SIGTERM)
    _, stderr = evaluation.communicate(timeout=120)
    assert evaluation.returncode == 75, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        f"runner: evaluation stopped by SIGTERM; the run in {run} is as it was (no eval-*.json was written); run the "
        "same runner eval command again to evaluate it (exit code 75)."
    )
    assert "Traceback" not in stderr
    assert _contents(run) == before and not list(run.glob("eval-*"))
    assert (run / "run.log").read_text().startswith(log)  # what the evaluation logged is added, nothing replaced

    # A signal during the checks, once the evaluation holds the folder and before any worker starts: the same.
    log = (run / "run.log").read_text()
    evaluation = start_module("runner", "eval", str(run), cwd=base, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lock = run / ".runner.lock"
    while f'"pid": {evaluation.pid},' not in lock.read_text():
        assert evaluation.poll() is None, evaluation.communicate()[1][-3000:]
        assert time.monotonic() < deadline + 120, "the evaluation never took the folder"
        time.sleep(0.01)
    evaluation.send_signal(signal.SIGTERM)
    _, stderr = evaluation.communicate(timeout=120)
    assert evaluation.returncode == 75, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("runner: evaluation stopped by SIGTERM; the run in")
    assert "Traceback" not in stderr
    assert _contents(run) == before and not list(run.glob("eval-*"))
    assert (run / "run.log").read_text().startswith(log)


def test_tracker_settings_that_cannot_work_are_one_sentence_before_launch(tracked, tmp_path):
    from tests.e2e.conftest import run_cli_refusals

    base, _, _ = tracked
    common = [*mnist_args("test[:64]", "test[9990:]"), "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"]
    refused = run_cli_refusals(
        [
            [*common, "+tracker.file._target_=my_trackers.FileTracker"],  # its constructor needs a path
            [*common, "tracker=mlflow", "tracker.mlflow.tracking_uri='ftp://host/x'"],
            [*common, "tracker=mlflow", "tracker.mlflow.tracking_uri=5"],
            [*common, "tracker=mlflow", "tracker.mlflow.tracking_uri='sqlite:////proc/nope/x.db'"],
        ],
        cwd=base,
    )
    uris = (
        "use sqlite:///<file>.db, http(s)://<server>, databricks, file:<folder>, a database URL (postgresql://...), "
        "or null for sqlite:///<run folder>/mlflow.db."
    )
    assert [(result["returncode"], result["stderr"].strip().splitlines()[-1]) for result in refused] == [
        (2, "runner: error: tracker.file: my_trackers.FileTracker requires path, which the node does not set (no "
            "default); set it in the node, e.g. +tracker.file.path=..."),
        (2, "runner: error: tracker.mlflow.tracking_uri=ftp://host/x is not a tracking URI (MLflow has no store for "
            f"the scheme ftp); {uris}"),
        (2, f"runner: error: tracker.mlflow.tracking_uri=5 is not a tracking URI (it has no scheme); {uris}"),
        (2, "runner: error: tracker.mlflow.tracking_uri=sqlite:////proc/nope/x.db: the folder /proc/nope does not "
            "exist and cannot be made in /proc (No such file or directory); choose a folder this user can write, or "
            "leave tracking_uri null for a SQLite file in the run folder."),
    ]  # fmt: skip
    assert not any("Traceback" in result["stderr"] for result in refused)
    assert not (tmp_path / "run" / "metrics.json").exists()  # nothing ran
