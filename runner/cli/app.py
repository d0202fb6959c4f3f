"""The Hydra app: what Hydra runs for a single run and for each job of a sweep. Settle, then launch.

Hydra runs the :class:`~runner.cli.command_line.CommandLine` it is given (a single run as the command line composed
and checked it; a sweep's jobs as Hydra composes them) and calls :class:`HydraApp` with the config. The app settles
it into one :class:`~runner.config.run_spec.RunSpec` (:func:`runner.config.run_spec.settle`: the command line's own
decisions, the resume and whether this very config was checked, are taken as they are; a sweep job decides its own
resume, from its folder), checks the machine, and hands the spec to the launch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from pathlib import Path
from typing import NoReturn

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from runner.cli import RUNTIME_ERROR, USAGE_ERROR, report
from runner.cli.command_line import CommandLine
from runner.config import CONF_DIR, CONFIG_NAME, ConfigError, run_spec
from runner.config.run_spec import RunSpec
from runner.engine.launch_environment import LaunchEnvironment
from runner.launch import slurm
from runner.launch.preflight import check_rendezvous_port, check_resolves, check_writable, wait_for_rendezvous
from runner.training import preemption, tracker_setup
from runner.training.startup import elapsed, restart, stamp, stamps

logger = logging.getLogger("runner")


class HydraApp:
    """Hydra's task function, holding the checked command line (a plain object: launchers may pickle it)."""

    def __init__(self, command: CommandLine | None = None) -> None:
        self.command = command

    def __call__(self, cfg: DictConfig) -> float | None:
        return main(cfg, self.command)

    def __setstate__(self, state: dict) -> None:
        """Unpickled in a launcher's worker process (joblib's, a Slurm job's), which composes its job's config itself
        and ends as the launching process does (without collecting garbage: see runner.training.startup)."""
        from runner.cli import quiet_plugin_schema_warning
        from runner.training.startup import skip_collection_at_exit

        self.__dict__.update(state)
        quiet_plugin_schema_warning()
        skip_collection_at_exit()


def run_hydra(command: CommandLine) -> None:
    """Let Hydra compose and run ``command`` (its run folder, logging, record, sweeps and launchers); a single run
    the command line has composed already runs with that config (:mod:`runner.cli.single_run`)."""
    if command.composed is not None:
        from runner.cli import single_run

        single_run.run(command.composed, HydraApp(command))
        return
    from hydra import version
    from hydra._internal.utils import _run_hydra, get_args_parser

    version.setbase("1.3")
    parser = get_args_parser()
    _run_hydra(
        args=parser.parse_args(command.argv),
        args_parser=parser,
        task_function=HydraApp(command),
        config_path=str(CONF_DIR),
        config_name=CONFIG_NAME,
    )


def main(cfg: DictConfig, command: CommandLine | None = None) -> float | None:
    """Resolve the run (resume, folder), check it, and launch. Returns the sweep objective.

    ``command`` is the command line that Hydra composed ``cfg`` from; without one (``cfg`` composed
    some other way) everything is checked here.
    """
    stamp("compose with Hydra")
    from runner.data.mnist_files import DataFileError, DownloadError
    from runner.engine.checkpoint.errors import CheckpointError
    from runner.launch.elastic import WorkerFailed
    from runner.launch.lock import FolderLocked
    from runner.sweeps.job import JobFailed, SweepJob
    from runner.training.components import BatchError

    stamp("import torch")
    job = SweepJob.current()  # None unless this is one job of a multirun
    if job is not None and "first optimizer step" in dict(stamps()):
        restart("start the next sweep job")  # an earlier job of this process already reported its start-up
    spec, project_dir, launched = None, None, False
    try:
        spec = _settle(cfg, command, job)
        project_dir = spec.project_dir
        _check_machine(spec)
        launched = True
        objective = _launch(spec, job)
    except FolderLocked as error:  # another process runs this folder: its record is not ours to touch
        _fail(job, RUNTIME_ERROR, str(error), record=False)
    except ConfigError as error:
        _fail(job, USAGE_ERROR, str(error))
    except preemption.Preempted as stop:
        evaluation = bool(cfg.get("evaluate_only"))
        if not evaluation and preemption.submitit_requeues(stop):  # hydra/launcher=slurm: submitit's signal
            _requeue(stop, str(project_dir), job)
        message = _stopped(stop, str(project_dir), sweep=job is not None, evaluation=evaluation)
        if job is not None:
            job.stop(message)  # the whole sweep stops: the scheduler wants the machine back
        if launched and _closes(spec, job):
            _to_run_log(logging.WARNING, f"Stopped after {report.duration(elapsed() or 0)}: {message}")
        print(f"runner: {message}", file=sys.stderr)
        sys.exit(preemption.EXIT_CODE)
    except (WorkerFailed, CheckpointError, DownloadError, DataFileError, BatchError, JobFailed) as error:
        if launched and _closes(spec, job):
            _close_failed(project_dir, str(error), getattr(error, "traceback", None))
        _fail(job, RUNTIME_ERROR, str(error))
    except Exception as error:
        if job is not None:
            job.fail(f"{type(error).__name__}: {error}")
        raise
    if job is not None:
        job.finish(objective)
    elif _closes(spec, job):
        _close(project_dir)
    return objective


def _closes(spec: RunSpec, job) -> bool:
    """Whether this process ends the run's log with its closing lines: a single run's training (not runner eval's,
    which says its own), in the one process that holds its folder (the launching process, torchrun's rank 0)."""
    return job is None and not spec.config.evaluate_only and spec.launch.holds_folder


def _close(project_dir: Path) -> None:
    """The closing lines of a run that finished, after its curves are drawn (curves.png)."""
    try:
        curves = report.draw_curves(project_dir)
    except Exception as error:  # the picture is a convenience: the run is done and saved all the same
        logger.warning("curves.png was not drawn (%s: %s); runner report %s retries", type(error).__name__, error,
                       project_dir)  # fmt: skip
        curves = None
    for line in report.finished(project_dir, seconds=elapsed(), curves=curves):
        logger.info(line)


def _close_failed(project_dir: Path, message: str, traceback: str | None) -> None:
    """The closing lines of a run that failed: the failed rank's traceback (on the console, and in run.log with its
    error), then where the run is and how to continue it; the error itself is the command's last line."""
    if traceback:
        print(traceback, file=sys.stderr, flush=True)
    _to_run_log(logging.ERROR, f"Failed: {message}" + (f"\n{traceback}" if traceback else ""))
    for line in report.ended_early(project_dir, "The run failed", seconds=elapsed()):
        logger.info(line)


def _to_run_log(level: int, text: str) -> None:
    """Write ``text`` into the run's log file alone (Hydra's file handler), not to the console."""
    record = logger.makeRecord(logger.name, level, __file__, 0, text, (), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _settle(cfg: DictConfig, command: CommandLine | None, job) -> RunSpec:
    """The run to launch (:func:`runner.config.run_spec.settle`), from the command line's decisions where it made
    them: a single run's config the command line composed is checked already, and its resume decided."""
    single = command is not None and command.composed is not None and job is None
    node_settings = None
    if slurm.under_srun() and not slurm.set_rank_environment() and cfg.trainer.num_nodes == 1:
        # Started by a Slurm job without our command line (Hydra's submitit launcher): one task per node.
        node_settings = {key: int(value) if value.isdigit() else value
                         for key, value in slurm.node_launcher_settings().items()}  # fmt: skip
    output_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None
    spec = run_spec.settle(
        cfg,
        _task_overrides(),
        checked=single,
        resume=command.resume if command is not None else None,
        output_dir=output_dir,
        environment=LaunchEnvironment.read(),  # after Slurm's ranks are set
        search_path=_hydra_search_path(),
        node_settings=node_settings,
        continues=None if job is None else job.resumable,
        sweep_dir=None if job is None else job.folder.parent,
        job_name=",".join(job.overrides)[:250] if job is not None and job.overrides else None,
        noted=lambda note: _to_run_log(logging.WARNING, note),
    )
    stamp("validate and check data")
    typed = ("runner", *command.argv) if command is not None else tuple(sys.argv)
    return dataclasses.replace(spec, command=typed)  # for the run's launch record


def _check_machine(spec: RunSpec) -> None:
    """The run folder is writable, and a multi-node rendezvous can be reached (or hosted, on node 0)."""
    check_writable(spec.project_dir, "project.project_dir")
    trainer = spec.config.trainer
    tracker_setup.check_reachable(spec.config)
    if spec.launch.num_nodes > 1:
        check_resolves(trainer.rdzv_endpoint)  # on every node, at once
    if spec.launch.num_nodes > 1 and spec.launch.node_rank == 0:
        check_rendezvous_port(trainer.rdzv_endpoint)
    elif spec.launch.num_nodes > 1:
        wait_for_rendezvous(trainer.rdzv_endpoint, timeout=trainer.rdzv_timeout)


def _launch(spec: RunSpec, job) -> float | None:
    """Hold the run folder (one launching process per run does) and launch the workers. The lock is re-entrant: a
    folder the command line named or claimed is held already (runner.cli.take_run_folder); one only Hydra or the
    config knows (a sweep job's, ``project.project_dir`` set in a file) is taken here."""
    from runner.launch.elastic import launch
    from runner.launch.lock import RunLock
    from runner.sweeps.job import apply_thread_budget

    with RunLock(spec.project_dir) if spec.launch.holds_folder else contextlib.nullcontext():
        if job is not None:
            threads = apply_thread_budget(spec.launch.num_processes)
            job.record["threads_per_process"] = threads
            if threads is not None:
                environment = dataclasses.replace(spec.launch.environment, threads=threads)
                spec = dataclasses.replace(spec, launch=dataclasses.replace(spec.launch, environment=environment))
            job.start(spec.project_dir, objective=(spec.config.objective.metric, spec.config.objective.direction))
        return launch(spec)


def _fail(job, code: int, message: str, *, record: bool = True) -> NoReturn:
    """Report ``message``: alone, one line and exit ``code``; in a sweep, record it in the job's
    job.json (unless ``record`` is False) and raise, so that Hydra marks the job failed and the sweep goes on.
    """
    from runner.sweeps.job import JobFailed

    if job is None:
        print(f"runner: error: {message}", file=sys.stderr)
        sys.exit(code)
    if record:
        job.fail(message)
    raise JobFailed(message) from None


def _requeue(stop, project_dir: str, job) -> None:
    """A job submitit started, stopped by submitit's signal, with its checkpoint saved: submitit requeues it (this
    process exits 75, and the requeued job continues from the checkpoint). Where it does not (its
    ``max_num_timeout`` is spent), the job ends failed with one sentence, so the sweep goes on to its summary."""
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint

    newest, _ = newest_intact_checkpoint(checkpoints_dir(project_dir), verify_checksums=False)
    saved = f"{newest.name} is saved" if newest is not None else "no checkpoint was completed"
    agreed = f"stopped by {stop.signal_name} at a step all processes agreed on; {saved}"
    if job is not None:
        job.requeue(f"{agreed}; submitit requeues the job, which continues from it.")
    print(f"runner: {agreed}; submitit requeues the job, which continues from it.", file=sys.stderr)
    reason = preemption.requeue(stop)  # exits here when submitit requeued the job
    if reason is None:  # another task of the job: its first task requeues it
        sys.exit(preemption.EXIT_CODE)
    message = (
        f"{agreed}; submitit did not requeue the job ({reason}); continue it with `python -m runner "
        f"resume={project_dir}`, or run the same sweep command again."
    )
    _fail(job, RUNTIME_ERROR, message)


def _stopped(stop, project_dir: str, *, sweep: bool = False, evaluation: bool = False) -> str:
    """One sentence for a preempted run: what stopped it, what was saved, and how to continue."""
    if evaluation:  # runner eval writes its results at its end only (preemption.stop_evaluation)
        return (
            f"evaluation stopped by {stop.signal_name}; the run in {project_dir} is as it was (no eval-*.json was "
            f"written); run the same runner eval command again to evaluate it (exit code {preemption.EXIT_CODE})."
        )
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint

    newest, _ = newest_intact_checkpoint(checkpoints_dir(project_dir), verify_checksums=False)
    saved = f"{newest.name} is saved" if newest is not None else "no checkpoint was completed"
    if sweep:
        how = "run the same sweep command again to continue"
    else:
        how = f"continue with `python -m runner resume={project_dir}`"
    agreed = f"stopped by {stop.signal_name} at a step all processes agreed on"
    return f"{agreed}; {saved}; {how} (exit code {preemption.EXIT_CODE})."


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _hydra_search_path() -> list[str]:
    """This run's config folders as search-path entries (``file://...``, ``pkg://...``)."""
    if not HydraConfig.initialized():
        return []
    return [f"{source.schema}://{source.path}" for source in HydraConfig.get().runtime.config_sources if source.path]
