"""runner/training/tracker_setup.py: the keys the launching process fills, and the tracker objects every worker
builds."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.config import ConfigError
from runner.folders.provenance import sign
from runner.training.tracker_setup import build, check_reachable, settle


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
    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    checkpoint.mkdir(parents=True)
    for name in ("config.yaml", "overrides.yaml", "manifest.json"):
        (checkpoint / name).write_text("{}\n")
    config = OmegaConf.create({**_config(tmp_path, mlflow=mlflow, wandb=wandb), "resume": str(checkpoint)})
    first, second = build(config)
    assert first.run_id is None and "id" not in second.init_kwargs  # not signed by you: not yours to continue
    sign(checkpoint)
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


def _mlflow_at(uri: str):
    return OmegaConf.create({"tracker": {"mlflow": {"tracking_uri": uri}}})


_NULL = "leave tracking_uri null for a SQLite file in the run folder."


def test_a_sqlite_file_whose_folder_cannot_be_made_is_one_sentence_before_launch():
    with pytest.raises(ConfigError) as info:
        check_reachable(_mlflow_at("sqlite:////proc/nope/x.db"))
    assert str(info.value) == (
        "tracker.mlflow.tracking_uri=sqlite:////proc/nope/x.db: the folder /proc/nope does not exist and cannot be "
        f"made in /proc (No such file or directory); choose a folder this user can write, or {_NULL}"
    )


def test_a_sqlite_file_under_a_file_is_one_sentence(tmp_path):
    (tmp_path / "plain").write_text("")
    with pytest.raises(ConfigError) as info:
        check_reachable(_mlflow_at(f"sqlite:///{tmp_path}/plain/runs/mlflow.db"))
    assert str(info.value) == (
        f"tracker.mlflow.tracking_uri=sqlite:///{tmp_path}/plain/runs/mlflow.db: the folder {tmp_path}/plain/runs "
        f"does not exist and cannot be made in {tmp_path}/plain ({tmp_path}/plain is not a folder); choose a folder "
        f"this user can write, or {_NULL}"
    )


@pytest.mark.parametrize(("kind", "what"), [("link", "a link"), ("folder", "not a file")])
def test_a_sqlite_store_that_is_a_link_or_a_folder_is_refused(tmp_path, kind, what):
    store = tmp_path / "mlflow.db"
    if kind == "link":
        (tmp_path / "elsewhere.db").write_bytes(b"")
        store.symlink_to(tmp_path / "elsewhere.db")  # MLflow would write through it
    else:
        store.mkdir()
    with pytest.raises(ConfigError) as info:
        check_reachable(_mlflow_at(f"sqlite:///{store}"))
    assert str(info.value) == (
        f"tracker.mlflow.tracking_uri=sqlite:///{store}: {store} is {what}; point tracking_uri at a SQLite file of its "
        f"own, or {_NULL.replace('leave tracking_uri', 'leave it')}"
    )


def test_a_sqlite_file_in_a_folder_to_be_made_passes_and_nothing_is_made(tmp_path):
    check_reachable(_mlflow_at(f"sqlite:///{tmp_path}/runs/today/mlflow.db"))
    assert list(tmp_path.iterdir()) == []  # MLflow makes the folders when it opens the store


def test_a_folder_store_the_installed_mlflow_refuses_is_one_sentence(tmp_path, monkeypatch):
    if not hasattr(pytest.importorskip("mlflow.environment_variables"), "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow opens folder stores without MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError) as info:
        check_reachable(_mlflow_at(f"file://{tmp_path}/mlruns"))
    assert str(info.value) == (
        f"tracker.mlflow.tracking_uri=file://{tmp_path}/mlruns: the installed MLflow no longer opens a folder store "
        "unless MLFLOW_ALLOW_FILE_STORE=true is set; set it, or use sqlite:///<file>.db (or leave tracking_uri null "
        "for a SQLite file in the run folder)."
    )
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_reachable(_mlflow_at(f"file://{tmp_path}/mlruns"))
