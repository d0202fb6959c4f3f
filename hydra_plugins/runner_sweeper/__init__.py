"""The runner's default sweeper (conf/hydra/sweeper/basic.yaml); Hydra loads sweepers from ``hydra_plugins``."""

from hydra_plugins.runner_sweeper.resumable import ResumableSweeper

__all__ = ["ResumableSweeper"]
