"""Slurm's own view of jobs it was given, without accounting: one ``squeue`` call for many jobs.

submitit asks ``sacct`` whether a job has ended. A cluster without an accounting database has no
``sacct``, and then submitit waits forever for a job that Slurm ended without letting it write its
result (``scancel``, a node failure, a time limit with no requeue left). ``squeue`` needs no
accounting: the controller lists every job it knows, ended ones included for ``MinJobAge`` seconds
(300 by default), so a job it no longer lists has ended too.

Used by the Slurm launcher (``hydra_plugins.runner_sweeper.slurm_launcher``), which waits for its
jobs by this, and by the resumable sweeper, which does not submit a job again while the Slurm job it
was submitted as is still queued or running (:mod:`runner.sweeps.plan`).
"""

from __future__ import annotations

import shutil
import subprocess

# States in which Slurm will not run the job again (squeue's %T). Any other state (PENDING, RUNNING,
# REQUEUED, COMPLETING, SUSPENDED, ...) is a job that is still queued, running or on its way back to the queue.
# A job that is requeued passes through some of these (PREEMPTED, for one) on its way to PENDING: whoever
# waits gives a job a grace period in them before counting it as ended.
ENDED_STATES = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
     "TIMEOUT", "REVOKED"}
)  # fmt: skip
GONE = "GONE"  # the state of a job Slurm no longer lists: it ended more than MinJobAge ago
SQUEUE_FORMAT = "%i %T"  # the job id as submitit names it (123, or 123_4 for an array's task) and its state
SQUEUE_TIMEOUT_S = 60


class SlurmUnavailable(RuntimeError):
    """``squeue`` did not answer (not installed, or the controller is unreachable); the message says which."""


def parse_squeue(text: str) -> dict[str, str]:
    """``squeue -h -r -o '%i %T'`` output as {job id: state}, e.g. ``{"17_0": "RUNNING", "18": "PENDING"}``."""
    states = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2:
            states[fields[0]] = fields[1].upper()
    return states


def states(job_ids: list[str]) -> dict[str, str]:
    """Each job's state, by one ``squeue`` call: a state of Slurm's, or :data:`GONE` for a job Slurm no longer knows.

    Raises:
        SlurmUnavailable: squeue is not installed, or failed for another reason than unknown job ids.
    """
    if not job_ids:
        return {}
    squeue = shutil.which("squeue")
    if squeue is None:
        raise SlurmUnavailable("squeue is not installed on this machine")
    # -r lists each task of an array apart; -t all includes the jobs that ended (within MinJobAge).
    command = [squeue, "-h", "-r", "-t", "all", "-o", SQUEUE_FORMAT, "-j", ",".join(sorted(set(job_ids)))]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        raise SlurmUnavailable(f"squeue failed: {error}") from None
    said = " ".join(done.stderr.split())
    if done.returncode != 0 and "invalid job id" not in said.lower():  # every id unknown: squeue says so, exit 1
        raise SlurmUnavailable(f"squeue failed ({said or f'exit code {done.returncode}'})")
    listed = parse_squeue(done.stdout)
    return {job_id: listed.get(job_id, GONE) for job_id in job_ids}


def is_alive(state: str) -> bool:
    """Whether a job in ``state`` (see :func:`states`) may still run: queued, running, or on its way back to the
    queue."""
    return state != GONE and state not in ENDED_STATES


def ended_sentence(job_id: str, state: str, *, started: bool) -> str:
    """How a job ended that Slurm ended before it wrote its result (the first half of a sentence).

    ``Slurm ended job 17_0 as CANCELLED before it finished``, or ``before it started`` for a job that never ran.
    """
    until = "finished" if started else "started"
    if state == GONE:
        return f"Slurm no longer lists job {job_id}, which ended before it {until}"
    return f"Slurm ended job {job_id} as {state} before it {until}"
