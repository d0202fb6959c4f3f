"""``runner status FOLDER``: where a run, or each job of a sweep, stands, read from the folder alone.

    runner status outputs/multirun/2026-12-05/10-00-00
    job  status    step     train/loss  eval/accuracy  detail
    0    finished  300/300  0.0355      0.94
    1    running   120/300  0.2104      0.87
    2    requeued  125/300  0.1932      -              stopped by SIGUSR2 at a step all processes agreed on; ...
    3    failed    40/300   0.9120      -              <the job's sentence>
    4    queued    -        -           -              submitted to Slurm, not started yet

A job's status comes from its ``job.json`` (see :mod:`runner.sweeps.job`): running (its process holds the run
folder's lock), finished, failed (with its sentence), stopped, requeued (stopped by submitit's signal with its
checkpoint saved, back in Slurm's queue), interrupted (it says running, but no process holds it: killed, or its
machine went away), queued (submitted to Slurm and not started yet: a job of the grid without a folder yet, or one
whose record is older than its latest submission in the sweep's ``slurm_jobs.json``) or pending (a job of the grid
without a folder, in any other sweep). The step and the latest metrics are the last the run logged in ``run.log``. A run
folder gets one line: running, finished, or stopped with its newest checkpoint.

Nothing is written and nothing is contacted (Slurm is not asked: a job the scheduler dropped without a word
shows as the folder last saw it). A folder holding a link is refused, as everywhere (see
:func:`runner.folders.layout.check_no_links`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from runner.folders.kinds import is_run_folder, is_sweep_folder
from runner.folders.layout import METRICS_FILE, SUBMITIT_DIR
from runner.folders.run_log import latest_step

if TYPE_CHECKING:
    from runner.sweeps.report import Job

USAGE = "usage: runner status RUN_OR_SWEEP_FOLDER"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__.split(chr(10) * 2)[2]}" if argv[:1] in (["-h"], ["--help"]) else USAGE,
              file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)  # fmt: skip
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    from runner.config import ConfigError
    from runner.folders.layout import check_no_links

    folder = Path(argv[0]).expanduser().absolute()
    if not folder.is_dir():
        print(f"runner: error: {folder} is not a folder; pass a run folder or a sweep folder.", file=sys.stderr)
        return 2
    try:
        check_no_links(folder)
    except ConfigError as error:
        print(f"runner: error: {error}", file=sys.stderr)
        return 2
    if is_sweep_folder(folder):
        print(sweep_table(folder))
    elif is_run_folder(folder):
        print(run_line(folder))
    else:
        print(
            f"runner: error: {folder} holds neither a run (run.log, .hydra/, checkpoints/, provenance/, metrics.json) "
            "nor a sweep (multirun.yaml, job folders); pass a run folder or a sweep folder.",
            file=sys.stderr,
        )
        return 2
    return 0


def sweep_table(sweep: Path) -> str:
    """One line per job of the sweep, with the sweep's objective among its columns."""
    from runner.sweeps.jobs import read_submissions
    from runner.sweeps.report import collect

    jobs = collect(sweep)
    submitted = (sweep / SUBMITIT_DIR).is_dir()
    submissions = read_submissions(sweep)
    objectives = [job.objective for job in jobs if job.objective]
    columns = ["train/loss", *([objectives[0]] if objectives and objectives[0] != "train/loss" else [])]
    rows = [["job", "status", "step", *columns, "detail"]]
    for job in jobs:
        run = sweep / job.name
        step, values = latest_step(run) if run.is_dir() else ("-", {})
        status = "queued" if job.status == "pending" and submitted else job.status
        detail = job.error
        slurm_job = queued_as(job, submissions.get(int(job.name)) if job.name.isdigit() else None)
        if slurm_job is not None:
            status, detail = "queued", f"submitted to Slurm as job {slurm_job}, not started yet"
        elif status == "queued":
            detail = "submitted to Slurm, not started yet"
        if status == "finished" and (run / METRICS_FILE).is_file():
            values.update({key: _short(value) for key, value in job.metrics.items() if key in columns})
        rows.append([job.name, status, step, *(values.get(column, "-") for column in columns), detail])
    return table(rows)


def queued_as(job: Job, submission: dict[str, str] | None) -> str | None:
    """The Slurm job a job of a sweep waits in the queue as: one submitted after its record was last written (it has
    not started since), e.g. a failed job submitted again; None if it is not waiting to start. Judged on the record
    :func:`~runner.sweeps.report.collect` read, which the job may rewrite as it starts."""
    from datetime import datetime

    if submission is None or job.status not in ("pending", "failed", "stopped", "interrupted"):
        return None
    try:
        submitted = datetime.fromisoformat(submission["submitted_at"])
        waiting = job.recorded_at is None or submitted > datetime.fromisoformat(job.recorded_at)
    except (KeyError, TypeError, ValueError):
        return None
    return submission["slurm_job"] if waiting else None


def run_line(run: Path) -> str:
    """One run folder: running, finished, or stopped with its newest checkpoint and how to continue."""
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint
    from runner.launch.lock import is_locked

    step, values = latest_step(run)
    if is_locked(run):
        status, detail = "running", ""
    elif (run / METRICS_FILE).is_file():
        status, detail = "finished", ""
    else:
        newest, _ = newest_intact_checkpoint(checkpoints_dir(run), verify_checksums=False)
        status = "stopped"
        detail = (
            f"newest checkpoint {newest.name}; continue with runner resume={run}"
            if newest is not None
            else "no checkpoint was saved"
        )
    columns = [key for key in ("train/loss", "eval/loss", "eval/accuracy") if key in values]
    return table([["run", "status", "step", *columns, "detail"],
                   [run.name, status, step, *(values[key] for key in columns), detail]])  # fmt: skip


def _short(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def table(rows: list[list[str]]) -> str:
    """``rows`` (the first a header) as aligned columns, two spaces apart; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        ("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1]).rstrip()
        for row in rows
    )
