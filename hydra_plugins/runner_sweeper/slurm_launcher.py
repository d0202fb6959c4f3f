"""hydra/launcher=slurm: Hydra's submitit launcher, which can return once the jobs are queued and never waits on sacct.

Registered as ``hydra/launcher: runner_slurm`` (conf/hydra/launcher/slurm.yaml builds on it), with every key of
Hydra's ``submitit_slurm`` and one more:

- ``wait: true`` (the default): the sweep command waits for its jobs, as Hydra's launcher does, but not through
  submitit's ``job.results()``, which asks ``sacct`` whether a job ended and so, on a cluster without accounting,
  waits forever for a job that Slurm ended before it wrote its result (``scancel``, a node failure, a time limit
  with no requeue left). Every few seconds the launcher looks for each job's result and asks Slurm, in one
  ``squeue`` call for all of them, which still run (:mod:`runner.launch.slurm_jobs`); a job that Slurm has ended
  (or no longer lists) and that has left no result after a grace period is failed, in one sentence recorded in its
  ``job.json``, and the sweep ends with its summary and exit 1, naming it. A job Slurm requeues is waited for.
- ``wait: false``: the command returns once every job is queued and says how to follow them (``runner status``);
  each job rewrites the sweep's summary as it ends, so it is complete when the last one ends.

Either way the Slurm job each grid job was submitted as is recorded in the sweep folder (``slurm_jobs.json``), and
the same sweep command run again does not submit a job whose Slurm job is still queued or running
(hydra_plugins.runner_sweeper.resumable).
"""

# No ``from __future__ import annotations`` here: Hydra's plugin scan runs this module before it is in sys.modules,
# where dataclasses would look its string annotations up.

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # without the slurm extra there is nothing to extend; hydra/launcher=slurm names the extra
    BaseQueueConf = SlurmQueueConf = SlurmLauncher = object  # type: ignore[assignment,misc]

log = logging.getLogger("runner")

POLL_S = 3.0  # between two looks at the results and at Slurm (one squeue call for all jobs)
GRACE_S = 10.0  # how long a job stays ended in Slurm's eyes without a result before it counts as failed


@dataclass
class RunnerSlurmQueueConf(SlurmQueueConf):
    """Hydra's ``submitit_slurm`` keys, and ``wait``."""

    _target_: str = "hydra_plugins.runner_sweeper.slurm_launcher.RunnerSlurmLauncher"
    # true: the command waits for every job and ends with the sweep's summary (exit 1 naming a failed job);
    # false: it returns once the jobs are queued (follow them with `runner status <sweep folder>`).
    wait: bool = True


class RunnerSlurmLauncher(SlurmLauncher):
    """Submits a sweep's jobs as Hydra's SlurmLauncher does; then waits for them without sacct, or returns."""

    def __init__(self, **params: Any) -> None:
        self.wait = bool(params.pop("wait", True))
        self.submitted: list[str] = []  # the Slurm job ids this command submitted, in order
        super().__init__(**params)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from runner.sweeps.job import now
        from runner.sweeps.jobs import record_submissions

        jobs = self._submit(job_overrides, initial_job_idx)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        record_submissions(sweep_dir, {initial_job_idx + i: job.job_id for i, job in enumerate(jobs)}, at=now())
        self.submitted += [job.job_id for job in jobs]
        if not self.wait:
            return [JobReturn(overrides=list(overrides), status=JobStatus.UNKNOWN) for overrides in job_overrides]
        return self._wait(jobs, [list(overrides) for overrides in job_overrides], initial_job_idx)

    def _submit(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Any]:
        """Submit the jobs: hydra-submitit-launcher 1.2's ``launch``, up to the wait that ends it."""
        import submitit
        from hydra.core.singleton import Singleton
        from hydra.core.utils import filter_overrides
        from omegaconf import OmegaConf

        specific_init_keys = {"max_num_timeout"}
        init_params = {"folder": self.params["submitit_folder"]}
        init_params.update({f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k in specific_init_keys})
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init_params)
        base_keys = set(OmegaConf.structured(BaseQueueConf).keys())
        init_keys = specific_init_keys | {"submitit_folder"}
        executor.update_parameters(
            **{
                k if k in base_keys else f"{self._EXECUTOR}_{k}": v
                for k, v in self.params.items()
                if k not in init_keys
            }
        )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        job_params = []
        for number, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info("\t#%d : %s", number, " ".join(filter_overrides(overrides)))
            job_params.append(
                (list(overrides), "hydra.sweep.dir", number, f"job_id_for_{number}", Singleton.get_state())
            )
        return executor.map_array(self, *zip(*job_params, strict=True))

    def _wait(self, jobs: list[Any], overrides: list[list[str]], first: int) -> list[JobReturn]:
        """Each job's result, waiting on result files and on Slurm's own view of the jobs (never on sacct)."""
        from runner.launch.slurm_jobs import SlurmUnavailable, is_alive, states

        results: dict[int, JobReturn] = {}
        ended_since: dict[int, float] = {}  # when Slurm was first seen to have ended the job (without a result)
        unanswered = False
        while True:
            for i in [i for i in range(len(jobs)) if i not in results and _has_result(jobs[i])]:
                results[i] = jobs[i].results()[0]
            waiting = [i for i in range(len(jobs)) if i not in results]
            if not waiting:
                return [results[i] for i in range(len(jobs))]
            try:
                known = states([jobs[i].job_id for i in waiting])
            except SlurmUnavailable as error:  # the controller may be back soon: the jobs are still its to run
                if not unanswered:
                    log.warning("Waiting for Slurm to answer about jobs %s: %s", [jobs[i].job_id for i in waiting],
                                error)  # fmt: skip
                unanswered = True
                time.sleep(POLL_S)
                continue
            unanswered = False
            now = time.monotonic()
            for i in waiting:
                if is_alive(known[jobs[i].job_id]):
                    ended_since.pop(i, None)  # back in the queue (a requeue passes through ended states)
                elif now - ended_since.setdefault(i, now) >= GRACE_S and not _has_result(jobs[i]):
                    results[i] = self._ended(jobs[i], overrides[i], first + i, known[jobs[i].job_id])
            if len(results) < len(jobs):
                time.sleep(POLL_S)

    def _ended(self, job: Any, overrides: list[str], number: int, state: str) -> JobReturn:
        """A job Slurm ended without its result: failed, in one sentence in its job.json (unless it recorded its own
        end, which stands)."""
        from hydra_plugins.runner_sweeper.resumable import job_folder
        from runner.launch.slurm_jobs import ended_sentence
        from runner.sweeps.job import JobFailed, record_ended
        from runner.sweeps.jobs import FINISHED, read_job

        folder = job_folder(self.hydra_context, self.config, number, overrides)
        earlier = read_job(folder)
        head = ended_sentence(job.job_id, state, started=earlier is not None)
        record = record_ended(folder, overrides, f"{head}; {_how_to_continue(folder, earlier)}")
        if record.get("status") == FINISHED:
            value = (record.get("objective") or {}).get("value")
            return JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value=value)
        log.error("Sweep job %d: %s", number, record["error"])
        return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=JobFailed(record["error"]))


def _has_result(job: Any) -> bool:
    """Whether every task of the submitit job wrote its result file."""
    return all(job.task(task).paths.result_pickle.exists() for task in range(job.num_tasks))


def _how_to_continue(folder: Path, record: dict[str, Any] | None) -> str:
    """The second half of the sentence for a job Slurm ended: its newest checkpoint and how to continue from it."""
    if record is None:
        return "run the same sweep command again to run it."
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint

    project_dir = record.get("project_dir") or folder
    newest, _ = newest_intact_checkpoint(checkpoints_dir(project_dir), verify_checksums=False)
    if newest is None:
        return "it saved no checkpoint, so run the same sweep command again to run it from the start."
    return (
        f"{newest.name} is its newest checkpoint; continue it with `python -m runner resume={project_dir}`, or run "
        "the same sweep command again."
    )


if SlurmLauncher is not object:
    ConfigStore.instance().store(group="hydra/launcher", name="runner_slurm", node=RunnerSlurmQueueConf,
                                 provider="runner")  # fmt: skip
