"""Files that appear whole or not at all, and are still there after a power loss.

A rename is atomic, but not durable by itself: until the file's data and the folder's new entry
reach the disk, a crash can leave the old name, the new name pointing at an empty file, or nothing,
depending on the filesystem. So every file the runner and the engine write goes through
:func:`write_atomically`: a temporary name beside the target, the data flushed and fsynced, the
rename, then the folder fsynced. A checkpoint folder is committed the same way, all at once: its
files are written in place inside its staging folder, and :func:`sync_tree` fsyncs every file and
folder in it before the rename that makes it exist.

Nothing is ever written through a symbolic link: the temporary name is created afresh (a leftover
one, or a link planted there, is removed first, never followed), and the rename replaces a link
at the target rather than writing where it points.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

TEMPORARY_SUFFIX = ".tmp"


def fsync_path(path: str | os.PathLike) -> None:
    """Flush ``path`` (a file or a folder) to the disk.

    Filesystems that cannot sync a folder (some network and Windows ones) are skipped: there the
    rename is as durable as they make it.
    """
    is_folder = os.path.isdir(path)
    try:
        descriptor = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if is_folder else 0))
    except (IsADirectoryError, PermissionError):  # a folder that cannot be opened (Windows): nothing to sync
        if not is_folder:
            raise
        return
    try:
        os.fsync(descriptor)
    except OSError as error:  # EINVAL for a folder this filesystem does not sync; a file that cannot be synced failed
        if not is_folder:
            raise OSError(error.errno, error.strerror, str(path)) from None
    finally:
        os.close(descriptor)


def commit_file(partial: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the complete file ``partial`` durable under the name ``path``: fsync it, rename it, fsync the folder."""
    fsync_path(partial)
    os.replace(partial, path)
    fsync_path(Path(path).parent)


def write_atomically(
    path: str | os.PathLike, write: Callable[[Path], None], *, mode: int = 0o666, shared: bool = False
) -> None:
    """Call ``write(temporary)`` to fill a fresh file beside ``path``, then :func:`commit_file` it into place.

    A failing ``write`` leaves ``path`` as it was and removes the temporary file.

    Args:
        path: The file to write.
        write: Writes the whole file at the path it is given.
        mode: The new file's permissions (before the umask).
        shared: Several processes may write ``path`` at once (a sweep's summary): each writes under a
            temporary name of its own, and the last rename wins.

    Example:
        >>> write_atomically(folder / "model.safetensors", lambda p: save_file(tensors, p))
    """
    path = Path(path)
    own = f".{os.getpid()}" if shared else ""
    partial = path.with_name(f"{path.name}{own}{TEMPORARY_SUFFIX}")
    if os.path.lexists(partial):
        partial.unlink()  # left by a write that crashed (unlink removes a link itself, never its target)
    os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode))
    try:
        write(partial)
        commit_file(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_text_atomically(path: str | os.PathLike, text: str, *, mode: int = 0o666, shared: bool = False) -> None:
    """:func:`write_atomically` of ``text`` as UTF-8."""
    write_atomically(path, lambda partial: partial.write_text(text, encoding="utf-8"), mode=mode, shared=shared)


def sync_tree(folder: str | os.PathLike) -> None:
    """fsync every file and folder under ``folder`` (itself included), the deepest first."""
    for root, folders, names in os.walk(folder, topdown=False):
        for name in names:
            if not os.path.islink(os.path.join(root, name)):
                fsync_path(os.path.join(root, name))
        for name in folders:
            if not os.path.islink(os.path.join(root, name)):
                fsync_path(os.path.join(root, name))
    fsync_path(folder)


def hard_link_sentence(path: Path, names: int, *, then: str) -> str:
    """The one sentence for a file of a run folder that has other names (a hard link, ``names`` of them): reading it
    reads a file that may not be the run's. ``then`` says what to do with the copy."""
    return (
        f"{path} is a hard link (its file has {names} names, any of them perhaps outside the run); a run folder holds "
        f"only files of its own, so copy the run with cp -r, which writes each file anew, and {then}."
    )
