"""The record every sweep job leaves in its folder (``job.json``), read by the sweeper and the report alike."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from runner import overrides as parsed

JOB_FILE = "job.json"
FINISHED, FAILED, RUNNING, STOPPED = "finished", "failed", "running", "stopped"  # a job's status
REQUEUED = "requeued"  # stopped by submitit's signal, checkpoint saved, back in Slurm's queue (hydra/launcher=slurm)


def read_job(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The job record in ``folder``, or None if it has none (or an unreadable one)."""
    try:
        return json.loads((Path(folder) / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None


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
