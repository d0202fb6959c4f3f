"""A single run composed once, run as ``Hydra.run`` runs it: the command line's check read the very config
(:mod:`runner.config.composition`) that :func:`run` now runs, doing what ``Hydra.run`` does once it has composed:
logging, callbacks, the job's folder and record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from runner.config.composition import ComposedRun


def run(composed: ComposedRun, task_function: Callable[[DictConfig], Any]) -> None:
    """What ``Hydra.run`` does once it has composed the config: logging, the callbacks, the job (its folder,
    record and working directory); an error is reported as Hydra's command line reports it."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext

    hydra, config, name = composed.hydra, composed.config, composed.config_name

    def job() -> None:
        GlobalHydra.instance().clear()  # an earlier command of this process (runner.cli.main called again)
        GlobalHydra.instance().initialize(hydra)
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
        callbacks = Callbacks(config)
        callbacks.on_run_start(config=config, config_name=name)
        done = run_job(
            hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks),
            task_function=task_function, config=config, job_dir_key="hydra.run.dir", job_subdir_key=None,
            configure_logging=True,
        )  # fmt: skip
        callbacks.on_run_end(config=config, config_name=name, job_return=done)
        _ = done.return_value  # raises the task's error

    try:
        run_and_report(job)
    finally:  # as it was before: a later command of this process composes with a Hydra of its own
        GlobalHydra.instance().clear()
