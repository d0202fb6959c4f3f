"""What every training process runs: build the Accelerator from the config, then the recipe."""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from runner.config.recipe_validation import recipe_module
from runner.config.run_spec import RunSpec
from runner.engine.launch_environment import LaunchEnvironment
from runner.folders import launch_record
from runner.folders.layout import CONFIG_FILE, LOG_FILE, LOG_FORMAT, LOGS_DIR, OVERRIDES_FILE
from runner.launch import lost_nodes
from runner.training import preemption, tracker_setup
from runner.training.startup import stamp

if TYPE_CHECKING:
    from runner.engine.checkpoint import VerifiedCheckpoint

logger = logging.getLogger("runner")


def configure_logging(*, rank: int, log_file: Path | None) -> None:
    """Rank 0 logs INFO to the console (and ``log_file``); other ranks log warnings only."""
    root = logging.getLogger()
    if rank != 0:
        root.setLevel(logging.WARNING)
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers):
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s", "%H:%M:%S"))
        root.addHandler(console)
    if rank == 0:
        root.setLevel(logging.INFO)
        has_file = any(isinstance(h, logging.FileHandler) for h in root.handlers)
        if log_file is not None and not has_file:
            handler = logging.FileHandler(log_file, mode="a")
            handler.setFormatter(logging.Formatter(LOG_FORMAT))
            root.addHandler(handler)


def build_accelerator(cfg: DictConfig):
    """The Accelerator the config describes (precision, accumulation, project folder, tracker, DDP/FSDP options,
    and under FSDP the device mesh: data-parallel replicas x shards x tensor parallelism)."""
    from runner.engine import (
        Accelerator,
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        FullyShardedDataParallelPlugin,
        InitProcessGroupKwargs,
        ParallelismConfig,
        ProjectConfiguration,
    )

    project_dir = Path(cfg.project.project_dir)
    handlers, fsdp_plugin, parallelism_config = [], None, None
    if cfg.trainer.num_nodes > 1:
        # A collective waits for a lost node as long as a node waits for the others to join (not torch's 30
        # minutes): then the ranks fail, and the launchers restart them or end, naming what was lost.
        handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.trainer.rdzv_timeout)))
    options = {k: v for k, v in OmegaConf.to_container(cfg.parallel).items() if k != "strategy"}
    if cfg.parallel.strategy == "ddp":
        handlers.append(DistributedDataParallelKwargs(**options))
    elif cfg.parallel.strategy == "fsdp":
        parallelism_config = ParallelismConfig(
            dp_replicate_size=options["dp_replicate"],
            dp_shard_size=options["dp_shard"],
            tp_size=options["tp"],
            cp_size=options["cp"],
            tp_plan=dict(options["tp_plan"]) if options["tp_plan"] else None,
            pp_size=options["pp"],
            pp_schedule=options["pp_schedule"],
            pp_microbatches=options["pp_microbatches"],
            pp_split_points=options["pp_split_points"],
            pp_stages_per_rank=options["pp_stages_per_rank"],
        )
        fsdp_plugin = FullyShardedDataParallelPlugin(
            transformer_cls_names_to_wrap=list(options["shard_modules"]),
            reshard_after_forward=options["reshard_after_forward"],
            cpu_offload=options["cpu_offload"],
            activation_checkpointing=options["activation_checkpointing"],
            state_dict_type="SHARDED_STATE_DICT" if options["state_dict"] == "sharded" else "FULL_STATE_DICT",
        )
    return Accelerator(
        mixed_precision=cfg.trainer.mixed_precision,
        gradient_accumulation_steps=cfg.trainer.gradient_accumulation_steps,
        cpu=cfg.trainer.cpu,
        log_with=tracker_setup.build(cfg),
        tracker_process=cfg.trainer.tracker_process,
        project_config=ProjectConfiguration(
            str(project_dir),
            logging_dir=str(project_dir / LOGS_DIR),
            automatic_checkpoint_naming=cfg.project.automatic_checkpoint_naming,
            total_limit=cfg.project.total_limit,
            iteration=cfg.project.iteration,
            checksum=cfg.project.checksum,
        ),
        # Runner schedules count optimizer steps: the scheduler steps once after each real optimizer step.
        step_scheduler_per_optimizer_step=True,
        # A recipe's shuffle is a function of its seed and the epoch, whatever ran before it.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=handlers,
        fsdp_plugin=fsdp_plugin,
        parallelism_config=parallelism_config,
    )


def record_config_in_checkpoints(accelerator, config: dict[str, Any], overrides: list[str]) -> None:
    """Write the run's config and overrides into every checkpoint, and sign them with its manifest once that is
    written, so resume can rebuild the run and knows it for one of yours, as it was saved
    (:mod:`runner.folders.provenance`).

    Under ``save_on_each_node`` each node's local main process writes them into its node's copy, so
    ``resume=`` works on every node (and signs that copy: it writes the copy's manifest)."""
    from runner.folders import provenance

    each_node = accelerator.project_configuration.save_on_each_node

    def write(models, weights, output_dir: str) -> None:
        if accelerator.is_main_process or (each_node and accelerator.is_local_main_process):
            OmegaConf.save(OmegaConf.create(config), Path(output_dir, CONFIG_FILE))
            OmegaConf.save(OmegaConf.create(list(overrides)), Path(output_dir, OVERRIDES_FILE))

    accelerator.register_save_state_pre_hook(write)
    accelerator.register_save_state_commit_hook(provenance.sign)


def pin_threads(threads: int | None) -> None:
    """Fix this process's CPU thread count: ``threads`` (OMP_NUM_THREADS), else the count torch chose at import, and
    resolve oneMKL's vector-math kernels before any op runs on several threads (:mod:`runner.engine.numerics`).

    Besides the count, ``torch.set_num_threads`` turns MKL's dynamic threading off. It is on by default
    (MKL_DYNAMIC=true), and then MKL may run a matrix product on fewer threads than it was given when it judges
    that better, at run time, which changes how the product's sums are split, so the same run could differ in
    its last bits from one time to the next. A fixed count with MKL_DYNAMIC off is MKL's own condition for
    reproducible results.
    """
    import torch

    from runner.engine.numerics import resolve_math_kernels

    torch.set_num_threads(threads if threads is not None else torch.get_num_threads())
    resolve_math_kernels()  # before the data and the model are built, which may run ops on several threads


def run_worker(spec: RunSpec, *, environment: LaunchEnvironment) -> float | None:
    """Train one process's share of the run ``spec`` describes, as the launching process settled it.

    ``environment`` is what this process's launcher said about it (its rank, how often it restarted).
    """
    stamp("start workers")
    preemption.watch()
    cfg, recorded = spec.run_config(), spec.config_dict()  # checkpoints record the run as it was launched
    configure_logging(rank=environment.global_rank, log_file=spec.project_dir / LOG_FILE)
    pin_threads(environment.threads)
    lost_nodes.worker_started()
    accelerator = build_accelerator(cfg)
    stamp("process group")
    lost_nodes.record_hosts(spec.launch.node_rank)
    restarts = _agreed_restart_count(environment.restart_count, accelerator.device)
    if restarts:  # the elastic agents restarted the workers: continue from the newest checkpoint
        newest = _newest_checkpoint(spec.project_dir, accelerator)
        if newest is not None:
            logger.warning("Restart %d: resuming from %s", restarts, newest.folder)
            spec = spec.resumed_from(newest)
            cfg = spec.run_config()
        else:  # what the launcher verified was where the run started, before the saves it has since lost
            spec = dataclasses.replace(spec, verified=None)
    if not restarts and not cfg.evaluate_only:  # a launch's record, once (an elastic restart is the same launch)
        write_launch_record(spec, accelerator, recorded)
    if spec.verified is not None:
        accelerator.mark_verified(spec.verified)  # the launching process hashed its files (runner resume=)
    record_config_in_checkpoints(accelerator, recorded, list(spec.overrides))
    recipe = importlib.import_module(recipe_module(cfg.recipe))
    logger.info("Running recipe %s on %s", cfg.recipe, accelerator)
    try:
        return recipe.train(cfg, accelerator)
    finally:
        launch_record.close()  # the launch's record is whole, whatever the recipe did


def write_launch_record(spec: RunSpec, accelerator, recorded: dict[str, Any]) -> None:
    """Rank 0 writes this launch's record into the run folder (:mod:`runner.folders.launch_record`); every rank
    gives its host name (a collective)."""
    from runner.engine.ops import gather_object

    hosts = gather_object([launch_record.this_host()])
    if not accelerator.is_main_process:
        return
    config = spec.config
    launch = {
        "world_size": accelerator.num_processes,
        "processes_per_node": spec.launch.num_processes,
        "num_nodes": spec.launch.num_nodes,
        "started_by": _started_by(spec.launch.environment),
        "device": accelerator.device.type,
        "mixed_precision": config.trainer.mixed_precision,
        "gradient_accumulation_steps": config.trainer.gradient_accumulation_steps,
        "parallel": dict(recorded.get("parallel", {})),
    }
    try:
        launch_record.write(
            spec.project_dir, config=recorded, overrides=spec.overrides, command=spec.command,
            resume=str(spec.resume) if spec.resume is not None else None, launch=launch, hosts=hosts,
        )  # fmt: skip
    except OSError as error:  # the run folder was checked writable: a record that fails is noted, not fatal
        logger.warning("The launch record was not written into %s (%s)", spec.project_dir, error)


def _started_by(environment: LaunchEnvironment) -> str:
    """What started the launching process: ``runner`` itself, ``torchrun`` (or torch's elastic agent), ``srun``."""
    from runner.launch import slurm

    if environment.under_torchrun:
        return "torchrun"
    return "srun" if slurm.under_srun() else "runner"


def _agreed_restart_count(count: int, device) -> int:
    """The highest restart count of any rank. An agent restarts its node's workers without counting it when
    another node's workers failed and restarted (torch counts a membership change as no failure): those
    workers see 0 and must resume all the same."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return count
    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _newest_checkpoint(project_dir: Path, accelerator) -> VerifiedCheckpoint | None:
    """The run's newest intact checkpoint (damaged newer ones are skipped with a warning), verified by the
    ranks together, each a share of its files (a collective); its load does not hash them again."""
    from runner.engine.checkpoint import checkpoints_dir
    from runner.engine.checkpoint.loading import newest_verified_checkpoint

    newest, skipped = newest_verified_checkpoint(checkpoints_dir(str(project_dir)), accelerator.state)
    for checkpoint, error in skipped:
        logger.warning("Skipping %s: %s", checkpoint.name, error)
    return newest


def run_worker_process(spec: RunSpec) -> float | None:
    """:func:`run_worker` as one of several processes started here: a preempted worker exits with
    preemption.EXIT_CODE."""
    try:
        objective = run_worker(spec, environment=LaunchEnvironment.read())
    except preemption.Preempted as stop:
        saved = "" if isinstance(stop, preemption.EvaluationStopped) else "; the checkpoint is saved"
        logger.warning("Preempted: %s%s", stop, saved)
        preemption.release()  # a further signal may now end the process: nothing is left to lose
        exit_without_finalizing(preemption.EXIT_CODE)
        sys.exit(preemption.EXIT_CODE)
    except BaseException:
        lost_nodes.worker_failed()  # a launch on several nodes watches for a failure its agent never handles
        raise
    exit_without_finalizing(0)
    return objective


def exit_without_finalizing(code: int) -> None:
    """End this process with ``code`` once Python starts to exit, before the interpreter finalizes.

    A training process of several is done once its checkpoints, metrics and logs are written, but
    gloo's worker threads may still be releasing the tensors of its last collective; a thread that
    takes the GIL while the interpreter finalizes aborts the process ("terminate called without an
    active exception"), which would turn a finished run into a failed one. Registered last, this
    exit handler runs first: it flushes the logs and standard streams and leaves with ``os._exit``.
    Called only once the outcome is known, so the code is the one the process would have exited with.
    """
    import atexit

    def leave() -> None:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            atexit.register(leave)
