"""The sweep's summary, kept current: ``summary.csv`` / ``summary.md`` after each job, ``summary.png`` at the end."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

logger = logging.getLogger("runner")


class SweepSummary(Callback):
    """Rewrites the sweep's summary after each job (csv, md) and at the end of the sweep (and the png)."""

    def on_job_end(self, config: DictConfig, job_return, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            summarise(Path(config.hydra.sweep.dir), plot=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        summarise(Path(config.hydra.sweep.dir), plot=True)


def summarise(sweep_dir: Path, *, plot: bool) -> None:
    from runner.sweeps.report import SUMMARY_MD, write_summary

    try:
        write_summary(sweep_dir, plot=plot)
    except Exception as error:  # a summary must never fail the sweep it describes
        logger.warning("Could not write the sweep summary in %s: %s", sweep_dir, error)
    else:
        if plot:
            logger.info("Sweep summary: %s", sweep_dir / SUMMARY_MD)
