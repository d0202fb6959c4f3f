"""A resumable sweep's plan: which jobs of the grid still run, and the one sentence when some failed.

Re-running the same sweep command on the same ``hydra.sweep.dir`` skips finished jobs without
touching their folders, resumes unfinished ones from their newest checkpoint (each job decides that
itself, :meth:`runner.sweeps.job.SweepJob.resumable`), and runs the rest
(``hydra_plugins.runner_sweeper.ResumableSweeper``). A job whose Slurm job (hydra/launcher=slurm, recorded in the sweep
folder's ``slurm_jobs.json``) is still queued or running is not submitted again: that would put two Slurm jobs on
one run folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

from runner.folders.layout import HYDRA_DIR, HYDRA_OVERRIDES_FILE, LOG_FILE
from runner.sweeps.jobs import FINISHED, read_job
from runner.sweeps.report import SUMMARY_MD
from runner.sweeps.summary import summarise


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


def still_in_slurm(
    to_run: list[int], submissions: dict[int, dict[str, str]], states: dict[str, str]
) -> dict[int, tuple[str, str]]:
    """Of the job numbers ``to_run``, those whose last Slurm job may still run: {number: (Slurm job id, state)}.

    Args:
        to_run: The jobs :func:`plan` would launch.
        submissions: The Slurm job each job was last submitted as (:func:`runner.sweeps.jobs.read_submissions`).
        states: Slurm's state of each of those Slurm jobs (:func:`runner.launch.slurm_jobs.states`).
    """
    from runner.launch.slurm_jobs import GONE, is_alive

    alive = {}
    for number in to_run:
        job_id = submissions.get(number, {}).get("slurm_job")
        if job_id is not None and is_alive(states.get(job_id, GONE)):
            alive[number] = (job_id, states[job_id])
    return alive


def submitted_line(sweep_dir: Path, *, submitted: list[str], still: list[str]) -> str:
    """What a sweep command that does not wait (``hydra.launcher.wait=false``) says as it returns."""
    jobs = f"{len(submitted)} job{'s' if len(submitted) != 1 else ''}"
    them = "it" if len(submitted) == 1 else "them"
    said = f"runner: submitted {jobs} to Slurm ({', '.join(submitted) or 'none'}) without waiting for {them}"
    if still:
        said += f"; {len(still)} more still queued or running there ({', '.join(still)})"
    return (
        f"{said}; follow the sweep with `runner status {sweep_dir}`; its summary ({sweep_dir / SUMMARY_MD}) is "
        "complete when the last job ends."
    )


def contiguous(indices: list[int]) -> list[list[int]]:
    """``[0, 1, 3, 4, 5]`` -> ``[[0, 1], [3, 4, 5]]``: launches that keep Hydra's job numbers."""
    groups: list[list[int]] = []
    for index in indices:
        if groups and groups[-1][-1] == index - 1:
            groups[-1].append(index)
        else:
            groups.append([index])
    return groups


def exit_with_failures(sweep_dir: Path, failures: list[tuple[Path, list[str]]]) -> None:
    """After the whole sweep ran: one sentence naming the failed jobs, exit code 1."""
    summarise(sweep_dir, plot=True)
    folder, overrides = failures[0]
    error = (read_job(folder) or {}).get("error") or f"see {folder / LOG_FILE}"
    print(
        f"runner: error: {len(failures)} sweep job(s) failed, first {folder} ({' '.join(overrides)}): {error} "
        f"(all errors in {sweep_dir / SUMMARY_MD}; re-run the same command to retry them).",
        file=sys.stderr,
    )
    sys.exit(1)
