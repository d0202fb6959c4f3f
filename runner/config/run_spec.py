"""A run as the launching process settled it, once: the value every worker of the run is handed.

:func:`settle` takes one composed config (a single run's, which the command line checked, or a sweep job's) to a
:class:`RunSpec`: resumed if asked (:mod:`runner.config.resume`), checked (unless the command line checked this
very composition), its datasets prepared, its interpolations resolved, its trackers' folder-dependent keys filled,
and its launch shape decided. The launch pickles the spec to every worker, which builds its Accelerator and recipe
from it and decides nothing again: no validation, no schema defaults merged, no environment read but its own rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError
from runner.config import resume as resumes
from runner.config.validation import check_devices, check_hardware, settle_options, validate
from runner.engine.launch_environment import LaunchEnvironment

if TYPE_CHECKING:
    from runner.engine.checkpoint import VerifiedCheckpoint

logger = logging.getLogger("runner")


def resolve_num_processes(value: Any, *, cpu: bool) -> int:
    """``auto``: one process per visible GPU (1 without GPUs); otherwise the number given."""
    if value != "auto":
        return int(value)
    if cpu:
        return 1
    import torch

    return max(1, torch.cuda.device_count())


@dataclass(frozen=True)
class LaunchShape:
    """How many processes the run has and where this launching process stands among them."""

    num_processes: int  # on each node, ``trainer.num_processes=auto`` resolved
    num_nodes: int
    node_rank: int
    environment: LaunchEnvironment  # what started the launching process: torchrun, srun, or nothing

    @property
    def starts_workers(self) -> bool:
        """Whether the launching process starts the workers (through torch's elastic agent), rather than train
        itself: it is not one worker of a launched group already, and the run has more than one process."""
        return not self.environment.inside_launched_group and (self.num_processes, self.num_nodes) != (1, 1)

    @property
    def holds_folder(self) -> bool:
        """Whether the launching process is the one that holds the run folder (its lock, its closing lines): node
        0's, torchrun's rank 0."""
        return self.node_rank == 0 and self.environment.global_rank == 0


@dataclass(frozen=True)
class RunSpec:
    """One run, settled: what the workers train and every checkpoint records."""

    config: DictConfig  # resolved and read-only; :meth:`run_config` is a worker's own copy
    overrides: tuple[str, ...]  # what the config stands for: a resumed run's own, then the command's
    project_dir: Path
    resume: Path | None  # the checkpoint the run continues from
    verified: VerifiedCheckpoint | None  # that checkpoint's files, hashed by the launching process
    launch: LaunchShape
    command: tuple[str, ...] = ()  # the launching process's command line, as typed (the run's launch record)

    def run_config(self) -> DictConfig:
        """The config as a worker and its recipe read it (a plain, writable copy: the spec stays as settled)."""
        return OmegaConf.create(self.config_dict())

    def config_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(self.config)

    def resumed_from(self, verified: VerifiedCheckpoint) -> RunSpec:
        """This run continued from ``verified`` (the newest checkpoint, after the workers were restarted)."""
        config = self.run_config()
        config.resume = str(verified.folder)
        OmegaConf.set_readonly(config, True)
        return dataclasses.replace(self, config=config, resume=verified.folder, verified=verified)


def settle(
    cfg: DictConfig,
    overrides: list[str],
    *,
    checked: bool,
    resume: resumes.Resume | None,
    output_dir: Path | None,
    environment: LaunchEnvironment,
    search_path: Sequence[str] = (),
    node_settings: dict[str, Any] | None = None,
    continues: Callable[[Path], bool] | None = None,
    sweep_dir: Path | None = None,
    job_name: str | None = None,
    noted: Callable[[str], None] | None = None,
) -> RunSpec:
    """The :class:`RunSpec` of ``cfg``, composed from ``overrides``.

    Args:
        checked: The command line checked this very composition (:func:`runner.config.check.check_overrides`);
            only the open groups' keys are settled here again, each one said to ``noted``.
        resume: What the command line decided to resume; None lets ``cfg.resume`` decide (a sweep job's).
        output_dir: Hydra's folder for the run, where ``project.project_dir`` is not set.
        environment: What started the launching process, read after Slurm's ranks were set.
        search_path: The run's config folders, for a resume that ``cfg.resume`` asks for.
        node_settings: Launch keys a Slurm job fixes for the run (one task per node), applied after the check.
        continues: Whether the run's folder holds an earlier attempt to continue (a sweep job's), unless
            ``resume`` or ``cfg.resume`` says what to resume.
        sweep_dir, job_name: The sweep this run is a job of, for the trackers' run names and groups.
        noted: Where a note of the check goes (the run's log); a warning on the console otherwise.

    Raises:
        ConfigError: One sentence naming the key, value, file or checkpoint the run cannot use.
    """
    from runner.config.targets import check_targets
    from runner.data import prepare_datasets
    from runner.training import tracker_setup

    if not checked:
        validate(cfg, overrides)  # settles the open groups' keys too, saying what it leaves out
    else:  # the check said these on the console: the run's log keeps them
        for note in settle_options(cfg, overrides):
            (noted or logger.warning)(note)
    for key, value in (node_settings or {}).items():
        OmegaConf.update(cfg, key, value)
    if resume is None and continues is not None and not cfg.resume and continues(project_dir_of(cfg, output_dir)):
        cfg.resume = str(project_dir_of(cfg, output_dir))  # an earlier attempt of this sweep job: continue it
    if resume is None and cfg.resume:  # a sweep job's, or a config composed without the command line
        resume = resumes.from_config(str(cfg.resume), overrides, search_path=list(search_path))
    if resume is not None:
        cfg, overrides = resumes.resumed_run(resume, overrides, composed=cfg)
        validate(cfg, overrides)
    if not checked or resume is not None:  # a resumed run's config is its own, not the one the command composed
        check_targets(cfg)
        check_hardware(cfg)
        prepare_datasets(cfg.data)  # once, here (downloads, checks), rather than racing in every worker
    check_devices(cfg)
    project_dir = project_dir_of(cfg, output_dir)
    config = OmegaConf.to_container(cfg, resolve=True)
    config["project"]["project_dir"] = str(project_dir)
    tracker_setup.settle(config, project_dir, sweep_dir=sweep_dir, job_name=job_name)
    trainer = config["trainer"]
    launch = LaunchShape(
        num_processes=resolve_num_processes(trainer["num_processes"], cpu=trainer["cpu"]),
        num_nodes=trainer["num_nodes"],
        node_rank=trainer["node_rank"],
        environment=environment,
    )
    frozen = OmegaConf.create(config)
    OmegaConf.set_readonly(frozen, True)
    return RunSpec(
        config=frozen,
        overrides=tuple(overrides),
        project_dir=project_dir,
        resume=None if resume is None else resume.checkpoint,
        verified=None if resume is None else resume.verified,
        launch=launch,
    )


def project_dir_of(cfg: DictConfig, output_dir: Path | None) -> Path:
    """The run's folder: ``project.project_dir``, else Hydra's folder for the run."""
    if cfg.project.project_dir:
        return Path(cfg.project.project_dir).resolve()
    if output_dir is not None:
        return Path(output_dir).resolve()
    raise ConfigError("project.project_dir is not set and there is no Hydra run folder; set project.project_dir.")
