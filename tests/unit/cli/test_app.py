"""runner.cli.app.main on a composed config, in this process: it settles the run once, trains, returns the objective."""

import dataclasses
import json
import logging
import pickle

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import ReadonlyConfigError

from runner.cli.app import main
from runner.config import CONF_DIR, register_configs
from runner.config import run_spec as run_specs
from runner.config.run_spec import LaunchShape
from runner.engine.checkpoint import loading
from runner.engine.launch_environment import LaunchEnvironment
from runner.launch import elastic
from tests.shared_data import MNIST, needs_mnist


def _main(tmp_path, *extra: str) -> float:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    register_configs()
    overrides = [
        f"data.root={MNIST}", 'data.train_split="test[:256]"', 'data.eval_split="test[9900:]"',
        "trainer.max_steps=4", f"project.project_dir={tmp_path}", "tracker=none", *extra,
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    try:
        return main(cfg)
    finally:  # the worker configures this process's logging as a run would; undo it
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)


@needs_mnist
def test_main_settles_the_run_once_and_the_worker_trains_it_as_settled(tmp_path, monkeypatch):
    validated, specs, hashed = [], [], []
    real_validate, real_launch, real_mismatch = run_specs.validate, elastic.launch, loading.first_mismatch
    monkeypatch.setattr(
        run_specs, "validate", lambda cfg, overrides: validated.append(1) or real_validate(cfg, overrides)
    )

    def launch(spec):
        specs.append(spec)
        validated.append("launch")
        monkeypatch.setattr(loading, "first_mismatch", lambda *a: hashed.append(a[0]) or real_mismatch(*a))
        return real_launch(spec)

    monkeypatch.setattr(elastic, "launch", launch)
    objective = _main(tmp_path)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert isinstance(objective, float) and objective == written["eval/accuracy"]
    assert written["step"] == 4 and not (tmp_path / "logs").exists()  # tracker=none writes no event files
    assert validated == [1, "launch"]  # checked once, before the launch; the worker checks nothing again
    spec = specs[0]
    assert (spec.project_dir, spec.resume, spec.verified) == (tmp_path.resolve(), None, None)
    assert spec.launch == LaunchShape(num_processes=1, num_nodes=1, node_rank=0, environment=LaunchEnvironment())
    assert not spec.launch.starts_workers and spec.launch.holds_folder
    assert spec.config.project.project_dir == str(tmp_path.resolve()) and spec.config.trainer.max_steps == 4
    assert pickle.loads(pickle.dumps(spec)) == spec  # as the launch hands it to every worker
    with pytest.raises(ReadonlyConfigError):
        spec.config.trainer.max_steps = 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.resume = tmp_path

    # A config that asks for a resume: the launching process verifies the checkpoint, and the worker loads that
    # very save without hashing it again.
    validated.clear(), specs.clear()
    _main(tmp_path, f"resume={tmp_path}")  # no command line: the run's own config, loaded and evaluated again
    checkpoint = (tmp_path / "checkpoints" / "checkpoint_0").resolve()
    spec = specs[0]
    assert (spec.resume, spec.verified.folder) == (checkpoint, checkpoint)
    assert spec.config.resume == str(checkpoint) and validated == [1, 1, "launch"]  # composed, then resumed
    assert hashed == []
    assert json.loads((tmp_path / "metrics.json").read_text())["step"] == 4
