"""A single run composed once: the command line's check reads the very config that Hydra then runs.

Hydra's own command line composes a run's config twice (once to read ``hydra.mode``, then for the run), and
the check before it composed it a third time. For ``python -m runner key=value ...`` without ``-m``, the
Hydra object is built here as Hydra's command line builds it (the same config search path and job name), the
config is composed once as ``Hydra.run`` composes it, the check reads it without its ``hydra`` node, and
:func:`runner.cli.single_run.run` does with it what ``Hydra.run`` does: logging, callbacks, the job's folder and
record.

What cannot be composed so (a sweep without ``-m``, a ``hydra.*`` override Hydra refuses, ``hydra.mode:
MULTIRUN`` in a file) or asks for Hydra's debug report (``hydra.verbose``) goes the usual way: the check
composes for itself and says what is wrong, and Hydra's command line runs and reports what is Hydra's to
report, exactly as before.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, open_dict, read_write

from runner.config import CONF_DIR

# The module of Hydra's task function (runner.cli.app.HydraApp): Hydra names the job after it.
TASK_MODULE = "runner.cli.app"


@dataclass(frozen=True, eq=False)
class ComposedRun:
    """One run's config, composed by the Hydra object that runs it."""

    hydra: Any  # hydra._internal.hydra.Hydra, built as hydra._internal.utils._run_hydra builds it
    config: DictConfig  # with its ``hydra`` node, as Hydra.run composes it
    config_name: str

    def in_folder(self, folder: str, line: str) -> ComposedRun:
        """This run (changed in place, and returned) in ``folder``, as composing with the override ``line``
        (``hydra.run.dir=folder``) makes it: the folder is Hydra's own node, which the task's config does not hold, so
        nothing else changes."""
        hydra_overrides = self.config.hydra.overrides.hydra
        with read_write(self.config.hydra):
            self.config.hydra.run.dir = folder
            # Before the hydra.mode=RUN that compose() added, where Hydra's command line puts that one: last.
            added = len(hydra_overrides) > 0 and hydra_overrides[-1] == "hydra.mode=RUN"
            hydra_overrides.insert(len(hydra_overrides) - added, line)
        return self

    def task_config(self) -> DictConfig:
        """The config as the task reads it, without the ``hydra`` node (a shallow copy: ``config`` stays whole)."""
        task = copy.copy(self.config)
        with open_dict(task):
            del task["hydra"]
        return task


class NotComposed(Exception):
    """Hydra could not compose the overrides; ``error`` is what it raised."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def compose(overrides: list[str], *, config_name: str, config_dir: str | None) -> ComposedRun | None:
    """Compose ``overrides`` as one run, as Hydra's command line would; None where Hydra would not run them as one
    run in this way (then the check and Hydra's command line go their usual way).

    Raises:
        NotComposed: Hydra cannot compose them (the check says why, or leaves it to Hydra's command line).
    """
    from hydra import version
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path, detect_task_name
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.types import RunMode

    version.setbase("1.3")
    search_path = create_automatic_config_search_path(None, TASK_MODULE, str(CONF_DIR))
    if config_dir is not None:  # where and how Hydra's command line adds --config-dir
        folder = f"file://{os.path.abspath(config_dir)}"
        search_path.prepend(provider="command-line", path=folder, anchor=SearchPathQuery(provider="schema"))
    loader = ConfigLoaderImpl(config_search_path=search_path)
    hydra = Hydra(task_name=detect_task_name(None, TASK_MODULE), config_loader=loader)
    try:
        config = hydra.compose_config(config_name, list(overrides), run_mode=RunMode.RUN)
    except Exception as error:
        raise NotComposed(error) from None
    if config.hydra.mode is None:  # Hydra's command line runs it, adding hydra.mode=RUN to the overrides
        with read_write(config.hydra):
            config.hydra.mode = RunMode.RUN
            config.hydra.overrides.hydra.append("hydra.mode=RUN")
    elif config.hydra.mode != RunMode.RUN:
        return None
    if config.hydra.verbose:  # Hydra's debug report of its search path and defaults: its command line prints it
        return None
    return ComposedRun(hydra, config, config_name)
