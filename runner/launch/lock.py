"""One run per folder: the launching process holds an exclusive lock on ``project_dir/.runner.lock``.

The lock is the kernel's (``fcntl.flock``), so it disappears with the process that held it: a
lock file left by a run that died is simply taken over (with a note naming the dead run). The file
records who holds it, so a refused run can say which run is writing the folder. It is opened
with ``O_NOFOLLOW``: a ``.runner.lock`` that is a symbolic link (in a folder copied from elsewhere)
is refused, rather than truncating the file it points to.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".runner.lock"
logger = logging.getLogger("runner")
_HELD: dict[Path, int] = {}  # lock file -> how many holders in this process (the lock is re-entrant)
_OPEN: dict[Path, int] = {}  # lock file -> the descriptor this process holds it with


def _leave_locks_to_the_parent() -> None:
    """In a forked child (the trackers' helper, a loader worker): the lock stays the parent's alone, so a child
    that outlives its parent does not keep the folder locked. The descriptor is pointed at /dev/null rather
    than closed, so the parent's file object, copied into the child, never closes a descriptor reused since."""
    if not _OPEN:
        return
    null = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    for descriptor in _OPEN.values():
        os.dup2(null, descriptor)
    os.close(null)
    _OPEN.clear()
    _HELD.clear()


os.register_at_fork(after_in_child=_leave_locks_to_the_parent)


class FolderLocked(RuntimeError):
    """Another live run holds the folder's lock. One sentence."""


class RunLock:
    """Held from :meth:`acquire` until :meth:`release` or the end of this process."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_NAME
        self._file = None

    def acquire(self) -> RunLock:
        """Take the lock, or raise :class:`FolderLocked` naming the run that holds it.

        Raises:
            FolderLocked: Another live run holds the lock.
            ConfigError: ``.runner.lock`` is a symbolic or hard link (one sentence naming it and the fix).
        """
        key = self._key()
        if _HELD.get(key):
            _HELD[key] += 1
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError:
            if self.path.is_symlink():
                from runner.folders.layout import link_error

                raise link_error(self.path) from None
            raise
        _OPEN[key] = descriptor  # from now: a child forked meanwhile must not keep it
        handle = os.fdopen(descriptor, "r+")  # held open for the lock's lifetime
        if os.fstat(descriptor).st_nlink > 1:  # a hard link: truncating it would empty a file elsewhere
            _OPEN.pop(key, None)
            handle.close()
            from runner.config import ConfigError

            raise ConfigError(
                f"{self.path} has other names (it is a hard link to a file elsewhere); a run folder holds no links, "
                "so remove it."
            )
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(handle))
            _OPEN.pop(key, None)
            handle.close()
            raise FolderLocked(
                f"{self.path.parent} is being written by another run ({holder}); wait for it to finish, or give "
                "this run another folder."
            ) from None
        previous = _read(handle)
        if previous:
            logger.warning("Taking over %s from a run that is no longer running (%s)", self.path, _describe(previous))
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}))
        handle.flush()
        self._file = handle
        _HELD[key] = 1
        return self

    def release(self) -> None:
        key = self._key()
        if _HELD.get(key, 0) > 1 or self._file is None:
            _HELD[key] = max(_HELD.get(key, 1) - 1, 0)
            return
        _HELD.pop(key, None)
        if _OPEN.pop(key, None) is None:  # a forked child's copy: the lock is the parent's to release
            self._file = None
            return
        self._file.seek(0)
        self._file.truncate()  # an empty file: nobody to take over from
        self._file.flush()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None

    def _key(self) -> Path:
        return self.path.parent.resolve() / LOCK_NAME  # the lock file itself is never followed

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(handle) -> dict:
    handle.seek(0)
    try:
        return json.loads(handle.read() or "{}")
    except ValueError:
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "a run that has not recorded itself yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder.get('pid')} on {holder.get('host')}, since {since}"


def is_locked(folder: Path) -> bool:
    """Whether a live run holds ``folder``'s lock (read-only: creates and changes nothing)."""
    path = Path(folder) / LOCK_NAME
    try:
        handle = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError:
        return False  # none, or a link: no run of ours holds it
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False
