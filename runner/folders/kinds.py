"""Which folders are runs and which are sweeps, judged by the files in them alone (nothing is opened).

A run folder holds run.log, .hydra/, checkpoints/, provenance/ or metrics.json; a sweep folder holds Hydra's
multirun.yaml or job folders (``<job>/job.json``). ``runner runs``, ``runner status`` and ``runner diff`` all ask
here. A folder that cannot be read is neither.
"""

from __future__ import annotations

from pathlib import Path

from runner.engine.constants import CHECKPOINTS_DIR
from runner.folders.launch_record import PROVENANCE_DIR
from runner.folders.layout import HYDRA_DIR, JOB_FILE, LOG_FILE, METRICS_FILE, MULTIRUN_FILE

RUN_FILES = (LOG_FILE, HYDRA_DIR, CHECKPOINTS_DIR, PROVENANCE_DIR, METRICS_FILE)  # any one makes a run folder


def is_run_folder(folder: Path, *, counting_checkpoints: bool = True) -> bool:
    """Whether ``folder`` holds a run's files (``counting_checkpoints=False``: files other than its checkpoints,
    e.g. to tell whether a checkpoint's parent's parent is still its run)."""
    names = RUN_FILES if counting_checkpoints else tuple(name for name in RUN_FILES if name != CHECKPOINTS_DIR)
    try:
        return any((folder / name).exists() for name in names)
    except OSError:  # a folder we may not look into
        return False


def is_sweep_folder(folder: Path) -> bool:
    """Whether ``folder`` holds a sweep: Hydra's multirun.yaml, or a job folder with its job.json."""
    try:
        return (folder / MULTIRUN_FILE).is_file() or any(folder.glob(f"*/{JOB_FILE}"))
    except OSError:
        return False
