"""runner/trackers.py: the keys the launching process fills, and the tracker objects every worker builds."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.trackers import build, check_reachable, settle


def _config(project_dir: Path, **tracker) -> dict:
    return {"project": {"project_dir": str(project_dir)}, "resume": None, "tracker": tracker}


def test_a_sweep_job_gets_the_sweeps_store_and_group_and_is_named_by_its_overrides(tmp_path):
    sweep = tmp_path / "multirun" / "2026-12-03" / "10-00-00"
    mlflow = {"tracking_uri": None, "experiment_name": "runner", "run_name": None, "group": None, "tags": {}}
    wandb = {"project": "runner", "entity": None, "mode": "offline", "dir": None, "name": None, "group": None,
             "tags": []}  # fmt: skip
    config = _config(sweep / "1", tensorboard={}, mlflow=dict(mlflow), wandb=dict(wandb))
    settle(config, sweep / "1", sweep_dir=sweep, job_name="optimizer.lr=0.1")
    assert config["tracker"]["mlflow"] == {**mlflow, "tracking_uri": f"sqlite:///{sweep / 'mlflow.db'}",
                                           "run_name": "optimizer.lr=0.1", "group": "2026-12-03/10-00-00"}  # fmt: skip
    assert config["tracker"]["wandb"] == {**wandb, "dir": str(sweep / "1"), "name": "optimizer.lr=0.1",
                                          "group": "2026-12-03/10-00-00"}  # fmt: skip
    assert config["tracker"]["tensorboard"] == {}

    alone = tmp_path / "outputs" / "2026-12-03" / "11-00-00"
    given = {**mlflow, "tracking_uri": "http://mlflow:5000", "run_name": "mine"}
    config = _config(alone, mlflow=dict(given))
    settle(config, alone, sweep_dir=None, job_name=None)
    assert config["tracker"]["mlflow"] == {**given, "group": None}  # what the user set stays

    config = _config(alone, mlflow=dict(mlflow))
    settle(config, alone, sweep_dir=None, job_name=None)
    assert config["tracker"]["mlflow"]["tracking_uri"] == f"sqlite:///{alone / 'mlflow.db'}"
    assert config["tracker"]["mlflow"]["run_name"] == "2026-12-03/11-00-00"

    trackers = build(OmegaConf.create(config))
    (tracker,) = trackers
    assert (tracker.name, tracker.logging_dir, str(tracker.store_lock)) == (
        "mlflow", str(alone / "mlartifacts"), f"{alone / 'mlflow.db'}.lock"
    )  # fmt: skip
    assert tracker.client is None  # built, not started: every rank builds, the main process starts


def test_a_resumed_run_continues_the_recorded_runs(tmp_path):
    (tmp_path / "trackers.json").write_text('{"mlflow": {"run_id": "abc"}, "wandb": {"run_id": "xyz"}}')
    mlflow = {"tracking_uri": "sqlite:///x.db", "experiment_name": "runner", "run_name": "r", "group": None,
              "tags": {}}  # fmt: skip
    wandb = {"project": "p", "entity": None, "mode": "offline", "dir": str(tmp_path), "name": "r", "group": None,
             "tags": []}  # fmt: skip
    config = OmegaConf.create({**_config(tmp_path, mlflow=mlflow, wandb=wandb), "resume": str(tmp_path)})
    first, second = build(config)
    assert first.run_id == "abc" and second.init_kwargs["id"] == "xyz" and second.init_kwargs["resume"] == "allow"
    config.resume = None  # a new run in the same folder starts new tracked runs
    first, second = build(config)
    assert first.run_id is None and "id" not in second.init_kwargs


def test_wandb_online_without_a_login_is_one_sentence(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "")
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    config = OmegaConf.create({"tracker": {"wandb": {"mode": "online"}}})
    with pytest.raises(ConfigError, match=r"^tracker=wandb in mode online needs a W&B login: run `wandb login`"):
        check_reachable(config)
    config.tracker.wandb.mode = "offline"
    check_reachable(config)  # offline needs nothing
