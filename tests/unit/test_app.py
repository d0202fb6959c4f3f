"""runner.app.main on a composed config, in this process: it trains and returns the objective."""

import json
import logging

import pytest
from hydra import compose, initialize_config_dir

from runner.app import CONF_DIR, main
from runner.config import register_configs
from runner.training import ProgressReporter
from tests.e2e.conftest import MNIST


@pytest.mark.skipif(not MNIST.is_dir(), reason=f"the MNIST test split is not at {MNIST}")
def test_main_returns_the_eval_accuracy_it_wrote(tmp_path):
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    register_configs()
    overrides = [
        f"data.root={MNIST}", 'data.train_split="test[:256]"', 'data.eval_split="test[9900:]"',
        "trainer.max_steps=4", f"project.project_dir={tmp_path}", "tracker=none",
    ]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    try:
        objective = main(cfg)
    finally:  # the worker configures this process's logging as a run would; undo it
        for handler in set(root.handlers) - set(handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(level)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert isinstance(objective, float) and objective == written["eval/accuracy"]
    assert written["step"] == 4 and not (tmp_path / "logs").exists()  # tracker=none writes no event files


class FakeAccelerator:
    def __init__(self, main_process):
        self.is_main_process = main_process


def test_progress_is_a_bar_on_a_terminal_and_log_lines_elsewhere(monkeypatch, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="runner"):
        plain = ProgressReporter(FakeAccelerator(True), total=10, initial=0)
        assert plain.bar is None  # pytest's stderr is not a terminal
        plain.report(5, {"train/loss": 0.25})
        ProgressReporter(FakeAccelerator(False), total=10, initial=0).report(5, {"train/loss": 9.0})
    assert [r.getMessage() for r in caplog.records] == ["step 5/10 | train/loss 0.25"]

    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    bar = ProgressReporter(FakeAccelerator(True), total=10, initial=3)
    assert bar.bar is not None and bar.bar.n == 3
    bar.advance()
    bar.report(4, {"eval/accuracy": 0.5})
    assert bar.bar.n == 4
    bar.close()
    assert ProgressReporter(FakeAccelerator(True), total=10, initial=0, enabled=False).bar is None
    assert ProgressReporter(FakeAccelerator(False), total=10, initial=0).bar is None
