"""Hydra's basic grid sweeper, made resumable and tolerant of failed jobs (see runner.sweeps)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf, open_dict

log = logging.getLogger("runner")


class ResumableSweeper(BasicSweeper):
    """The cartesian product of the sweep's values, one job per combination, numbered as Hydra does.

    Re-run on the same ``hydra.sweep.dir``, finished jobs are skipped (their folders are not
    touched), and the others are launched again under their own numbers: each resumes from its
    newest checkpoint (runner.cli.app). A failed job is recorded and the sweep goes on; the command
    exits 1 at the end, naming it. A job whose Slurm job from an earlier command (hydra/launcher=slurm) is still
    queued or running is left to it, not submitted again.
    """

    def sweep(self, arguments: list[str]) -> Any:
        from runner.launch.lock import FolderLocked, RunLock
        from runner.launch.slurm import refused_submission
        from runner.sweeps.plan import contiguous, exit_with_failures, plan, submitted_line

        params = [f"{key}={value}" for key, value in self.params.items()] + list(arguments)
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        batches = self.split_arguments(parser.parse_overrides(params), self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        try:
            lock = RunLock(sweep_dir).acquire()  # one sweep command per sweep folder at a time
        except FolderLocked as error:
            print(f"runner: error: {error}", file=sys.stderr)
            sys.exit(1)
        try:
            jobs = [list(job) for batch in batches for job in batch]
            folders = [self._folder(index, job) for index, job in enumerate(jobs)]  # composes each: checks it too
            to_run, problems = plan(list(zip(folders, jobs, strict=True)))
            if problems:
                print(
                    f"runner: error: hydra.sweep.dir={sweep_dir} already holds another sweep ({problems[0]}); "
                    "give this sweep a new hydra.sweep.dir.",
                    file=sys.stderr,
                )
                sys.exit(2)
            finished = len(jobs) - len(to_run)
            alive = _still_in_slurm(sweep_dir, to_run)
            to_run = [index for index in to_run if index not in alive]
            OmegaConf.save(self.config, sweep_dir / "multirun.yaml")  # only once the folder is known to be ours
            if finished:
                log.info("Sweep %s: %d of %d jobs already finished; running the other %d", sweep_dir, finished,
                         len(jobs), len(jobs) - finished)  # fmt: skip
            for index, (job_id, state) in alive.items():
                log.info("Sweep job %d is still in Slurm as job %s (%s): not submitting it again", index, job_id,
                         state)  # fmt: skip
            returns: list[list[JobReturn]] = []
            failures = []
            start = 0
            for batch in batches:
                indices = [i for i in to_run if start <= i < start + len(batch)]
                for group in contiguous(indices):
                    try:
                        results = self.launcher.launch([jobs[i] for i in group], initial_job_idx=group[0])
                    except Exception as error:  # sbatch refused the job: one sentence naming the launcher's keys
                        refused = refused_submission(error, self.config.hydra.launcher)
                        if refused is None:
                            raise
                        print(f"runner: error: {refused}", file=sys.stderr)
                        sys.exit(2)
                    for index, result in zip(group, results, strict=True):
                        if result.status == JobStatus.FAILED:
                            failures.append((folders[index], jobs[index]))
                    returns.append(list(results))
                start += len(batch)
                self.batch_index += 1
        finally:
            lock.release()
        if failures:
            exit_with_failures(sweep_dir, failures)
        submitted = list(getattr(self.launcher, "submitted", []))
        if getattr(self.launcher, "wait", True) is False and (submitted or alive):  # hydra.launcher.wait=false
            print(submitted_line(sweep_dir, submitted=submitted, still=[job for job, _ in alive.values()]), flush=True)
        return returns

    def _folder(self, index: int, overrides: list[str]) -> Path:
        return job_folder(self.hydra_context, self.config, index, overrides)


def job_folder(hydra_context: Any, config: Any, index: int, overrides: list[str]) -> Path:
    """The folder Hydra gives job ``index`` of the sweep (hydra.sweep.dir / hydra.sweep.subdir)."""
    config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(config):
        config.hydra.job.num = index
        config.hydra.job.id = f"{config.hydra.job.name}_{index}"
    return Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)


def _still_in_slurm(sweep_dir: Path, to_run: list[int]) -> dict[int, tuple[str, str]]:
    """Of the jobs to run, those whose Slurm job from an earlier command is still queued or running (one squeue call);
    exits 2 in one sentence if Slurm cannot tell."""
    from runner.launch.slurm_jobs import SlurmUnavailable, states
    from runner.sweeps.jobs import read_submissions
    from runner.sweeps.plan import still_in_slurm

    submissions = read_submissions(sweep_dir)
    asked = [submissions[index]["slurm_job"] for index in to_run if index in submissions]
    try:
        known = states(asked)
    except SlurmUnavailable as error:
        print(
            f"runner: error: this sweep submitted jobs to Slurm before ({', '.join(asked)}), and whether they still "
            f"run cannot be told: {error}; nothing was submitted, so run the same command again where Slurm answers.",
            file=sys.stderr,
        )
        sys.exit(2)
    return still_in_slurm(to_run, submissions, known)
