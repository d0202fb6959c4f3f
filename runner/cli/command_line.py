"""The command line, parsed and checked once into one value that everything after it reads.

:func:`read` takes ``argv`` through Hydra's own parser, refuses what cannot run (one sentence each,
see :mod:`runner.config.check`), turns ``resume=`` into the resumed run's overrides and folder, adds
what Slurm and torchrun need, and returns a :class:`CommandLine`. Hydra then runs exactly its
:attr:`CommandLine.argv` (a single run with the config composed for the check, :mod:`runner.cli.single_run`)
and the Hydra app receives the value itself (:mod:`runner.cli.app`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

from runner.cli.run_folder import check_run_folders, claim_default_run_folder, release_run_folder
from runner.config import CONFIG_NAME, ConfigError, composition
from runner.config import overrides as parsed
from runner.config import resume as resumes
from runner.config.check import check_overrides, check_plugins
from runner.config.overrides import hydra_value
from runner.config.search_path import search_path_entries
from runner.engine.launch_environment import LaunchEnvironment
from runner.folders.layout import LOG_FORMAT
from runner.launch import slurm
from runner.launch.elastic import prepare_workers


@dataclass(frozen=True)
class CommandLine:
    """One command line as the launching process understood it."""

    flags: tuple[str, ...]  # Hydra's own flags as typed: -m, --cfg job, --config-dir DIR, ...
    overrides: tuple[str, ...]  # what Hydra composes: a resumed run's own first, then these, then srun's
    config_name: str = CONFIG_NAME
    config_dir: str | None = None
    multirun: bool = False
    starts_run: bool = True  # False for --help, --cfg, --info, --shell-completion
    resume: resumes.Resume | None = None
    run_folder: Path | None = None  # the folder this single run writes, when the command line fixes it
    run_folder_key: str | None = None  # the key that names it (hydra.run.dir or project.project_dir)
    # A single run's config, composed once and checked (runner.config.check), then run as it is; None where Hydra
    # composes the config itself (a sweep, --cfg, --config-path), and the Hydra app checks what it gets.
    composed: composition.ComposedRun | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def argv(self) -> list[str]:
        return [*self.flags, *self.overrides]

    def with_overrides(self, *extra: str) -> CommandLine:
        return dataclasses.replace(self, overrides=(*self.overrides, *extra), composed=None)  # Hydra composes these


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """``argv`` as Hydra's own parser reads it (flags, and the overrides in order)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_args(argv)


def read(args: argparse.Namespace, argv: list[str], environment: LaunchEnvironment) -> CommandLine:
    """Check ``argv`` (parsed: ``args``) and decide what it runs; the result is what Hydra is given.

    Raises:
        ConfigError: An override names a key, group option, value, folder or checkpoint the run cannot use.
    """
    typed = list(args.overrides or [])
    command = CommandLine(
        flags=tuple(arg for arg in argv if arg not in typed),
        overrides=tuple(typed),
        config_name=args.config_name or CONFIG_NAME,
        config_dir=args.config_dir,
        multirun=bool(args.multirun),
        starts_run=not (args.help or args.hydra_help or args.shell_completion or args.info or args.cfg),
    )
    if args.help or args.hydra_help or args.shell_completion or args.info:
        return command
    check_run_folders(typed)  # no links in a run folder, before a resumed one is even read
    command = _resume(command) if parsed.value(typed, "resume") not in (None, "null") else command
    overrides = list(command.overrides)
    if slurm.under_srun() and not command.multirun:
        # Checked with the rest: they must make a valid config too.
        overrides += slurm.command_line(parsed.values(overrides))
        environment = LaunchEnvironment.read()  # a task per process now carries torch's rank variables
    if environment.under_torchrun and not command.multirun and not parsed.sets(overrides, "hydra.run.dir"):
        overrides += _torchrun_run_dir(environment)  # the folder the ranks agree on, composed with the rest
    check_plugins(overrides)
    composed, refused = None, None
    if not args.config_path:
        if not command.multirun and not args.cfg:
            try:
                composed = composition.compose(
                    overrides, config_name=command.config_name, config_dir=command.config_dir
                )
            except composition.NotComposed as failed:
                refused = failed.error
        # A single run that starts workers here starts the process they fork from while the targets are checked.
        workers = None if command.multirun or environment.inside_launched_group else prepare_workers
        folder = _with_run_folder(dataclasses.replace(command, overrides=tuple(overrides)), environment).run_folder
        claims = folder is None and _claims_default_folder(command, overrides, environment)
        claimed: list[Path] = []
        parents: list[Path] = []  # those the claim made

        def before_targets(cfg) -> None:
            # Importing the targets (torch, torchmetrics, ...) takes seconds: the run says where it goes first. Hydra's
            # default folder is claimed for it now (removed again if the checks refuse the command).
            if claims and (default := claim_default_run_folder(args, created=parents)) is not None:
                claimed.append(default)
            if (shown := folder or (claimed[0] if claimed else None)) is not None:
                announce_run_folder(shown)
            if workers is not None:
                workers(cfg)

        try:
            cfg = check_overrides(overrides, config_name=command.config_name, config_dir=command.config_dir,
                                  targets=not args.cfg, before_targets=before_targets, refused=refused,
                                  composed=None if composed is None else composed.task_config())  # fmt: skip
        except BaseException as error:
            for default in claimed:
                release_run_folder(default, parents)  # nothing was written, not even the folder
            if isinstance(error, ConfigError) and command.resume is not None:
                raise resumes.with_started_config_dirs(error, command) from None
            raise
        if claimed:
            overrides.append(f"hydra.run.dir={hydra_value(str(claimed[0]))}")
            if composed is not None:  # the run composed once goes to the folder claimed
                composed = composed.in_folder(str(claimed[0]), overrides[-1])
        if command.resume is not None:
            resumes.check_extent(command.resume.checkpoint, cfg, path=command.resume.path)
    command = dataclasses.replace(command, overrides=tuple(overrides), composed=composed)
    check_run_folders(overrides)  # and those that resume, torchrun and Slurm name
    return _with_run_folder(command, environment)


def _resume(command: CommandLine) -> CommandLine:
    """``resume=PATH``: the run's own overrides first, ``resume=`` naming the checkpoint, the run's folder."""
    if command.multirun:
        raise ConfigError("resume= continues one run; drop -m/--multirun.")
    typed = list(command.overrides)
    path = parsed.value(typed, "resume")
    search_path = search_path_entries(typed, config_dir=command.config_dir)
    resume = resumes.from_command_line(path, typed, search_path=search_path)
    named = f"resume={hydra_value(str(resume.checkpoint))}"
    overrides = [*resume.replayed, *(named if parsed.key(o) == "resume" else o for o in typed)]
    if not parsed.sets(typed, "hydra.run.dir"):
        overrides.append(f"hydra.run.dir={hydra_value(str(resume.run_dir))}")
    # The resumed folder keeps its original .hydra/ record; this command's record goes to run.log.
    overrides.append("hydra.output_subdir=null")
    return dataclasses.replace(command, overrides=tuple(overrides), resume=resume)


def _torchrun_run_dir(environment: LaunchEnvironment) -> list[str]:
    from runner.cli.torchrun import agreed_run_dir

    return agreed_run_dir(environment)


def _claims_default_folder(command: CommandLine, overrides: list[str], environment: LaunchEnvironment) -> bool:
    """Whether this command's single run is to get Hydra's default folder, claimed here (not a resume, torchrun or a
    Slurm task, which name theirs; not another rank's or node's process)."""
    if (
        command.resume is not None
        or command.multirun
        or not command.starts_run
        or parsed.sets(overrides, "hydra.run.dir")
    ):
        return False
    if environment.under_torchrun or slurm.under_srun() or environment.global_rank != 0:
        return False
    return parsed.value(overrides, "trainer.node_rank") in (None, "0")


def announce_run_folder(folder: Path) -> None:
    """The run's first log line, on the console only: where it writes (Hydra's logging starts later, in the run)."""
    record = logging.LogRecord("runner", logging.INFO, __file__, 0, "Run folder: %s", (folder,), None)
    print(logging.Formatter(LOG_FORMAT).format(record), flush=True)


def _with_run_folder(command: CommandLine, environment: LaunchEnvironment) -> CommandLine:
    """``command`` with the folder its single run writes, when the command line names one."""
    if command.multirun or not command.starts_run or environment.global_rank != 0:
        return command
    given = parsed.values(command.overrides)
    if given.get("trainer.node_rank") not in (None, "0"):
        return command  # another node's launcher: node 0 takes the folder
    key = "project.project_dir" if given.get("project.project_dir") not in (None, "", "null") else "hydra.run.dir"
    folder = given.get(key)
    if folder in (None, "", "null") or "${" in folder:  # unset, or an interpolation only Hydra can resolve
        return command
    return dataclasses.replace(command, run_folder=Path(folder).resolve(), run_folder_key=key)
