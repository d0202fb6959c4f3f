"""Sweeps (Hydra multiruns) that record every job, resume where they stopped, and report.

Each job writes ``job.json`` in its folder: its overrides, status (running, finished, failed,
stopped), error, wall time and objective. From these records:

- ``hydra_plugins.runner_sweeper.ResumableSweeper`` (the default, conf/hydra/sweeper/basic.yaml) runs a grid like
  Hydra's basic sweeper, but a job that fails is recorded and the others still run, and re-running
  the same command on the same sweep folder (``hydra.sweep.dir=...``) skips finished jobs without
  touching their folders, resumes unfinished ones from their newest checkpoint, and runs the rest.
- :class:`SweepSummary`, a Hydra callback, rewrites ``summary.csv`` / ``summary.md`` after each job
  and ``summary.png`` at the end (runner.report; ``python -m runner.report`` does the same by hand).

Hydra's own sweepers (Optuna's, say) restart their numbering and overwrite; with them jobs are
recorded and summarised, but not skipped or resumed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.files import write_text_atomically
from runner.jobs import JOB_FILE, read_job
from runner.layout import HYDRA_DIR, HYDRA_OVERRIDES_FILE, LOG_FILE

logger = logging.getLogger("runner")

FINISHED, FAILED, RUNNING, STOPPED = "finished", "failed", "running", "stopped"


class JobFailed(RuntimeError):
    """A sweep job failed; its error is in its job.json. Hydra records the job as failed and goes on."""


# ------------------------------------------------------------------------------------------- one job
class SweepJob:
    """The job of a multirun this process is running, and its record."""

    def __init__(self, folder: Path, overrides: list[str]) -> None:
        self.folder = folder
        self.overrides = overrides
        self.started = time.time()
        self.record: dict[str, Any] = {"overrides": overrides}

    @classmethod
    def current(cls) -> SweepJob | None:
        """This process's sweep job, or None outside a multirun."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return None
        hydra = HydraConfig.get()
        return cls(Path(hydra.runtime.output_dir), [str(o) for o in hydra.overrides.task])

    def resumable(self, project_dir: Path) -> bool:
        """Whether an earlier attempt of this job left a checkpoint to continue from.

        Raises:
            JobFailed: The checkpoint belongs to a run with other overrides (the folder holds another job).
        """
        from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint
        from runner.resume import saved_overrides

        earlier = read_job(self.folder)
        if earlier is None or earlier.get("status") == FINISHED:
            return False
        newest, _ = newest_intact_checkpoint(checkpoints_dir(project_dir))
        if newest is None:
            return False
        saved = [o for o in saved_overrides(newest) if o.split("=", 1)[0].lstrip("+") != "resume"]
        if saved != self.overrides:
            raise JobFailed(
                f"{newest} was saved by a run with overrides {saved}, not this job's {self.overrides}; give the "
                "sweep a new hydra.sweep.dir."
            )
        logger.info("Resuming sweep job %s from %s", self.folder.name, newest.name)
        self.record["resumed_from"] = newest.name
        self.started -= float(earlier.get("wall_time_s") or 0)  # the wall time counts every attempt
        return True

    def start(self, project_dir: Path, *, objective: tuple[str, str]) -> None:
        """Record the job as running, with the objective it reports (``objective.metric``, ``.direction``)."""
        name, direction = objective
        self.record.update(
            project_dir=str(project_dir),
            objective={"name": name, "direction": direction},
            started_at=_now(),
        )
        self._write(RUNNING)

    def finish(self, objective: float | None) -> None:
        if objective is not None:
            self.record.setdefault("objective", {})["value"] = objective
        self._write(FINISHED)

    def fail(self, error: str) -> None:
        self._write(FAILED, error=error)

    def stop(self, reason: str) -> None:
        self._write(STOPPED, error=reason)

    def _write(self, status: str, **extra: Any) -> None:
        self.record.update(status=status, wall_time_s=round(time.time() - self.started, 3), **extra)
        if status == RUNNING:
            self.record.pop("error", None)
            self.record.pop("ended_at", None)
        else:
            self.record["ended_at"] = _now()
        self.folder.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.folder / JOB_FILE, json.dumps(self.record, indent=2, sort_keys=True) + "\n")


def apply_thread_budget(num_processes: int) -> int | None:
    """Under a launcher running ``n_jobs`` jobs at once, give each job cores // n_jobs threads.

    The threads are shared by the job's processes (OMP_NUM_THREADS is what each process takes, and
    what torch's elastic launcher passes on). Returns the threads per process, or None when jobs run
    one at a time (then every run takes what it would alone).
    """
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    n_jobs = HydraConfig.get().launcher.get("n_jobs")
    if not isinstance(n_jobs, int) or n_jobs <= 1:
        return None
    per_job = max(1, (os.cpu_count() or 1) // n_jobs)
    per_process = max(1, per_job // max(1, num_processes))
    os.environ["OMP_NUM_THREADS"] = str(per_process)
    return per_process


def _now() -> str:
    from datetime import datetime

    return datetime.now().astimezone().isoformat(timespec="milliseconds")


# ------------------------------------------------------------------------------------------ the sweep
def plan(jobs: list[tuple[Path, list[str]]]) -> tuple[list[int], list[str]]:
    """Which jobs to launch, given each job's folder and overrides: (indices to run, problems).

    A folder holding a finished record of the same overrides is skipped; one that holds another
    job's record is a problem (the sweep folder belongs to another sweep).
    """
    from omegaconf import OmegaConf

    run, problems = [], []
    for index, (folder, overrides) in enumerate(jobs):
        record = read_job(folder)
        recorded = record.get("overrides") if record else None
        if recorded is None and (folder / HYDRA_DIR / HYDRA_OVERRIDES_FILE).is_file():
            recorded = [str(o) for o in OmegaConf.load(folder / HYDRA_DIR / HYDRA_OVERRIDES_FILE)]
        if recorded is not None and list(recorded) != list(overrides):
            problems.append(f"{folder} holds a job with overrides {list(recorded)}, not {list(overrides)}")
        elif not (record and record.get("status") == FINISHED):
            run.append(index)
    return run, problems


def contiguous(indices: list[int]) -> list[list[int]]:
    """``[0, 1, 3, 4, 5]`` -> ``[[0, 1], [3, 4, 5]]``: launches that keep Hydra's job numbers."""
    groups: list[list[int]] = []
    for index in indices:
        if groups and groups[-1][-1] == index - 1:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


class SweepSummary(Callback):
    """Rewrites the sweep's summary after each job (csv, md) and at the end of the sweep (and the png)."""

    def on_job_end(self, config: DictConfig, job_return, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            _summarise(Path(config.hydra.sweep.dir), plot=False)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        _summarise(Path(config.hydra.sweep.dir), plot=True)


def _summarise(sweep_dir: Path, *, plot: bool) -> None:
    from runner.report import write_summary

    try:
        write_summary(sweep_dir, plot=plot)
    except Exception as error:  # a summary must never fail the sweep it describes
        logger.warning("Could not write the sweep summary in %s: %s", sweep_dir, error)
    else:
        if plot:
            logger.info("Sweep summary: %s", sweep_dir / "summary.md")


def exit_with_failures(sweep_dir: Path, failures: list[tuple[Path, list[str]]]) -> None:
    """After the whole sweep ran: one sentence naming the failed jobs, exit code 1."""
    _summarise(sweep_dir, plot=True)
    folder, overrides = failures[0]
    error = (read_job(folder) or {}).get("error") or f"see {folder / LOG_FILE}"
    print(
        f"runner: error: {len(failures)} sweep job(s) failed, first {folder} ({' '.join(overrides)}): {error} "
        f"(all errors in {sweep_dir / 'summary.md'}; re-run the same command to retry them).",
        file=sys.stderr,
    )
    sys.exit(1)
