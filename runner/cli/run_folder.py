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
from runner.config import overrides as parsed
from runner.folders.layout import as_written as _as_written
from runner.folders.layout import check_no_links, resumed_run_folder

# Keys that name a folder a run (or each job of a sweep) writes into.
FOLDER_KEYS = ("hydra.run.dir", "project.project_dir", "hydra.sweep.dir")
_NOW = re.compile(r"\$\{now:([^}]*)\}")


def check_run_folders(overrides: list[str]) -> None:
    """:func:`~runner.folders.layout.check_no_links` for every run folder ``overrides`` name: those of
    :data:`FOLDER_KEYS` and ``resume=``'s.

    A ``resume=`` path is taken as written, not resolved: a linked ``checkpoints/`` or
    ``checkpoint_N`` would otherwise move the run, and Hydra's writes, to wherever the link points.
    A ``resume=`` folder without ``checkpoints/`` is no run: :func:`runner.config.resume.find_checkpoint` says so.
    """
    given = parsed.values(overrides)
    folders = {_as_written(given[key]) for key in FOLDER_KEYS if _is_path(given.get(key))}
    if _is_path(given.get("resume")):
        from runner.engine.constants import CHECKPOINTS_DIR  # imports torch: a resume needs it anyway

        run = resumed_run_folder(given["resume"])
        # A folder that is not a run (no checkpoints/ of its own) is refused as such by the resume itself.
        if (run / CHECKPOINTS_DIR).is_dir() or (run / CHECKPOINTS_DIR).is_symlink():
            folders.add(run)
    for folder in sorted(folders):
        check_no_links(folder)


def _is_path(value: str | None) -> bool:
    """Whether an override's value names a folder here (not unset, and no interpolation only Hydra resolves)."""
    return value not in (None, "", "null") and "${" not in value


def claim_default_run_folder(args, *, created: list[Path] | None = None) -> Path | None:
    """Create this run's folder when Hydra would name it from ``conf/config.yaml``'s ``hydra.run.dir``; else None.

    ``args`` is Hydra's parsed command line. Only a single run that starts a job and whose command line
    names no ``hydra.run.dir`` is given a folder here: a resume, torchrun and Slurm already name
    theirs (:func:`runner.cli.command_line.read` adds it), and a sweep's jobs are numbered folders
    of their sweep. When the command line brings configs of
    its own (``--config-dir``, ``--config-name``, ``hydra.searchpath``), they are composed to see
    whether they set ``hydra.run.dir``: a pattern of the user's own is left to Hydra.

    Raises:
        ConfigError: The folder cannot be created.
    """
    asked_for_no_run = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    if asked_for_no_run or args.multirun or args.config_path:
        return None
    given = list(args.overrides or [])
    if args.experimental_rerun or parsed.sets(given, "hydra.run.dir"):
        return None
    default = default_run_dir_pattern(CONF_DIR)
    own_configs = args.config_dir or args.config_name or parsed.sets(given, "hydra.searchpath")
    if own_configs and _composed_pattern(args) != default:
        return None
    return claim_run_folder(default, created=created)


def release_run_folder(folder: Path, created: list[Path]) -> None:
    """Remove ``folder``, claimed by this command and left unused (the checks refused the command), and the parents
    the claim ``created``, where each is still empty."""
    for each in [folder, *created]:  # deepest first
        try:
            each.rmdir()
        except OSError:  # something was written there meanwhile: it stays, and so do its parents
            return


def default_run_dir_pattern(conf_dir: Path) -> str:
    """``hydra.run.dir`` as ``conf_dir/config.yaml`` writes it (``${now:...}`` unresolved)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(Path(conf_dir) / "config.yaml").hydra.run)["dir"]


def _composed_pattern(args) -> str | None:
    """``hydra.run.dir`` (unresolved) as the command line's configs compose it; None if they do not compose."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from runner.config.search_path import search_path_overrides

    overrides = list(args.overrides or [])
    search = search_path_overrides(overrides, config_dir=args.config_dir)
    given = [o for o in overrides if not parsed.is_hydra(o)]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(args.config_name or CONFIG_NAME, overrides=given + search, return_hydra_config=True)
        except Exception:  # the command line composed these already; if not, Hydra names the folder and reports
            return None
    return OmegaConf.to_container(cfg.hydra.run)["dir"]


def claim_run_folder(pattern: str, *, now: datetime | None = None, created: list[Path] | None = None) -> Path | None:
    """Create the folder ``pattern`` names at ``now`` (``${now:FORMAT}`` filled in as Hydra does), or the first
    free ``<name>-1``, ``<name>-2``, ...; None if ``pattern`` holds interpolations other than ``${now:...}``.
    ``created`` gets the parent folders made for it, deepest first (for :func:`release_run_folder`).

    Raises:
        ConfigError: The folder cannot be created.
    """
    moment = now or datetime.now()
    first = Path(_NOW.sub(lambda match: moment.strftime(match.group(1)), pattern))
    if "${" in str(first):
        return None
    missing = [parent for parent in first.absolute().parents if not parent.exists()]
    for suffix in count():
        folder = first if suffix == 0 else first.with_name(f"{first.name}-{suffix}")
        try:
            os.makedirs(folder.parent, exist_ok=True)
            if created is not None and suffix == 0:
                created.extend(parent for parent in missing if parent.is_dir())
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
