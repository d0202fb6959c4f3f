"""The checkpoint folders of a project: their names, which ones count, and how one is committed or rotated.

A checkpoint exists only when complete: it is written under ``<name>.incomplete`` and renamed to its
final name once ``manifest.json`` is written (last). A folder without a manifest is never loaded or
counted, and rotation deletes only committed checkpoints, only after the new one is committed, and
never the one this run was loaded from. A ``checkpoint_N`` that is a symbolic link is never loaded,
counted or deleted through.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from runner.engine.checkpoint.manifest import (
    DEFAULT_CHECKSUM,
    CheckpointError,
    CheckpointNotFoundError,
    read_manifest,
)
from runner.engine.checkpoint.manifest_schema import CHECKSUMS
from runner.engine.constants import CHECKPOINT_PREFIX, CHECKPOINTS_DIR, INCOMPLETE_SUFFIX, MANIFEST_NAME
from runner.files import fsync_path

_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


@dataclass
class ProjectConfiguration:
    """Where a project writes, and how it names and rotates checkpoints (Accelerate's names).

    Args:
        project_dir: The folder for checkpoints (``project_dir/checkpoints``) and logs.
        logging_dir: Where trackers write; defaults to ``project_dir``.
        automatic_checkpoint_naming: ``save_state()`` writes ``checkpoints/checkpoint_{iteration}``.
        total_limit: Keep at most this many checkpoints (the newest) under automatic naming.
        iteration: The number the next automatically named checkpoint gets.
        save_on_each_node: ``project_dir`` (or ``output_dir``) is on each node's own disk: every node
            keeps a copy of each checkpoint, written and committed by its local main process (see
            :mod:`runner.engine.checkpoint.node_local`). Off by default: one folder every rank sees.
        checksum: The digest the manifest records of each file's slices and loading verifies:
            ``"xxh3_128"`` (xxHash, an integrity check at memory speed; the default) or ``"sha256"``
            (cryptographic, about 6x slower to hash). Either reads checkpoints saved with the other.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    checksum: str = DEFAULT_CHECKSUM

    def __post_init__(self) -> None:
        if self.checksum not in CHECKSUMS:
            choices = " or ".join(map(repr, CHECKSUMS))
            raise ValueError(f"checksum={self.checksum!r} is not a digest checkpoints record; use {choices}.")
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"total_limit={self.total_limit} must be at least 1 (or None to keep all).")

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` if it was unset)."""
        self.project_dir = None if project_dir is None else str(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


def checkpoint_number(path: str | os.PathLike) -> int | None:
    """N for a folder named ``checkpoint_N``, else None."""
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_committed(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def committed_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """The committed ``checkpoint_N`` folders in ``checkpoints_dir``, oldest first; anything else is ignored.

    A ``checkpoint_N`` that is a symbolic link is ignored too, with a warning: resuming or rotating
    through it would read or delete a folder outside the run.
    """
    directory = Path(checkpoints_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        number = checkpoint_number(path)
        if number is not None and path.is_symlink():
            warnings.warn(f"Ignoring {path}: it is a symbolic link, not a checkpoint of this run.", stacklevel=2)
        elif number is not None and path.is_dir() and is_committed(path):
            found.append((number, path))
    return [path for _, path in sorted(found)]


def newest_checkpoint_number(checkpoints_dir: str | os.PathLike) -> int | None:
    """The largest N of any ``checkpoint_N`` folder (committed or not) in ``checkpoints_dir``."""
    directory = Path(checkpoints_dir)
    numbers = [checkpoint_number(p) for p in directory.iterdir()] if directory.is_dir() else []
    return max((n for n in numbers if n is not None), default=None)


def newest_intact_checkpoint(
    directory: Path, *, verify_checksums: bool = True, check: Callable[[Path], None] | None = None
) -> tuple[Path | None, list[tuple[Path, CheckpointError]]]:
    """The newest committed checkpoint in ``directory`` whose files match its manifest, and the newer
    damaged ones skipped on the way (each with its error). ``verify_checksums=False``: only the cheap
    checks of :func:`read_manifest` (the load that follows hashes the files). ``check``: a further test
    of a checkpoint whose manifest holds, raising CheckpointError for one to skip as damaged."""
    skipped = []
    for checkpoint in reversed(committed_checkpoints(directory)):
        try:
            if check is not None:  # after the manifest's own checks, which say more; before the hashing
                read_manifest(checkpoint, verify_checksums=False)
                check(checkpoint)
            read_manifest(checkpoint, verify_checksums=verify_checksums)
        except CheckpointError as error:
            skipped.append((checkpoint, error))
            continue
        return checkpoint, skipped
    return None, skipped


def checkpoint_to_load(config: ProjectConfiguration, input_dir: str | os.PathLike | None) -> Path:
    """``input_dir``, or the newest committed checkpoint of the project under automatic naming."""
    if input_dir is not None:
        return Path(input_dir)
    if not (config.automatic_checkpoint_naming and config.project_dir):
        raise ValueError("load_state() needs an input_dir unless automatic_checkpoint_naming is on.")
    found = committed_checkpoints(checkpoints_dir(config.project_dir))
    if not found:
        raise CheckpointNotFoundError(f"No complete checkpoint in {checkpoints_dir(config.project_dir)} to load.")
    return found[-1]


def next_automatic_checkpoint(config: ProjectConfiguration) -> Path:
    """``project_dir/checkpoints/checkpoint_{iteration}``, or past the newest folder if that one is taken.

    A taken number is never overwritten, and the save never fails over it (that would lose the
    training since the last checkpoint): the numbering continues after the newest folder, with a
    warning.
    """
    if config.project_dir is None:
        raise ValueError("automatic_checkpoint_naming needs a project_dir; pass project_dir= to the Accelerator.")
    directory = checkpoints_dir(config.project_dir)
    number = config.iteration
    newest = newest_checkpoint_number(directory)
    if newest is not None and number <= newest:
        warnings.warn(
            f"{directory / f'{CHECKPOINT_PREFIX}{number}'} is taken (the newest is {CHECKPOINT_PREFIX}{newest}); "
            f"saving as {CHECKPOINT_PREFIX}{newest + 1} so nothing is overwritten.",
            stacklevel=5,  # the caller of Accelerator.save_state
        )
        number = newest + 1
    return directory / f"{CHECKPOINT_PREFIX}{number}"


def checkpoints_dir(project_dir: str | os.PathLike) -> Path:
    return Path(project_dir) / CHECKPOINTS_DIR


def staging_dir(target: Path) -> Path:
    """Where the checkpoint ``target`` is written before its commit."""
    return target.with_name(target.name + INCOMPLETE_SUFFIX)


def check_writable_target(target: Path) -> None:
    """Refuse an ``output_dir`` that holds anything but a checkpoint: saving replaces the folder whole."""
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not is_committed(target))):
        raise CheckpointError(
            f"{target} exists and is not a checkpoint; save_state replaces its output_dir whole, so pass a new "
            "or empty folder (or a previous checkpoint's)."
        )


def commit(staging: Path, target: Path) -> None:
    """Make the written ``staging`` folder the checkpoint ``target``, by renames (and fsync of the parent)."""
    previous = rename_into_place(staging, target)
    fsync_path(target.parent)
    if previous is not None:
        remove_folder(previous)


def rename_into_place(staging: Path, target: Path) -> Path | None:
    """Rename ``staging`` to ``target``; return the checkpoint it replaced, kept aside as ``<target>.previous``
    (or None), for the caller to delete once the parent folder is synced (or, on a node-local save, once every
    node has renamed). A crash at any moment leaves either the old or the new checkpoint intact."""
    previous = None
    if target.exists() and not (target.is_dir() and not any(target.iterdir())):
        # An explicit output_dir that already holds a checkpoint: swap, the old one deleted after.
        previous = target.with_name(target.name + ".previous")
        remove_folder(previous)
        os.replace(target, previous)
    try:
        os.replace(staging, target)  # onto an empty directory, rename replaces it atomically
    except OSError:
        if previous is not None:
            os.replace(previous, target)
        raise
    return previous


def remove_folder(path: Path) -> None:
    """Remove a folder of ours; a symbolic link in its place is removed itself, never followed."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def failure_reason(error: BaseException) -> str:
    """What went wrong, in a few words: the OS error (of the first failed rank, for DCP's exception)."""
    if isinstance(error, OSError):
        return f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    first = next(iter((getattr(error, "failures", None) or {}).values()), None)
    if isinstance(first, tuple) and isinstance(first[0], OSError):
        return failure_reason(first[0])
    return str(error).splitlines()[0].rstrip(".")  # inside our sentence, in parentheses


def rotate_checkpoints(directory: Path, *, total_limit: int, protect: Path | None = None) -> list[Path]:
    """Delete intact checkpoints older than the newest ``total_limit`` intact ones, except ``protect``.

    Only intact checkpoints count, so a damaged one never takes the place of one that loads; damaged
    ones are left as they are (with a warning), for a person to look at. Rotation runs after every
    commit, so "intact" is the cheap check, ``read_manifest(verify_checksums=False)``: the manifest's
    fields and digest, its files against what it records, no symbolic links, and every size; not
    the digests of every file of every kept checkpoint on each save. Symbolic links named
    ``checkpoint_N`` are neither counted nor followed (see :func:`committed_checkpoints`), and a
    folder that cannot be deleted is warned about: the new checkpoint is committed either way.

    Returns:
        The folders deleted.
    """
    intact = [path for path in committed_checkpoints(directory) if _is_intact_by_size(path)]
    keep = {path.resolve() for path in intact[-total_limit:]}
    if protect is not None:
        keep.add(protect.resolve())
    deleted = []
    for path in intact:
        if path.resolve() in keep:
            continue
        try:
            shutil.rmtree(path)  # refuses a symbolic link swapped in since the listing
        except OSError as error:
            warnings.warn(
                f"Rotation could not delete {path} ({failure_reason(error)}); delete it by hand.", stacklevel=2
            )
        else:
            deleted.append(path)
    return deleted


def _is_intact_by_size(checkpoint: Path) -> bool:
    try:
        read_manifest(checkpoint, verify_checksums=False)
    except CheckpointError as error:
        warnings.warn(f"Rotation keeps {checkpoint.name} without counting it: {error}", stacklevel=3)
        return False
    return True
