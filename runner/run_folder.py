"""The run folder before Hydra sees it: refuse one that holds symbolic links, and give each new run its own.

Both checks run in the launching process, before Hydra (or anything else) writes a byte:

* **No links in a run folder.** A run writes ``.runner.lock``, ``run.log``, ``.hydra/``, ``logs/``,
  ``checkpoints/``, ``model/`` and ``metrics.json`` into its folder, truncating, appending and
  deleting as it goes. A folder someone else wrote (a copy, a download) may hold a link where one of
  those belongs, and writing through it would change the link's target instead: a file or folder of
  the user's. So a run folder that already exists is walked once, every entry at every depth, and a
  link anywhere in it stops the run in one sentence. The walk reads directory entries only
  (``os.scandir`` knows an entry's type without a ``stat`` on most file systems), so a folder of
  many thousands of files costs milliseconds. The folder itself and the folders above it may be
  links (``outputs -> /scratch/outputs``): the user named that path, and it is resolved once.
* **A new folder per run.** ``hydra.run.dir``'s default names a folder by the second the run
  started, so two runs started in the same second would share one, and Hydra writes its record
  before the second one can be refused. :func:`claim_default_run_folder` creates the folder the
  default names (``os.mkdir`` fails if it exists: the claim is atomic), or the first free
  ``<name>-1``, ``<name>-2``, ..., and the command line then names it to Hydra.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from itertools import count
from pathlib import Path

from runner.config import CONF_DIR, CONFIG_NAME, ConfigError

# Keys that name a folder a run (or each job of a sweep) writes into.
FOLDER_KEYS = ("hydra.run.dir", "project.project_dir", "hydra.sweep.dir")
_NOW = re.compile(r"\$\{now:([^}]*)\}")


def link_error(path: Path) -> ConfigError:
    """The one sentence for a symbolic link found at ``path`` inside a run folder."""
    target = os.readlink(path)
    shown = target if os.path.isabs(target) else os.path.normpath(os.path.join(os.path.dirname(path), target))
    return ConfigError(
        f"{path} is a symbolic link (to {shown}); a run folder holds no links, so remove it or copy the run with "
        "links resolved (cp -rL)."
    )


def check_no_links(folder: Path) -> None:
    """Raise :class:`ConfigError` naming a symbolic link anywhere inside ``folder`` (none if it does not exist).

    Raises:
        ConfigError: One sentence naming the link, where it points, and the fix.
    """
    pending = [Path(folder)]
    while pending:
        current = pending.pop()
        try:
            entries = os.scandir(current)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet, or a file: check_writable and Hydra report those
        with entries:
            for entry in entries:
                if entry.is_symlink():
                    raise link_error(Path(entry.path))
                if entry.is_dir(follow_symlinks=False):
                    pending.append(Path(entry.path))


def check_run_folders(argv: list[str]) -> None:
    """:func:`check_no_links` for every run folder ``argv`` names: those of :data:`FOLDER_KEYS` and ``resume=``'s.

    A ``resume=`` path is taken as written, not resolved: a linked ``checkpoints/`` or
    ``checkpoint_N`` would otherwise move the run, and Hydra's writes, to wherever the link points.
    """
    given = _overrides(argv)
    folders = {_as_written(value) for key, value in given.items() if key in FOLDER_KEYS and "${" not in value}
    if given.get("resume", "null") != "null":
        folders.add(resumed_run_folder(given["resume"]))
    for folder in sorted(folders):
        check_no_links(folder)


def resumed_run_folder(resume: str) -> Path:
    """The run folder ``resume=`` names, from the path as written: a run folder, or its ``checkpoints/<name>``."""
    from runner.engine.constants import CHECKPOINTS_DIR

    path = _as_written(resume)
    return path.parent.parent if path.parent.name == CHECKPOINTS_DIR else path


def _as_written(folder: str) -> Path:
    """``folder`` made absolute without following links (``..`` is taken as written, too)."""
    return Path(os.path.normpath(Path(folder).expanduser().absolute()))


def claim_default_run_folder(argv: list[str]) -> Path | None:
    """Create this run's folder when Hydra would name it from ``conf/config.yaml``'s ``hydra.run.dir``; else None.

    Only a single run that starts a job and whose command line names no ``hydra.run.dir`` is given a
    folder here: a resume, torchrun and Slurm already name theirs (``prepare_command_line`` adds it),
    and a sweep's jobs are numbered folders of their sweep. When the command line brings configs of
    its own (``--config-dir``, ``--config-name``, ``hydra.searchpath``), they are composed to see
    whether they set ``hydra.run.dir``: a pattern of the user's own is left to Hydra.

    Raises:
        ConfigError: The folder cannot be created.
    """
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    asked_for_no_run = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    if asked_for_no_run or args.multirun or args.config_path:
        return None
    given = _overrides(argv)
    if args.experimental_rerun or "hydra.run.dir" in given:
        return None
    default = default_run_dir_pattern(CONF_DIR)
    if (args.config_dir or args.config_name or "hydra.searchpath" in given) and _composed_pattern(args) != default:
        return None
    return claim_run_folder(default)


def default_run_dir_pattern(conf_dir: Path) -> str:
    """``hydra.run.dir`` as ``conf_dir/config.yaml`` writes it (``${now:...}`` unresolved)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(Path(conf_dir) / "config.yaml").hydra.run)["dir"]


def _composed_pattern(args) -> str | None:
    """``hydra.run.dir`` (unresolved) as the command line's configs compose it; None if they do not compose."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner.search_path import search_path_overrides

    overrides = list(args.overrides or [])
    search = search_path_overrides(overrides, config_dir=args.config_dir)
    given = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(args.config_name or CONFIG_NAME, overrides=given + search, return_hydra_config=True)
        except Exception:  # prepare_command_line composed these already; if not, Hydra names the folder and reports
            return None
    return OmegaConf.to_container(cfg.hydra.run)["dir"]


def claim_run_folder(pattern: str, *, now: datetime | None = None) -> Path | None:
    """Create the folder ``pattern`` names at ``now`` (``${now:FORMAT}`` filled in as Hydra does), or the first
    free ``<name>-1``, ``<name>-2``, ...; None if ``pattern`` holds interpolations other than ``${now:...}``.

    Raises:
        ConfigError: The folder cannot be created.
    """
    moment = now or datetime.now()
    first = Path(_NOW.sub(lambda match: moment.strftime(match.group(1)), pattern))
    if "${" in str(first):
        return None
    for suffix in count():
        folder = first if suffix == 0 else first.with_name(f"{first.name}-{suffix}")
        try:
            os.makedirs(folder.parent, exist_ok=True)
            folder.mkdir()  # fails if another run took the name first: the claim is atomic
        except FileExistsError as error:
            if error.filename == str(folder):
                continue
            raise _cannot_create(folder, error) from None
        except OSError as error:
            raise _cannot_create(folder, error) from None
        return folder
    raise AssertionError("unreachable: count() is endless")


def _cannot_create(folder: Path, error: OSError) -> ConfigError:
    return ConfigError(
        f"The run folder {folder} cannot be created ({error.filename}: {error.strerror}); start the run from a folder "
        "this user can write, or name one with hydra.run.dir=..."
    )


def _overrides(argv: list[str]) -> dict[str, str]:
    """``key=value`` overrides of ``argv`` (the last one of each key), keys without ``+``/``++``, values unquoted."""
    pairs = (arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-"))
    return {key.lstrip("+"): value.strip("'\"") for key, value in pairs}
