"""Tests of runner/engine/tracking.py: build_trackers, the JSON-lines tracker and the TensorBoard tracker."""

from __future__ import annotations

import json

import pytest
import torch

from runner.engine.tracking import GeneralTracker, JSONLTracker, TensorBoardTracker, build_trackers


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


def test_build_trackers_all_and_none(tmp_path):
    assert build_trackers(None, run_name="run", logging_dir=tmp_path) == []
    trackers = build_trackers("all", run_name="run", logging_dir=tmp_path)
    try:
        assert sorted(t.name for t in trackers) == ["jsonl", "tensorboard"]
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
    assert "['jsonl', 'tensorboard']" in str(info.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["jsonl", "tensorboard"])
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
    first.log({"x": 1}, step=1)
    first.finish()
    second = JSONLTracker("run", tmp_path)
    second.log({"x": 2}, step=2)
    second.finish()
    assert [(r["step"], r["x"]) for r in _read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [(1, 1), (2, 2)]


def test_jsonl_store_init_configuration(tmp_path):
    tracker = JSONLTracker("run", tmp_path)
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
