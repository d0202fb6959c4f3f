"""The runner's entry point: check the command line, compose with Hydra, then validate -> resume -> launch.

``cli()`` runs before Hydra. It checks the overrides by composing them once (so a typo becomes one
sentence with a suggestion and exit code 2, before any process starts), turns ``resume=`` into the
resumed run's own overrides and folder, and makes every torchrun rank agree on one run folder.
Nothing on this path imports torch unless a run is actually starting.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from runner import preemption, slurm
from runner.config import (
    CONF_DIR,
    CONFIG_NAME,
    ConfigError,
    RunnerConfig,
    check_devices,
    check_hardware,
    register_configs,
    validate,
)
from runner.preflight import check_rendezvous_port, check_writable, wait_for_rendezvous
from runner.search_path import hydra_value, is_search_path, search_path_entries, search_path_overrides
from runner.startup import restart, stamp, stamps

logger = logging.getLogger("runner")
# conf/hydra/launcher/joblib.yaml and conf/hydra/sweeper/basic.yaml take the place of the plugins'
# own configs of those names on purpose, and are checked against their schemas: no warning for that.
warnings.filterwarnings("ignore", message=r"\s*'hydra/(launcher/joblib|sweeper/basic)' is validated against")

USAGE_ERROR = 2
RUNTIME_ERROR = 1
_GROUPS = ("trainer", "model", "data", "optimizer", "scheduler", "parallel", "project", "tracker", "experiment")


def cli() -> None:
    """``python -m runner [overrides]`` (and the ``runner`` console script): Hydra's command line, checked first."""
    from runner.data.download import DataFileError, DownloadError
    from runner.lock import FolderLocked, RunLock
    from runner.run_folder import check_run_folders, claim_default_run_folder
    from runner.worker import exit_without_finalizing

    register_configs()
    import_from_working_directory()
    try:
        if print_help(sys.argv[1:]):
            return
        check_run_folders(sys.argv[1:])  # no links in a run folder, before a resumed one is even read
        sys.argv = [sys.argv[0], *prepare_command_line(sys.argv[1:])]
        stamp("check the command line")
        # A run folder named on the command line is taken before Hydra writes its record into it.
        named = _named_run_folder(sys.argv[1:])
        check_run_folders(sys.argv[1:])  # and those that resume, torchrun and Slurm name
        if named is not None:
            check_writable(*named)
        lock = RunLock(named[0]).acquire() if named is not None else None
        claimed = claim_default_run_folder(sys.argv[1:])  # Hydra's default folder, made this run's own
        if claimed is not None:
            sys.argv.append(f"hydra.run.dir={hydra_value(str(claimed))}")
            lock = lock or RunLock(claimed).acquire()
    except ConfigError as error:
        print(f"runner: error: {error}", file=sys.stderr)
        sys.exit(USAGE_ERROR)
    except (FolderLocked, DataFileError, DownloadError) as error:
        print(f"runner: error: {error}", file=sys.stderr)
        sys.exit(RUNTIME_ERROR)
    try:
        hydra_main()
    except SystemExit as stop:
        code = stop.code
        exit_without_finalizing(0 if code is None else code if isinstance(code, int) else RUNTIME_ERROR)
        raise
    else:
        exit_without_finalizing(0)  # a torchrun worker with a process group: see the function
    finally:
        if lock is not None:
            lock.release()


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


def _named_run_folder(argv: list[str]) -> tuple[Path, str] | None:
    """The folder a single run will write and the key naming it, when the command line names it."""
    if {"-m", "--multirun"} & set(argv) or int(os.environ.get("RANK", "0")) != 0:
        return None
    named = dict(arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))
    if any(key.lstrip("+") == "trainer.node_rank" and value.strip("'\"") != "0" for key, value in named.items()):
        return None
    key = "project.project_dir" if named.get("project.project_dir") else "hydra.run.dir"
    folder = named.get(key, "").strip("'\"")
    if not folder or "${" in folder:  # unset, or an interpolation only Hydra can resolve
        return None
    return Path(folder).resolve(), key


@hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME, version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    return main(cfg)


def main(cfg: DictConfig) -> float | None:
    """Validate, resolve ``resume``, fix the run folder, and launch. Returns the sweep objective."""
    stamp("compose with Hydra")
    from runner.components import BatchError
    from runner.data import prepare_datasets
    from runner.data.mnist_files import DataFileError, DownloadError
    from runner.engine.checkpoint import CheckpointError
    from runner.launch import WorkerFailed, launch
    from runner.lock import FolderLocked, RunLock
    from runner.sweeps import JobFailed, SweepJob, apply_thread_budget
    from runner.targets import check_targets

    stamp("import torch")
    job = SweepJob.current()  # None unless this is one job of a multirun
    if job is not None and "first optimizer step" in dict(stamps()):
        restart("start the next sweep job")  # an earlier job of this process already reported its start-up
    project_dir = None
    try:
        validate(cfg)
        if slurm.under_srun() and not slurm.set_rank_environment() and cfg.trainer.num_nodes == 1:
            # Started by a Slurm job without our command line (Hydra's submitit launcher): one task per node.
            for key, value in slurm.node_launcher_settings().items():
                OmegaConf.update(cfg, key, int(value) if value.isdigit() else value)
        overrides = _task_overrides()
        if job is not None and not cfg.resume and job.resumable(_project_dir(cfg)):
            cfg.resume = str(_project_dir(cfg))  # an earlier attempt of this sweep job: continue it
        if cfg.resume:
            cfg, overrides = _resume(cfg, overrides)
            validate(cfg)
        check_targets(cfg)
        check_hardware(cfg)
        check_devices(cfg)
        project_dir = _project_dir(cfg)
        check_writable(project_dir, "project.project_dir")
        if cfg.trainer.num_nodes > 1 and cfg.trainer.node_rank == 0:
            check_rendezvous_port(cfg.trainer.rdzv_endpoint)
        elif cfg.trainer.num_nodes > 1:
            wait_for_rendezvous(cfg.trainer.rdzv_endpoint, timeout=cfg.trainer.rdzv_timeout)
        prepare_datasets(cfg.data)  # once, here (downloads, checks), rather than racing in every worker
        config = OmegaConf.to_container(cfg, resolve=True)
        config["project"]["project_dir"] = str(project_dir)
        stamp("validate and check data")
        # One launching process per run takes the folder: torchrun's rank 0, node 0 of several.
        locks = int(os.environ.get("RANK", "0")) == 0 and cfg.trainer.node_rank == 0
        with RunLock(project_dir) if locks else contextlib.nullcontext():
            if job is not None:
                processes = config["trainer"]["num_processes"]
                job.record["threads_per_process"] = apply_thread_budget(processes if isinstance(processes, int) else 1)
                job.start(project_dir, objective=(cfg.objective.metric, cfg.objective.direction))
            objective = launch(config, overrides)
    except FolderLocked as error:  # another process runs this folder: its record is not ours to touch
        _fail(job, RUNTIME_ERROR, str(error), record=False)
    except ConfigError as error:
        _fail(job, USAGE_ERROR, str(error))
    except preemption.Preempted as stop:
        message = _stopped(stop, str(project_dir), sweep=job is not None)
        if job is not None:
            job.stop(message)  # the whole sweep stops: the scheduler wants the machine back
        print(f"runner: {message}", file=sys.stderr)
        sys.exit(preemption.EXIT_CODE)
    except (WorkerFailed, CheckpointError, DownloadError, DataFileError, BatchError, JobFailed) as error:
        _fail(job, RUNTIME_ERROR, str(error))
    except Exception as error:
        if job is not None:
            job.fail(f"{type(error).__name__}: {error}")
        raise
    if job is not None:
        job.finish(objective)
    return objective


def _fail(job, code: int, message: str, *, record: bool = True) -> NoReturn:
    """Report ``message``: alone, one line and exit ``code``; in a sweep, record it in the job's
    job.json (unless ``record`` is False) and raise, so that Hydra marks the job failed and the sweep goes on.
    """
    from runner.sweeps import JobFailed

    if job is None:
        print(f"runner: error: {message}", file=sys.stderr)
        sys.exit(code)
    if record:
        job.fail(message)
    raise JobFailed(message) from None


def _stopped(stop, project_dir: str, *, sweep: bool = False) -> str:
    """One sentence for a preempted run: what stopped it, what was saved, and how to continue."""
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint

    newest, _ = newest_intact_checkpoint(checkpoints_dir(project_dir))
    saved = f"{newest.name} is saved" if newest is not None else "no checkpoint was completed"
    if sweep:
        how = "run the same sweep command again to continue"
    else:
        how = f"continue with `python -m runner resume={project_dir}`"
    agreed = f"stopped by {stop.signal_name} at a step all processes agreed on"
    return f"{agreed}; {saved}; {how} (exit code {preemption.EXIT_CODE})."


def _task_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _project_dir(cfg: DictConfig) -> Path:
    if cfg.project.project_dir:
        return Path(cfg.project.project_dir).resolve()
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir).resolve()
    raise ConfigError("project.project_dir is not set and there is no Hydra run folder; set project.project_dir.")


def _resume(cfg: DictConfig, task_overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """The resumed run's config with this command's new overrides, and the overrides it now stands for."""
    from runner.provenance import check_resumable
    from runner.resume import find_checkpoint, replayed_overrides, resumed_config, schedule_change

    # The command line already chose and verified the checkpoint (resume= now names it exactly);
    # each worker's load_state verifies it again, so sizes suffice here.
    run_dir, checkpoint = find_checkpoint(cfg.resume, verify_checksums=False)
    saved = replayed_overrides(checkpoint)  # what the command line replayed before its own overrides
    given = [o for o in task_overrides if not _is_resume(o)]
    new = given[len(saved) :] if given[: len(saved)] == saved else given
    # The command line replays the folder's own overrides first: only the new ones were typed.
    check_resumable(checkpoint, path=cfg.resume, overrides=new, search_path=_hydra_search_path())
    resumed = resumed_config(checkpoint, new)
    resumed.project.project_dir = str(run_dir)
    resumed.resume = str(checkpoint)
    if (change := schedule_change(checkpoint, resumed)) is not None:
        logger.warning("%s.", change)
    logger.info("Resuming %s from %s with new overrides %s", run_dir, checkpoint.name, new)
    return resumed, _last_per_key(saved + new)


def _hydra_search_path() -> list[str]:
    """This run's config folders as search-path entries (``file://...``, ``pkg://...``)."""
    if not HydraConfig.initialized():
        return []
    return [f"{source.schema}://{source.path}" for source in HydraConfig.get().runtime.config_sources if source.path]


def _last_per_key(overrides: list[str]) -> list[str]:
    """Overrides with only the last one of each key kept (what Hydra would apply)."""
    last = {o.split("=", 1)[0]: o for o in overrides}
    return [o for o in overrides if last[o.split("=", 1)[0]] is o]


def _is_resume(override: str) -> bool:
    return override.split("=", 1)[0].lstrip("+") == "resume"


# ------------------------------------------------------------------------------------ the command line
def print_help(argv: list[str]) -> bool:
    """``--help``: print conf/config.yaml's help template with the composed config; False if not asked.

    Hydra's own ``--help`` first lists every option of every config group (120 compositions here),
    which the template does not show: composing once instead makes ``--help`` about 4x faster. The
    groups and options listed include those of ``--config-dir`` and ``hydra.searchpath``.
    """
    import string

    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if not args.help or args.hydra_help or args.config_path:
        return False
    config_name = args.config_name or CONFIG_NAME
    overrides = list(args.overrides or [])
    search = search_path_overrides(overrides, config_dir=args.config_dir)
    overrides = [o for o in overrides if not is_search_path(o)] + search
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        except Exception as error:
            raise ConfigError(describe_composition_error(error, overrides, config_name)) from None
        groups = _group_options(search, config_name)
    template = cfg.hydra.help.template
    with open_dict(cfg):
        del cfg["hydra"]
    config = OmegaConf.to_yaml(cfg, resolve=args.resolve)
    print(string.Template(template).safe_substitute(CONFIG=config, GROUPS=groups))
    return True


def _group_options(search: list[str], config_name: str = CONFIG_NAME) -> str:
    """``  group:      option, option`` lines: the contract's groups first, then the user's own."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    # One repository over the whole search path, read once (Hydra's public call rebuilds it per group).
    loader = GlobalHydra.instance().config_loader()
    _, repository = loader._parse_overrides_and_create_caching_repo(config_name, search)
    found = repository.get_group_options("", results_filter=ObjectType.GROUP)
    names = [g for g in dict.fromkeys(("experiment", *_GROUPS)) if g in found] + ["hparams_search"]
    names += sorted(g for g in found if g not in names and g not in ("hydra", "schema"))
    lines = []
    for group in names:
        options = repository.get_group_options(group, results_filter=ObjectType.CONFIG)
        note = "   (with -m; the optuna extra)" if group == "hparams_search" else ""
        lines.append(f"  {group + ':':<11} {', '.join(options)}{note}")
    return "\n".join(lines)


def prepare_command_line(argv: list[str]) -> list[str]:
    """Check ``argv``'s overrides and add what resume and torchrun need; returns the argv for Hydra.

    Raises:
        ConfigError: An override names a key, group option or value the config does not accept.
    """
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.shell_completion or args.info:
        return argv
    overrides = list(args.overrides or [])
    flags = [arg for arg in argv if arg not in overrides]
    resume = next((o.split("=", 1)[1].strip("'\"") for o in overrides if _is_resume(o)), None)
    extra: list[str] = []
    if resume:
        if args.multirun:
            raise ConfigError("resume= continues one run; drop -m/--multirun.")
        checkpoint, saved, extra = _resume_command_line(resume, overrides, config_dir=args.config_dir)
        overrides = saved + [f"resume={hydra_value(str(checkpoint))}" if _is_resume(o) else o for o in overrides]
    if slurm.under_srun() and not args.multirun:
        given = dict(o.lstrip("+").split("=", 1) for o in overrides + extra if "=" in o)
        overrides += slurm.command_line(given)  # checked with the rest: they must make a valid config too
    check_plugins(overrides)
    if not args.config_path:
        cfg = check_overrides(
            overrides, config_name=args.config_name or CONFIG_NAME, config_dir=args.config_dir, targets=not args.cfg
        )
        if resume:
            from runner.resume import check_extent

            check_extent(checkpoint, cfg, path=resume)
    if _under_torchrun() and not args.multirun and not _sets(overrides, "hydra.run.dir") and not resume:
        extra += _torchrun_run_dir()
    return flags + overrides + extra


# Options that need one of Hydra's plugins, which come with the project's extras.
_PLUGINS = {
    ("hydra/launcher", "joblib"): ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    ("hydra/launcher", "slurm"): ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    ("hparams_search", None): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
}


def check_plugins(overrides: list[str]) -> None:
    """Raise ConfigError, with the pip command, for an option whose Hydra plugin is not installed."""
    import importlib.util

    for override in overrides:
        group, _, option = override.lstrip("+~").partition("=")
        needed = _PLUGINS.get((group, option)) or _PLUGINS.get((group, None))
        if needed is None or option in ("", "null"):
            continue
        module, extra = needed
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                f"{group}={option} needs a Hydra plugin that is not installed ({module}); install it with "
                f"pip install -e '.[{extra}]'."
            )


def _resume_command_line(
    resume: str, overrides: list[str], *, config_dir: str | None
) -> tuple[Path, list[str], list[str]]:
    from runner.provenance import check_resumable
    from runner.resume import find_checkpoint, replayed_overrides

    run_dir, checkpoint = find_checkpoint(resume)
    # Before anything of the folder's config is composed, validated or imported: it may name code.
    search_path = search_path_entries(overrides, config_dir=config_dir)
    check_resumable(checkpoint, path=resume, overrides=overrides, search_path=search_path)
    switched = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in _GROUPS]
    if switched:
        raise ConfigError(
            f"resume= keeps the resumed run's config groups, but {switched[0]} switches one; change values "
            "(e.g. trainer.max_steps=2000) or start a new run."
        )
    saved = replayed_overrides(checkpoint)
    extra = [] if _sets(overrides, "hydra.run.dir") else [f"hydra.run.dir={hydra_value(str(run_dir))}"]
    # The resumed folder keeps its original .hydra/ record; this command's record goes to run.log.
    return checkpoint, saved, [*extra, "hydra.output_subdir=null"]


def _sets(overrides: list[str], key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+") == key for o in overrides)


def check_overrides(
    overrides: list[str], *, config_name: str = CONFIG_NAME, config_dir: str | None = None, targets: bool = True
) -> DictConfig:
    """Compose the config once with ``overrides`` (sweeps reduced to their first value); returns it.

    With ``targets`` every ``_target_`` is also imported and its keys checked against its signature,
    and the datasets are prepared (``prepare_data``: fetched or checked). That imports the user's
    modules and torch, so it comes only once the rest of the command line is valid.

    Raises:
        ConfigError: One sentence naming the bad key, value or option, with the closest valid key.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            parsed.extend(parser.parse_overrides([line]))
        except Exception as error:  # Hydra's OverrideParseException
            raise ConfigError(
                f"Cannot parse the override {line!r} ({str(error).splitlines()[0]}); values with brackets, commas "
                """or spaces need inner quotes, e.g. 'data.train_split="test[:8000]"'."""
            ) from None
    single = search_path_overrides(overrides, config_dir=config_dir)
    for override in parsed:
        key = override.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue
        if override.is_sweep_override():
            single.append(f"{key}={next(iter(override.sweep_string_iterator()))}")
        else:
            single.append(override.input_line)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name, overrides=single)
        except Exception as error:
            raise ConfigError(describe_composition_error(error, single, config_name)) from None
    valid = list(OmegaConf.structured(RunnerConfig))
    unknown = sorted(set(cfg) - set(valid))
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a config key; remove it (valid top-level keys: {', '.join(valid)}).")
    validate(cfg)
    if targets:
        from runner.data import prepare_datasets
        from runner.preflight import check_construction
        from runner.targets import check_targets

        check_targets(cfg)
        check_construction(cfg)
        if not cfg.resume:
            prepare_datasets(cfg.data)  # before Hydra writes anything: missing files, splits that select nothing
    if not cfg.resume:
        check_hardware(cfg)
    return cfg


def describe_composition_error(error: Exception, overrides: list[str], config_name: str = CONFIG_NAME) -> str:
    """One sentence for Hydra's composition error: the key (with a suggestion), value or option at fault."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    if isinstance(error, MissingConfigException):
        group = next((o.split("=", 1)[0] for o in overrides if error.missing_cfg_file and
                      error.missing_cfg_file.startswith(o.split("=", 1)[0].lstrip("+~") + "/")), None)  # fmt: skip
        options = sorted(o for o in (error.options or []) if not o.endswith("_schema"))
        if group is not None:
            chosen = error.missing_cfg_file.split("/", 1)[1]
            close = difflib.get_close_matches(chosen, options, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return f"{group}={chosen} is not an option{hint}; choose one of {', '.join(options)}."
        return str(error).splitlines()[0]
    cause = error
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    if cause is None or not getattr(cause, "full_key", None):
        return str(error).splitlines()[0]
    full_key = cause.full_key
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent, _, name = full_key.rpartition(".")
        valid = _keys_at(parent, [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != full_key], config_name)
        close = difflib.get_close_matches(name, valid, n=1)
        suggestion = f" (did you mean {'.'.join(filter(None, [parent, close[0]]))!r}?)" if close else ""
        where = f"'{parent}'" if parent else "the config"
        return f"{full_key} is not a key of {where}{suggestion}; `python -m runner --cfg job` lists every key."
    # The last override of the key is the one composed (a resumed run's saved ones come first).
    value = next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0].lstrip("+~") == full_key), None)
    reason = str(cause).splitlines()[0]
    return f"{full_key}={value} is not valid: {reason}."


def _keys_at(path: str, overrides: list[str], config_name: str) -> list[str]:
    from hydra import compose

    try:
        cfg = compose(config_name, overrides=overrides)
    except Exception:
        return []
    node = OmegaConf.select(cfg, path) if path else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


# ---------------------------------------------------------------------------------------------- torchrun
def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


def _torchrun_run_dir() -> list[str]:
    """Hydra overrides that put every torchrun rank in one run folder, written by rank 0 only.

    Each rank runs Hydra itself, and ``${now:}`` differs between processes that start a second
    apart. The ranks agree through the elastic agent's own TCPStore: the first proposal wins.
    """
    rank = int(os.environ["RANK"])
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
        )
        stamp = store.compare_set("runner/run_dir_stamp", "", stamp).decode()
    else:
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        if run_id == "none":
            raise ConfigError(
                "Under this launcher the ranks cannot agree on a run folder; pass hydra.run.dir=... (the same on "
                "every rank) or torchrun --rdzv-id."
            )
        stamp = f"torchrun-{run_id}"
    extra = [f"hydra.run.dir=outputs/{stamp}"]
    if rank != 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return extra
