"""``runner`` / ``python -m runner``: read and check the command line once, take the run folder, let Hydra run it.

Everything here happens in the launching process before a worker starts: the command line becomes
one :class:`~runner.cli.command_line.CommandLine` (a typo is one sentence and exit code 2, before
Hydra writes anything), the run's folder is locked, and Hydra composes and runs
:class:`~runner.cli.app.HydraApp`. Nothing on this path imports torch unless a run is starting.

It may import every layer below it (sweeps, the launch, and the config, run folders, training, data, models and
engine beneath them); only the entry modules (``python -m runner``, runner.checkpoints, runner.report) import it.
"""

from __future__ import annotations

import os
import sys
import warnings

USAGE_ERROR = 2
RUNTIME_ERROR = 1


def main() -> None:
    """The ``runner`` console script and ``python -m runner``: Hydra's command line, checked first.

    ``runner launch|config|env ...`` are Accelerate's commands for a plain engine script: see
    :mod:`runner.launch.commands`. ``runner export ...`` writes a checkpoint's model as plain files
    (:mod:`runner.cli.export`), ``runner generate ...`` samples text from a language-model run
    (:mod:`runner.cli.generate`). ``runner runs``, ``runner diff`` and ``runner check-resume`` list runs, compare two,
    and prove that a config resumes exactly (:mod:`runner.cli.runs`, :mod:`runner.cli.diff`,
    :mod:`runner.cli.check_resume`).
    """
    from runner.launch.commands import command_of, run_command
    from runner.training.startup import skip_collection_at_exit, stamp

    stamp("python start and imports")  # from the process's start: the interpreter, and the imports of the entry point
    skip_collection_at_exit()
    if (script_command := command_of(sys.argv[1:])) is not None:
        sys.exit(run_command(script_command, sys.argv[2:]))
    if sys.argv[1:2] == ["export"]:  # a run's model as plain files: runner/cli/export.py
        from runner.cli.export import main as export

        sys.exit(export(sys.argv[2:]))
    if sys.argv[1:2] == ["report"]:  # a run's curves.png, a sweep's summary: runner/cli/report.py
        from runner.cli.report import main as report

        sys.exit(report(sys.argv[2:]))
    if sys.argv[1:2] == ["generate"]:  # text from a language-model run: runner/cli/generate.py
        from runner.cli.generate import main as generate

        sys.exit(generate(sys.argv[2:]))
    if sys.argv[1:2] in (["status"], ["runs"], ["diff"]):  # verbs that print what they read: `| head` ends them
        import signal

        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # quietly, as it ends ls or diff, rather than with a traceback
    if sys.argv[1:2] == ["status"]:  # where a run or each job of a sweep stands: runner/cli/status.py
        from runner.cli.status import main as status

        sys.exit(status(sys.argv[2:]))
    if sys.argv[1:2] == ["runs"]:  # a table of the runs under a folder: runner/cli/runs.py
        from runner.cli.runs import main as runs

        sys.exit(runs(sys.argv[2:]))
    if sys.argv[1:2] == ["diff"]:  # what differs between two runs: runner/cli/diff.py
        from runner.cli.diff import main as diff

        sys.exit(diff(sys.argv[2:]))
    if sys.argv[1:2] == ["check-resume"]:  # train, cut, resume and compare: runner/cli/check_resume.py
        from runner.cli.check_resume import main as check_resume

        sys.exit(check_resume(sys.argv[2:]))
    if sys.argv[1:2] == ["eval"]:  # runner eval RUN [key=value ...]: resume=RUN evaluate_only=true, checked as one
        from runner.training import preemption

        sys.argv = _eval_command(sys.argv[2:])
        preemption.watch()  # a stop signal during the checks stops the evaluation before it starts, in one sentence
    from runner.cli.app import run_hydra  # Hydra's imports start here: after the dispatch, which needs none
    from runner.cli.command_line import parse_arguments, read
    from runner.cli.help import print_help
    from runner.config import ConfigError, register_configs
    from runner.data.download import DataFileError, DownloadError
    from runner.engine.launch_environment import LaunchEnvironment
    from runner.launch.lock import FolderLocked
    from runner.launch.worker import exit_without_finalizing
    from runner.training.startup import stamp

    register_configs()
    import_from_working_directory()
    quiet_plugin_schema_warning()
    argv = sys.argv[1:]
    lock = None
    try:
        args = parse_arguments(argv)
        if args.experimental_rerun:
            raise ConfigError(
                "--experimental-rerun unpickles a file, and a run folder is never unpickled; continue a run with "
                "resume=<run folder> instead."
            )
        if print_help(args):
            return
        command = read(args, argv, LaunchEnvironment.read())
        stamp("check the command line")
        command, lock = take_run_folder(command, args)
    except ConfigError as error:
        print(f"runner: error: {error}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    except (FolderLocked, DataFileError, DownloadError) as error:
        print(f"runner: error: {error}", file=sys.stderr)
        sys.exit(RUNTIME_ERROR)
    try:
        run_hydra(command)
    except SystemExit as stop:
        code = stop.code
        exit_without_finalizing(0 if code is None else code if isinstance(code, int) else RUNTIME_ERROR)
        raise
    else:
        exit_without_finalizing(0)  # a torchrun worker with a process group: see the function
    finally:
        if lock is not None:
            lock.release()


EVAL_USAGE = "usage: runner eval RUN_OR_CHECKPOINT [key=value ...]   (e.g. data.eval_split=... trainer.num_processes=1)"


def _eval_command(argv: list[str]) -> list[str]:
    """``runner eval FOLDER [overrides]`` as the command it stands for: ``runner resume=FOLDER evaluate_only=true
    [overrides]``. The checkpoint's model is evaluated on the run's eval data and metrics (or those the overrides
    give), on as many processes as the run (or ``trainer.num_processes=``); the results go to
    ``eval-<time>.json`` in the run folder, and nothing else there changes."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{EVAL_USAGE}\n\n{_eval_command.__doc__}")
        sys.exit(0)
    if not argv or ("=" in argv[0] and not os.path.isdir(argv[0])):  # a sweep job's folder may be named lr=0.1
        print(f"runner: error: runner eval needs a run or checkpoint folder first; {EVAL_USAGE}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    from runner.config import ConfigError
    from runner.config import overrides as parsed

    lines = [line for line in argv[1:] if "=" in line and not line.startswith("-")]  # Hydra's flags are Hydra's
    try:
        trains = [
            line
            for line in lines
            if parsed.key(line) == "evaluate_only" and str(parsed.value([line], "evaluate_only")).lower() != "true"
        ]
    except ConfigError as error:
        print(f"runner: error: {error}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    if trains:  # resume=<folder> trains; runner eval must not, nor sign what it would write
        print(
            f"runner: error: runner eval only evaluates, so {trains[0]} is not an option of it; to train the "
            f"run further, resume it: runner resume={argv[0]}.",
            file=sys.stderr,
        )
        sys.exit(USAGE_ERROR)
    return ["runner", f"resume={parsed.hydra_value(argv[0])}", "evaluate_only=true", *argv[1:]]


def take_run_folder(command, args):
    """Lock the folder the command's single run writes, before Hydra writes its record into it.

    A command line that names no folder gets Hydra's default one, created here so that no other
    run can take it (:func:`~runner.cli.run_folder.claim_default_run_folder`). Returns the command
    (naming the claimed folder to Hydra) and the lock, or None when this process takes no folder.
    """
    from runner.cli.run_folder import claim_default_run_folder
    from runner.config.overrides import hydra_value
    from runner.launch.lock import RunLock
    from runner.launch.preflight import check_writable

    lock = None
    if command.run_folder is not None:
        check_writable(command.run_folder, command.run_folder_key)
        lock = RunLock(command.run_folder).acquire()
    claimed = claim_default_run_folder(args) if command.resume is None and not _names_run_dir(command) else None
    if claimed is not None:
        command = command.with_overrides(f"hydra.run.dir={hydra_value(str(claimed))}")
        lock = lock or RunLock(claimed).acquire()
    return command, lock


def _names_run_dir(command) -> bool:
    from runner.config import overrides as parsed

    return parsed.sets(command.overrides, "hydra.run.dir")


def quiet_plugin_schema_warning() -> None:
    """No warning that conf/hydra/launcher/joblib.yaml and conf/hydra/sweeper/basic.yaml are checked against
    the plugins' schemas of those names: they take the place of the plugins' own configs on purpose.

    Every process that composes a config calls it: this one, and a launcher's worker processes (see
    :class:`~runner.cli.app.HydraApp`).
    """
    warnings.filterwarnings("ignore", message=r"\s*'hydra/(launcher/joblib|sweeper/basic)' is validated against")


def import_from_working_directory() -> None:
    """Make the user's package in the current folder importable here and in every process started from here.

    ``python -m runner`` puts the current folder first on ``sys.path``; the ``runner`` console script
    does not, and neither does a fresh interpreter (an elastic worker, a restarted one, a Slurm task).
    ``PYTHONPATH`` carries it to all of them.
    """
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, paths)])
