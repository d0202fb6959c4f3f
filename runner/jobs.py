"""The record every sweep job leaves in its folder (``job.json``), read by the sweeper and the report alike."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

JOB_FILE = "job.json"


def read_job(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The job record in ``folder``, or None if it has none (or an unreadable one)."""
    try:
        return json.loads((Path(folder) / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None


def swept_keys(overrides: list[list[str]]) -> list[str]:
    """The keys whose values differ between jobs, in first-seen order (all keys if there is one job)."""
    values: dict[str, set[str]] = {}
    for job in overrides:
        for override in job:
            if "=" in override:
                key, value = override.lstrip("+").split("=", 1)
                values.setdefault(key, set()).add(value)
    keys = list(values)
    if len(overrides) > 1:
        present = [{o.lstrip("+").split("=", 1)[0] for o in job if "=" in o} for job in overrides]
        keys = [k for k in keys if len(values[k]) > 1 or any(k not in job for job in present)]
    return [k for k in keys if not k.startswith("hydra")]
