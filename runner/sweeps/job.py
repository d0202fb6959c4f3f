"""One job of a sweep (a Hydra multirun) and its record, ``job.json``, in the job's folder.

The record holds the job's overrides, status (running, finished, failed, stopped, requeued), error, wall
time and objective. The sweeper skips and resumes jobs by it (:mod:`runner.sweeps.plan`), and the
summary is built from it (:mod:`runner.sweeps.report`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from runner.config import overrides as parsed
from runner.files import write_text_atomically
from runner.folders.layout import saved_overrides
from runner.sweeps.jobs import FAILED, FINISHED, JOB_FILE, REQUEUED, RUNNING, STOPPED, read_job

logger = logging.getLogger("runner")


class JobFailed(RuntimeError):
    """A sweep job failed; its error is in its job.json. Hydra records the job as failed and goes on."""


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

        earlier = read_job(self.folder)
        if earlier is None or earlier.get("status") == FINISHED:
            return False
        newest, _ = newest_intact_checkpoint(checkpoints_dir(project_dir), verify_checksums=False)  # workers verify
        if newest is None:
            return False
        saved = parsed.without(saved_overrides(newest), "resume")
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
            started_at=now(),
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

    def requeue(self, reason: str) -> None:
        """Stopped with its checkpoint saved, and back in Slurm's queue: it continues when it starts again."""
        self._write(REQUEUED, error=reason)

    def _write(self, status: str, **extra: Any) -> None:
        self.record.update(status=status, wall_time_s=round(time.time() - self.started, 3), **extra)
        if status == RUNNING:
            self.record.pop("error", None)
            self.record.pop("ended_at", None)
        else:
            self.record["ended_at"] = now()
        _write_record(self.folder, self.record)


def record_ended(folder: Path, overrides: list[str], error: str) -> dict[str, Any]:
    """Record, for a job that ended without saying how (Slurm cancelled it, its node failed), that it failed with
    ``error``; a job that recorded its own end (finished, failed) keeps its record. Returns the record now in place.
    """
    record = read_job(folder) or {"overrides": overrides}
    if record.get("status") in (FINISHED, FAILED):
        return record
    record.update(status=FAILED, error=error, ended_at=now())
    _write_record(folder, record)
    return record


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    # A job on several nodes runs the app once per node, and each records the job's start and end: each writes under
    # a temporary name of its own (one shared name, renamed away by one, fails the other's rename).
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(folder / JOB_FILE, json.dumps(record, indent=2, sort_keys=True) + "\n", shared=True)


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


def now() -> str:
    """This moment as the records write it: ISO 8601 with the local offset, to the millisecond."""
    from datetime import datetime

    return datetime.now().astimezone().isoformat(timespec="milliseconds")
