"""The sweep's summary, kept current: ``summary.csv`` / ``summary.md`` after each job, ``summary.png`` at the end.

The end is the sweep command's (``on_multirun_end``) or the last job's: a job that ends with no other job of the
sweep left to run writes the plot too, so a sweep submitted to Slurm has its whole summary when its last job ends,
whether or not the command that submitted it still waits (``hydra.launcher.wait``). A job that Slurm ends before it
could finish (``scancel``) writes nothing: ``python -m runner.report`` rebuilds the summary at any time.
"""

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
            summarise(Path(config.hydra.sweep.dir), plot=None)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # hydra.launcher.wait=false (hydra/launcher=slurm): the jobs were only queued, and the last to end plots.
        walked_away = config.hydra.launcher.get("wait", True) is False
        summarise(Path(config.hydra.sweep.dir), plot=None if walked_away else True)


UNFINISHED = ("running", "requeued", "pending")  # a job of the sweep that will still run


def summarise(sweep_dir: Path, *, plot: bool | None) -> None:
    """Write the summary; the plot too with ``plot``, or (None) if the sweep is a grid with no job left to run
    (another sweeper's next jobs are not known until it asks for them)."""
    from runner.sweeps.report import SUMMARY_MD, collect, grid, write_summary

    try:
        jobs = collect(sweep_dir)
        if plot is None:
            plot = bool(grid(sweep_dir)) and not any(job.status in UNFINISHED for job in jobs)
        write_summary(sweep_dir, plot=plot, jobs=jobs)
    except Exception as error:  # a summary must never fail the sweep it describes
        logger.warning("Could not write the sweep summary in %s: %s", sweep_dir, error)
    else:
        if plot:
            logger.info("Sweep summary: %s", sweep_dir / SUMMARY_MD)
