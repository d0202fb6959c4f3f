"""Tests of runner/engine/tracking/ (build_trackers, every tracker, register_tracker_class), of the
trackers' background thread (runner/engine/tracking/thread.py) and of their helper process
(runner/engine/tracking/process.py)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from runner.engine import Accelerator
from runner.engine.tracking import (
    TRACKERS,
    CSVTracker,
    GeneralTracker,
    JSONLTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    build_trackers,
    register_tracker_class,
)
from runner.engine.tracking.process import TrackerProcess, helper_cpu
from runner.engine.tracking.thread import TrackerThread
from tests.wandb_records import offline_runs, read_run


def _read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _accumulator(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory))
    accumulator.Reload()
    return accumulator


# ---------------------------------------------------------------------------------------------- build_trackers


def test_build_trackers_by_name(tmp_path):
    trackers = build_trackers(["jsonl", "TensorBoard"], run_name="run", logging_dir=tmp_path)
    try:
        assert [type(t) for t in trackers] == [JSONLTracker, TensorBoardTracker]
    finally:
        for tracker in trackers:
            tracker.finish()


def test_build_trackers_all_and_none(tmp_path, monkeypatch):
    assert build_trackers(None, run_name="run", logging_dir=tmp_path) == []
    # "all": every tracker whose library is installed (the dev extra installs MLflow and W&B), as Accelerate's.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    trackers = build_trackers("all", run_name="run", logging_dir=tmp_path)
    try:
        assert sorted(t.name for t in trackers) == ["csv", "jsonl", "mlflow", "tensorboard", "wandb"]
    finally:
        for tracker in trackers:
            tracker.finish()


def test_build_trackers_passes_tracker_instances_through():
    class Memory(GeneralTracker):
        name = "memory"

        def __init__(self):
            self.logged = []

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, values))

    mine = Memory()
    # No logging directory is needed for a tracker that is already built.
    assert build_trackers([mine], run_name="run", logging_dir=None) == [mine]


def test_build_trackers_unknown_name_raises(tmp_path):
    with pytest.raises(ValueError, match=r"log_with='wandbx' is not a known tracker") as info:
        build_trackers("wandbx", run_name="run", logging_dir=tmp_path)
    assert "['csv', 'jsonl', 'mlflow', 'tensorboard', 'wandb']" in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["jsonl", "tensorboard", "csv"])
def test_build_trackers_needs_logging_dir(name):
    with pytest.raises(ValueError, match=f"The {name} tracker needs a logging directory"):
        build_trackers(name, run_name="run", logging_dir=None)


def test_build_trackers_passes_init_kwargs(tmp_path):
    (tracker,) = build_trackers(
        "tensorboard", run_name="run", logging_dir=tmp_path, init_kwargs={"tensorboard": {"filename_suffix": ".xyz"}}
    )
    tracker.finish()
    events = list((tmp_path / "run").iterdir())
    assert len(events) == 1
    assert events[0].name.startswith("events.out.tfevents.")
    assert events[0].name.endswith(".xyz")


# ---------------------------------------------------------------------------------------------- JSONL


def test_jsonl_one_line_per_log_call(tmp_path):
    (tracker,) = build_trackers("jsonl", run_name="exp1", logging_dir=tmp_path)
    tracker.log({"loss": torch.tensor(0.5), "lr": 1e-3, "epoch": 2}, step=10)
    tracker.log({"loss": torch.tensor([0.25]), "done": True, "note": "warmup over"}, step=11)
    tracker.log({"acc": 0.75})
    tracker.finish()

    path = tmp_path / "exp1" / "metrics.jsonl"
    assert tracker.path == path
    records = _read_jsonl(path)
    assert len(records) == 3
    first, second, third = records

    assert first["step"] == 10
    assert first["loss"] == 0.5 and isinstance(first["loss"], float)
    assert first["lr"] == 1e-3
    assert first["epoch"] == 2 and isinstance(first["epoch"], int)
    assert isinstance(first["time"], float)

    assert second["step"] == 11
    assert second["loss"] == 0.25  # a one-element tensor becomes a number
    assert second["done"] == 1
    assert second["note"] == "warmup over"

    assert third["step"] is None
    assert third["acc"] == 0.75
    assert set(third) == {"step", "time", "acc"}


def test_jsonl_appends_across_trackers(tmp_path):
    first = JSONLTracker("run", tmp_path)
    first.start()  # a tracker built by hand is started by hand (init_trackers starts those it is given)
    first.log({"x": 1}, step=1)
    first.finish()
    second = JSONLTracker("run", tmp_path)
    second.start()
    second.log({"x": 2}, step=2)
    second.finish()
    assert [(r["step"], r["x"]) for r in _read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [(1, 1), (2, 2)]


def test_jsonl_store_init_configuration(tmp_path):
    tracker = JSONLTracker("run", tmp_path)
    tracker.start()
    config = {"lr": 0.1, "optimizer": {"name": "adam", "betas": [0.9, 0.99]}, "device": torch.device("cpu")}
    tracker.store_init_configuration(config)
    tracker.finish()
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored == {"lr": 0.1, "optimizer": {"name": "adam", "betas": [0.9, 0.99]}, "device": "cpu"}


# ---------------------------------------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars_read_back(tmp_path):
    (tracker,) = build_trackers("tensorboard", run_name="tb_run", logging_dir=tmp_path)
    assert tracker.logging_dir == tmp_path / "tb_run"
    tracker.log({"loss": torch.tensor(0.5), "acc": 3}, step=7)
    tracker.log({"loss": 0.25, "note": "hello"}, step=8)
    tracker.finish()

    run_dir = tmp_path / "tb_run"
    events = [p for p in run_dir.iterdir() if p.name.startswith("events.out.tfevents.")]
    assert len(events) == 1

    accumulator = _accumulator(run_dir)
    assert sorted(accumulator.Tags()["scalars"]) == ["acc", "loss"]
    assert [(e.step, e.value) for e in accumulator.Scalars("loss")] == [(7, 0.5), (8, 0.25)]
    assert [(e.step, e.value) for e in accumulator.Scalars("acc")] == [(7, 3.0)]
    assert "note/text_summary" in accumulator.Tags()["tensors"]


def test_tensorboard_store_init_configuration_writes_hparams(tmp_path):
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    tracker = TensorBoardTracker("hp", tmp_path)
    tracker.start()
    tracker.store_init_configuration({"lr": 0.1, "optimizer": {"name": "adam", "betas": (0.9, 0.99)}})
    tracker.log({"eval/accuracy": 0.5, "train/loss": 2.0}, step=1)
    tracker.log({"eval/accuracy": 0.75, "note": "text is not a metric"}, step=2)
    tracker.finish()

    accumulator = _accumulator(tmp_path / "hp")
    content = accumulator.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in content
    assert "_hparams_/session_start_info" in content
    assert accumulator.SummaryMetadata("_hparams_/experiment").plugin_data.plugin_name == "hparams"

    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    # Nested keys are flattened with dots; values that are not scalars are stored as text.
    assert sorted(hparams) == ["lr", "optimizer.betas", "optimizer.name"]
    assert hparams["lr"].number_value == pytest.approx(0.1)
    assert hparams["optimizer.name"].string_value == "adam"
    assert hparams["optimizer.betas"].string_value == "(0.9, 0.99)"
    # The full config is also logged as text.
    assert "config/text_summary" in accumulator.Tags()["tensors"]
    # At the end, the experiment declares every logged scalar as a metric (the tab shows its last value)...
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert sorted(info.name.tag for info in experiment.metric_infos) == ["eval/accuracy", "train/loss"]
    assert sorted(info.name for info in experiment.hparam_infos) == ["lr", "optimizer.betas", "optimizer.name"]
    assert [(e.step, e.value) for e in accumulator.Scalars("eval/accuracy")][-1] == (2, 0.75)
    # ...and the session as finished.
    end = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_end_info"]).session_end_info
    assert end.status == api_pb2.STATUS_SUCCESS


# ---------------------------------------------------------------------------------------------- CSV


def _csv_rows(path) -> list[dict]:
    import csv

    with path.open(newline="") as file:
        return [{key: value for key, value in row.items() if value} for row in csv.DictReader(file)]


def test_csv_adds_a_column_per_new_metric_and_a_continued_file_replaces_the_steps_logged_again(tmp_path):
    first = CSVTracker("", tmp_path)
    first.start()
    first.log({"loss": torch.tensor(1.0), "note": "text is not a number"}, step=1)
    first.log_records([({"loss": 0.5}, 2, {}), ({"acc": 0.1, "nested": {"a": 1}}, 2, {}), ({"loss": 0.25}, 3, {})])
    # No finish: the attempt died after step 3, and its checkpoint is at step 2.
    path = tmp_path / "metrics.csv"
    assert path.read_text().splitlines()[0] == "step,loss,acc"  # the header widened once, when acc came
    second = CSVTracker("", tmp_path)
    second.start()
    second.log({"loss": 0.3}, step=3)  # the resumed run logs step 3 again: the earlier row is replaced
    second.log({"loss": 0.2, "lr": 1e-3}, step=4)
    second.finish()
    assert _csv_rows(path) == [
        {"step": "1", "loss": "1.0"}, {"step": "2", "loss": "0.5"}, {"step": "2", "acc": "0.1"},
        {"step": "3", "loss": "0.3"}, {"step": "4", "loss": "0.2", "lr": "0.001"},
    ]  # fmt: skip


def test_csv_keeps_a_file_that_is_not_its_own(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,accuracy\n1,0.5\n")
    tracker = CSVTracker("", tmp_path)
    tracker.start()
    tracker.log({"loss": 2.0}, step=1)
    tracker.finish()
    assert (tmp_path / "metrics.csv.old").read_text() == "epoch,accuracy\n1,0.5\n"
    assert _csv_rows(tmp_path / "metrics.csv") == [{"step": "1", "loss": "2.0"}]


# ---------------------------------------------------------------------------------------------- MLflow


def test_mlflow_logs_params_steps_text_and_artifacts_into_its_sqlite_store_and_continues_a_run(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MLflowTracker("exp", logging_dir=tmp_path / "artifacts", run_name="first", tags={"team": "a"},
                            tracking_uri=uri)  # fmt: skip
    tracker.start()
    tracker.store_init_configuration({"lr": 0.1, "model": {"hidden": 8, "kind": "mlp"}, "tags": [1, 2]})
    tracker.log_records([({"loss": torch.tensor(2.0)}, 1, {}), ({"loss": 1.5, "eval": {"acc": 0.5}}, 2, {})])
    tracker.log({"samples": "to be or not"}, step=2)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"0123")
    (tmp_path / "metrics.json").write_text("{}")
    tracker.log_artifact(tmp_path / "model")
    tracker.log_artifact(tmp_path / "metrics.json")
    tracker.finish()

    client = MlflowClient(uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first" and run.data.tags["team"] == "a"
    assert run.data.params == {"lr": "0.1", "model.hidden": "8", "model.kind": "mlp", "tags": "[1, 2]"}
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss")] == [(1, 2.0), (2, 1.5)]
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "eval.acc")] == [(2, 0.5)]
    listed = {entry.path for entry in client.list_artifacts(tracker.run_id)}
    assert listed == {"metrics.json", "model", "samples"}
    assert [entry.path for entry in client.list_artifacts(tracker.run_id, "model")] == ["model/weights.bin"]
    assert (tmp_path / "artifacts").is_dir()  # a new experiment keeps its artifacts where logging_dir says

    # A resume: the same run goes on; steps it has are not logged twice, a changed param becomes a tag.
    again = MLflowTracker("exp", run_id=tracker.run_id, tracking_uri=uri)
    again.start()
    assert client.get_run(tracker.run_id).info.status == "RUNNING"
    again.store_init_configuration({"lr": 0.2, "model": {"hidden": 8, "kind": "mlp"}, "seed": 3})
    again.log_records([({"loss": 9.0}, 2, {}), ({"loss": 1.0}, 3, {})])
    again.finish()
    run = client.get_run(tracker.run_id)
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss")] == [
        (1, 2.0), (2, 1.5), (3, 1.0)
    ]  # fmt: skip
    assert run.data.params["lr"] == "0.1" and run.data.params["seed"] == "3"
    assert run.data.tags["changed_on_resume.lr"] == "0.2" and run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_mlflow_runs_of_one_group_go_under_one_parent(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    children = []
    for name in ("job-0", "job-1"):
        tracker = MLflowTracker("exp", run_name=name, tracking_uri=uri, group="sweep-7", store_lock=tmp_path / "lock")
        tracker.start()
        tracker.finish()
        children.append(tracker)
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    (parent,) = [run for run in runs if run.data.tags.get("runner.group") == "sweep-7"]
    assert parent.info.run_name == "sweep-7" and parent.info.status == "FINISHED"
    assert {child.parent_run_id for child in children} == {parent.info.run_id}
    assert sorted(run.data.tags.get("mlflow.parentRunId") for run in runs if run is not parent) == [
        parent.info.run_id
    ] * 2  # fmt: skip


def _start_in_group(uri, lock, name, barrier, parents):
    tracker = MLflowTracker("exp", run_name=name, tracking_uri=uri, group="sweep-7", store_lock=lock)
    barrier.wait()  # all at once, on a database file that does not exist yet
    tracker.start()
    tracker.finish()
    parents.put(tracker.parent_run_id)


def test_mlflow_runs_starting_at_once_on_a_new_sqlite_file_make_its_tables_and_their_parent_once(tmp_path):
    """A sweep's parallel jobs: without the lock, MLflow's table creation ran in each and one failed
    ('duplicate column name', or an alembic version mismatch)."""
    import multiprocessing

    from mlflow import MlflowClient

    uri, lock = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "mlflow.db.lock"
    context = multiprocessing.get_context("fork")
    barrier, parents = context.Barrier(3), context.Queue()
    jobs = [context.Process(target=_start_in_group, args=(uri, lock, f"job-{i}", barrier, parents)) for i in range(3)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=120)
    assert [job.exitcode for job in jobs] == [0, 0, 0]
    found = {parents.get(timeout=10) for _ in jobs}
    runs = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("exp").experiment_id])
    assert len(found) == 1 and len(runs) == 4  # one parent, three jobs


def test_mlflow_nested_run_goes_under_the_run_active_in_this_process(tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    try:
        with mlflow.start_run(run_name="outer") as outer:
            inner = MLflowTracker("Default", nested_run=True, tracking_uri=uri)
            inner.start()
            inner.finish()
        assert inner.parent_run_id == outer.info.run_id
        assert mlflow.MlflowClient(uri).get_run(inner.run_id).data.tags["mlflow.parentRunId"] == outer.info.run_id
    finally:
        mlflow.set_tracking_uri(None)


@pytest.fixture
def store_loggers_restored():
    """The loggers MLflowTracker.start reroutes (MLflow's, SQLAlchemy's, ...), as they were before the test."""
    from runner.engine.tracking.services import STORE_LOGGERS

    def ours() -> dict[str, logging.Logger]:
        names = [name for name in logging.root.manager.loggerDict if name.split(".")[0] in STORE_LOGGERS]
        return {name: logging.getLogger(name) for name in {*STORE_LOGGERS, *names}}

    saved = {name: (list(logger.handlers), logger.propagate) for name, logger in ours().items()}
    yield
    for name, logger in ours().items():
        logger.handlers, logger.propagate = saved.get(name, ([], True))


def _read_only_mlflow_store(tmp_path) -> str:
    """An MLflow SQLite store this process opens but cannot write (SQLite's read-only mode): every write fails
    with SQLAlchemy's OperationalError, as on a file whose permissions or disk went away."""
    from mlflow import MlflowClient

    database = tmp_path / "mlflow.db"
    MlflowClient(f"sqlite:///{database}").create_experiment("exp")  # its tables, written before it goes read-only
    return f"sqlite:///file:{database}?mode=ro&uri=true"


@pytest.mark.parametrize("helper", [TrackerThread, TrackerProcess])
def test_a_failing_mlflow_store_is_one_warning_on_the_console_and_its_traceback_goes_to_the_log_file(
    tmp_path, helper, capfd, store_loggers_restored, monkeypatch
):
    uri = _read_only_mlflow_store(tmp_path)
    monkeypatch.chdir(tmp_path)  # MLflow makes a folder named after the URI's "file:/..." path, relative to here
    root = logging.getLogger()
    log_file, console = logging.FileHandler(tmp_path / "run.log"), logging.StreamHandler(sys.stderr)
    root.addHandler(log_file)
    root.addHandler(console)
    capfd.readouterr()
    try:
        trackers = helper([MLflowTracker("exp", tracking_uri=uri)])
        trackers.call("start")
        trackers.log({"loss": 1.0}, 1, None)
        trackers.close()
    finally:
        root.removeHandler(console)
        root.removeHandler(log_file)
        log_file.close()
    assert capfd.readouterr().err.splitlines() == [
        "The mlflow tracker failed (MlflowException: (sqlite3.OperationalError) attempt to write a readonly database) "
        "and logs nothing more in this run; training goes on, and metrics.json and the other trackers keep every value."
    ]  # MLflow's own report of it, with SQLAlchemy's traceback (some 90 lines), printed before it until now
    logged = (tmp_path / "run.log").read_text()
    assert "Traceback (most recent call last)" in logged and "SQLAlchemy database error" in logged
    assert logged.rstrip().endswith("the other trackers keep every value.")


# ---------------------------------------------------------------------------------------------- W&B


def test_wandb_offline_run_holds_the_config_history_text_and_artifacts_and_a_resume_keeps_its_id(tmp_path):
    kwargs = {"mode": "offline", "dir": str(tmp_path), "name": "first", "group": "sweep-7"}
    tracker = WandBTracker("project", **kwargs)
    tracker.start()
    tracker.store_init_configuration({"lr": 0.1, "model": {"hidden": 8}})
    for step in (1, 2, 3):
        tracker.log({"loss": 1.0 / step}, step=step)
    tracker.log({"samples": "to be or not"}, step=3)
    (tmp_path / "metrics.json").write_text("{}")
    tracker.log_artifact(tmp_path / "metrics.json")
    run_id = tracker.run_id
    assert tracker.tracker is tracker.run  # what get_tracker("wandb", unwrap=True) gives
    tracker.finish()
    again = WandBTracker("project", **kwargs, id=run_id, resume="allow")
    again.start()
    again.log({"loss": 0.2}, step=4)
    again.finish()

    # W&B's service process writes the offline files; teardown waits for it (in a run, the process's exit does)
    pytest.importorskip("wandb").teardown()
    first, second = (read_run(path) for path in offline_runs(tmp_path))  # both may start within one second
    assert (first["id"], second["id"]) == (run_id, run_id) and first["group"] == "sweep-7"
    assert first["config"]["lr"] == 0.1 and first["config"]["model"] == {"hidden": 8}
    assert [(row["_step"], row["loss"]) for row in first["history"]] == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert first["history"][-1]["samples"] == "to be or not"
    assert [(a["type"], a["files"]) for a in first["artifacts"]] == [("file", ["metrics.json"])]
    assert [(row["_step"], row["loss"]) for row in second["history"]] == [(4, 0.2)]


# ---------------------------------------------------------------------------------------------- the thread


class Memory(GeneralTracker):
    name = "memory"

    def __init__(self, name="memory", fail_at=None):
        super().__init__()
        self.name, self.fail_at, self.logged, self.calls = name, fail_at, [], []

    def log(self, values, step=None, **kwargs):
        if self.fail_at is not None and step >= self.fail_at:
            raise ConnectionError("the server went away\nsecond line")
        self.logged.append((step, values, kwargs))

    def log_artifact(self, local_path, artifact_path=None):
        self.calls.append(("artifact", local_path, artifact_path))

    def finish(self):
        self.calls.append(("finish",))


def test_the_tracker_thread_calls_every_tracker_in_order_and_drops_one_that_fails_with_one_warning(caplog):
    good, bad = Memory(), Memory("flaky", fail_at=3)
    thread = TrackerThread([good, bad])
    loss = torch.tensor(1.0)
    for step in range(1, 6):
        thread.log({"loss": loss, "note": "x"}, step, {"memory": {"extra": step}})
        loss.add_(1.0)  # read when logged: the thread sees 1.0, 2.0, ... whatever the tensor holds later
    thread.log_artifact("model", "model", ["memory"])
    thread.close()
    assert [(step, values["loss"]) for step, values, _ in good.logged] == [(s, float(s)) for s in range(1, 6)]
    assert [kwargs for _, _, kwargs in good.logged] == [{"extra": s} for s in range(1, 6)]
    assert [step for step, _, _ in bad.logged] == [1, 2]
    assert good.calls == [("artifact", "model", "model"), ("finish",)] and bad.calls == []
    warnings = [r.getMessage() for r in caplog.records if "tracker failed" in r.getMessage()]
    assert warnings == [
        "The flaky tracker failed (ConnectionError: the server went away) and logs nothing more in this run; "
        "training goes on, and metrics.json and the other trackers keep every value."
    ]
    assert thread.trackers == []


def test_register_tracker_class_lets_log_with_name_it_and_the_accelerator_runs_it(tmp_path):
    class Registered(Memory):
        name = "registered"

        def __init__(self, run_name):  # a named tracker is built as Accelerate builds it: cls(project_name, ...)
            super().__init__("registered")
            self.run_name = run_name

    with pytest.raises(ValueError, match="takes a GeneralTracker subclass"):
        register_tracker_class(dict)
    with pytest.raises(ValueError, match="needs a name of its own"):
        register_tracker_class(type("Nameless", (Memory,), {"name": "general"}))
    register_tracker_class(Registered)
    try:
        accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with=["registered", "csv"])
        accelerator.init_trackers("", config={"lr": 0.1})
        accelerator.log({"loss": torch.tensor(0.5)}, step=1)
        mine = accelerator.get_tracker("registered")  # waits until what was logged has reached it
        assert isinstance(mine, Registered) and mine.logged == [(1, {"loss": 0.5}, {})]
        assert accelerator.get_tracker("csv", unwrap=True) is accelerator.get_tracker("csv").tracker
        with pytest.raises(ValueError, match="No tracker named 'wandb' was started"):
            accelerator.get_tracker("wandb")
        accelerator.end_training()
        assert mine.calls == [("finish",)] and accelerator.trackers == []
        assert _csv_rows(tmp_path / "metrics.csv") == [{"step": "1", "loss": "0.5"}]
    finally:
        del TRACKERS["registered"]


# ------------------------------------------------------------------------------------- the helper process


class Journal(GeneralTracker):
    """Writes every call to a JSON-lines file: the test reads what the helper process did."""

    name = "journal"

    def __init__(self, path, name="journal", fail_at=None):
        super().__init__()
        self.path, self.name, self.fail_at = str(path), name, fail_at
        self.pid = None

    def _write(self, *entry):
        with open(self.path, "a") as file:  # a tensor as its type, device and values
            file.write(json.dumps(entry, default=lambda t: [type(t).__name__, str(t.device), t.tolist()]) + "\n")

    def start(self):
        self.pid = os.getpid()
        self.run_id = f"run-{self.name}"
        self._write("start", self.pid)

    def store_init_configuration(self, values):
        self._write("config", values)

    def log(self, values, step=None, **kwargs):
        if self.fail_at is not None and step >= self.fail_at:
            raise ConnectionError("the server went away\nsecond line")
        self._write("log", step, values, kwargs)

    def log_artifact(self, local_path, artifact_path=None):
        self._write("artifact", str(local_path), artifact_path)

    def finish(self):
        self._write("finish")


def _journal(path) -> list[list]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_helper_of_a_nodes_only_process_keeps_to_its_last_cpu():
    assert helper_cpu({0, 1, 2, 3}, "") == 3 and helper_cpu({4, 9, 6}, "1") == 9
    assert helper_cpu({0, 1, 2, 3}, "2") is None  # beside another rank: left to the scheduler
    assert helper_cpu({3}, "1") is None  # one CPU: nothing to keep apart


def test_the_helper_process_calls_every_tracker_in_order_drops_one_that_fails_and_finishes_them(tmp_path, caplog):
    good, bad = Journal(tmp_path / "good.jsonl"), Journal(tmp_path / "bad.jsonl", "flaky", fail_at=3)
    accelerator = Accelerator(cpu=True, project_dir=tmp_path, log_with=[good, bad], tracker_process=True)
    accelerator.init_trackers("", config={"lr": 0.1})
    child = accelerator._tracker_thread._child
    assert isinstance(accelerator._tracker_thread, TrackerProcess) and child.is_alive()
    loss = torch.tensor(1.0)
    for step in range(1, 6):
        accelerator.log({"loss": loss, "note": "x"}, step=step, log_kwargs={"journal": {"extra": step}})
        loss.add_(1.0)  # read when logged: the helper sees 1.0, 2.0, ... whatever the tensor holds later
    tracker = accelerator.get_tracker("journal")  # waits until the helper took every step
    assert tracker.name == "journal" and tracker.run_id == "run-journal" and tracker.pid == child.pid != os.getpid()
    allowed = os.sched_getaffinity(0)  # the helper keeps to one CPU, the last, where there are several
    assert os.sched_getaffinity(child.pid) == ({max(allowed)} if len(allowed) > 1 else allowed)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        getattr(tracker, "nothing")  # noqa: B009 asked of the helper, which has no such attribute either
    with pytest.raises(ValueError, match=r"The journal tracker runs in the trackers' helper process, so its library "):
        accelerator.get_tracker("journal", unwrap=True)
    tracker.log({"direct": 1}, step=9)  # this tracker only
    accelerator.log_artifact(tmp_path / "model", "model", trackers=["journal"])
    assert [t.name for t in accelerator.trackers] == ["journal"]  # the flaky one failed at step 3
    accelerator.end_training()
    assert accelerator.trackers == [] and not child.is_alive() and child.exitcode == 0
    assert _journal(tmp_path / "good.jsonl") == [
        ["start", child.pid],
        ["config", {"lr": 0.1}],
        *[["log", s, {"loss": float(s), "note": "x"}, {"extra": s}] for s in range(1, 6)],
        ["log", 9, {"direct": 1}, {}],
        ["artifact", str(tmp_path / "model"), "model"],
        ["finish"],
    ]
    assert [entry[:2] for entry in _journal(tmp_path / "bad.jsonl")] == [
        ["start", child.pid], ["config", {"lr": 0.1}], ["log", 1], ["log", 2]
    ]  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if "tracker failed" in r.getMessage()]
    assert warnings == [
        "The flaky tracker failed (ConnectionError: the server went away) and logs nothing more in this run; "
        "training goes on, and metrics.json and the other trackers keep every value."
    ]


def test_the_helper_process_ignores_sigterm_hands_over_a_backlog_and_a_lost_helper_is_one_warning(
    tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(TrackerProcess, "interval", 3600.0)  # the sender never wakes: only the backlog hands over
    monkeypatch.setattr(TrackerProcess, "backlog", 4)
    accelerator = Accelerator(
        cpu=True, project_dir=tmp_path, log_with=[Journal(tmp_path / "j.jsonl")], tracker_process=True
    )
    accelerator.init_trackers("")
    child = accelerator._tracker_thread._child
    os.kill(child.pid, signal.SIGTERM)  # a preemption notice to the whole job: the training decides
    for step in range(10):
        accelerator.log({"loss": step}, step=step)
    deadline = time.monotonic() + 30
    while len(logged := [e[1] for e in _journal(tmp_path / "j.jsonl") if e[0] == "log"]) < 10:
        assert time.monotonic() < deadline, logged
        time.sleep(0.01)
    assert logged == list(range(10))  # the 5th and 10th calls found 5 waiting, over the backlog of 4, and sent them
    assert child.is_alive()
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    accelerator.log({"loss": 10}, step=10)
    with pytest.raises(ValueError, match=r"No tracker named 'journal' was started; trackers: \[\]"):
        accelerator.get_tracker("journal")  # its flush finds the helper gone
    accelerator.log({"loss": 11}, step=11)  # no tracker left: nothing to do
    accelerator.end_training()
    warnings = [r.getMessage() for r in caplog.records if "tracker failed" in r.getMessage()]
    assert warnings == [
        "The journal tracker failed (the trackers' helper process ended, exit code -9) and logs nothing more in "
        "this run; training goes on, and metrics.json and the other trackers keep every value."
    ]
    assert accelerator.trackers == []


def test_the_helper_gets_a_tensor_as_it_was_when_logged_and_a_value_it_cannot_receive_is_left_out_once(
    tmp_path, caplog
):
    accelerator = Accelerator(
        cpu=True, project_dir=tmp_path, log_with=[Journal(tmp_path / "j.jsonl")], tracker_process=True
    )
    accelerator.init_trackers("")
    weights = torch.tensor([1.0, 2.0])
    accelerator.log({"weights": weights, "loss": 0.5}, step=1)
    weights.mul_(10)  # after the log call: the helper still gets [1, 2]
    accelerator.log({"lock": threading.Lock(), "loss": 0.25}, step=2)
    accelerator.log({"lock": threading.Lock(), "loss": 0.125}, step=3)
    images = [torch.ones(2), (torch.zeros(1),)]
    accelerator.log({"images": images}, step=4)
    images[0].add_(1)  # nested in a list: copied when logged too
    accelerator._tracker_thread.flush()
    accelerator.log({"bomb": Unloadable(), "loss": 1.0}, step=5)  # pickles here, cannot be loaded there
    accelerator._tracker_thread.flush()
    accelerator.log({"bomb": Unloadable()}, step=6)  # said once
    accelerator._tracker_thread.flush()
    accelerator.get_tracker("journal").log({"bomb": Unloadable()}, step=6)  # a request: answered all the same
    accelerator.log({"loss": 0.0625}, step=7)
    accelerator.end_training()
    assert [entry[1:3] for entry in _journal(tmp_path / "j.jsonl") if entry[0] == "log"] == [
        [1, {"weights": ["Tensor", "cpu", [1.0, 2.0]], "loss": 0.5}],
        [2, {"loss": 0.25}],
        [3, {"loss": 0.125}],
        [4, {"images": [["Tensor", "cpu", [1.0, 1.0]], [["Tensor", "cpu", [0.0]]]]}],
        [7, {"loss": 0.0625}],
    ]
    warnings = [r.getMessage() for r in caplog.records if "helper process (" in r.getMessage()]
    assert warnings == [
        "accelerator.log's value for 'lock' (a lock) cannot be sent to the trackers' helper process (TypeError: "
        "cannot pickle '_thread.lock' object); such values are left out. Log numbers, text and tensors, or keep "
        "the trackers in this process with tracker_process=False (the runner: trainer.tracker_process=false).",
        "Values sent to the trackers could not be read in their helper process (RuntimeError: this value cannot be "
        "rebuilt); they were left out, and training goes on. Log numbers, text and tensors, or keep the trackers in "
        "this process with tracker_process=False (the runner: trainer.tracker_process=false).",
    ]


def _refuse_to_load():
    raise RuntimeError("this value cannot be rebuilt")


class Unloadable:
    def __reduce__(self):
        return _refuse_to_load, ()


class Stuck(Journal):
    def finish(self):
        time.sleep(3600)  # a library waiting on a server that never answers


def test_a_tracker_that_never_finishes_is_stopped_after_the_timeout_and_the_run_ends(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(TrackerProcess, "finish_timeout", 1.0)
    accelerator = Accelerator(
        cpu=True, project_dir=tmp_path, log_with=[Stuck(tmp_path / "j.jsonl", "stuck")], tracker_process=True
    )
    accelerator.init_trackers("")
    child = accelerator._tracker_thread._child
    accelerator.log({"loss": 1.0}, step=0)
    start = time.monotonic()
    accelerator.end_training()
    assert time.monotonic() - start < 10 and not child.is_alive() and child.exitcode == -signal.SIGKILL
    assert [entry[0] for entry in _journal(tmp_path / "j.jsonl")] == ["start", "log"]
    assert [r.getMessage() for r in caplog.records if "did not finish" in r.getMessage()] == [
        "The trackers did not finish within 1 s (stuck); their helper process was stopped, and what they had not "
        "written yet is lost to them (metrics.json keeps every value)."
    ]


def test_end_training_is_prompt_when_every_tracker_in_the_helper_failed(tmp_path):
    accelerator = Accelerator(
        cpu=True, project_dir=tmp_path, log_with=[Journal(tmp_path / "j.jsonl", fail_at=0)], tracker_process=True
    )
    accelerator.init_trackers("")
    child = accelerator._tracker_thread._child
    accelerator.log({"loss": 1.0}, step=0)
    accelerator._tracker_thread.flush()
    assert accelerator.trackers == [] and child.is_alive()  # the helper has nothing left to call, and waits
    start = time.monotonic()
    accelerator.end_training()
    assert time.monotonic() - start < 10 and child.exitcode == 0
    assert [entry[0] for entry in _journal(tmp_path / "j.jsonl")] == ["start"]  # no finish for a dropped tracker


def test_a_script_that_ends_without_end_training_still_hands_everything_to_the_helper(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {os.getcwd()!r})
        from runner.engine import Accelerator
        from tests.unit.engine.tracking.test_tracking import Journal
        accelerator = Accelerator(cpu=True, log_with=[Journal({str(tmp_path / "j.jsonl")!r})], tracker_process=True)
        accelerator.init_trackers("")
        for step in range(100):
            accelerator.log({{"loss": step}}, step=step)
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    journal = _journal(tmp_path / "j.jsonl")
    assert [entry[1] for entry in journal if entry[0] == "log"] == list(range(100))
    assert journal[-1] == ["finish"]
