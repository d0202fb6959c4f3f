"""The record every sweep job leaves in its folder (``job.json``), read by the sweeper and the report alike, and the
sweep's record of the Slurm job each of its jobs was last submitted as (``slurm_jobs.json``, hydra/launcher=slurm)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from runner.config import overrides as parsed
from runner.folders.layout import JOB_FILE  # defined with the run folder's other names; the sweep's code reads it here

FINISHED, FAILED, RUNNING, STOPPED = "finished", "failed", "running", "stopped"  # a job's status
REQUEUED = "requeued"  # stopped by submitit's signal, checkpoint saved, back in Slurm's queue (hydra/launcher=slurm)
SUBMISSIONS_FILE = "slurm_jobs.json"  # in the sweep folder: {job number: {"slurm_job": "17_0", "submitted_at": ...}}


def read_job(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The job record in ``folder``, or None if it has none (or one that is not a JSON object)."""
    try:
        record = json.loads((Path(folder) / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_submissions(sweep_dir: str | os.PathLike) -> dict[int, dict[str, str]]:
    """The Slurm job each job of the sweep was last submitted as, by job number (empty if none was submitted)."""
    try:
        recorded = json.loads((Path(sweep_dir) / SUBMISSIONS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {
        int(number): entry
        for number, entry in recorded.items()
        if number.isdigit() and isinstance(entry, dict) and isinstance(entry.get("slurm_job"), str)
    }


def record_submissions(sweep_dir: str | os.PathLike, submitted: dict[int, str], *, at: str) -> None:
    """Add ``submitted`` ({job number: Slurm job id}, submitted at the time ``at``) to the sweep's record.

    Only the sweep command writes it, and one sweep command runs per sweep folder at a time (its lock).
    """
    from runner.files import write_text_atomically

    recorded = {str(number): entry for number, entry in read_submissions(sweep_dir).items()}
    recorded.update({str(number): {"slurm_job": job_id, "submitted_at": at} for number, job_id in submitted.items()})
    ordered = dict(sorted(recorded.items(), key=lambda item: int(item[0])))
    write_text_atomically(Path(sweep_dir) / SUBMISSIONS_FILE, json.dumps(ordered, indent=2) + "\n")


def swept_keys(overrides: list[list[str]]) -> list[str]:
    """The keys whose values differ between jobs, in first-seen order (all keys if there is one job)."""
    values: dict[str, set[str]] = {}
    typed = [parsed.as_typed(job) for job in overrides]
    for job in typed:
        for key, value in job.items():
            values.setdefault(key, set()).add(value)
    keys = list(values)
    if len(overrides) > 1:
        present = [set(job) for job in typed]
        keys = [k for k in keys if len(values[k]) > 1 or any(k not in job for job in present)]
    return [k for k in keys if not k.startswith("hydra")]
