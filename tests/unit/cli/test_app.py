"""runner.cli.app.main on a composed config, in this process: it trains and returns the objective."""

import json
import logging

from hydra import compose, initialize_config_dir

from runner.cli.app import main
from runner.config import CONF_DIR, register_configs
from tests.shared_data import MNIST, needs_mnist


@needs_mnist
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
