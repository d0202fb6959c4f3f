"""What ``runner export`` reads and writes beside the export itself: its staging folder (fresh, removed on a
failure or a stop signal, committed by one rename), the files it copies from a folder you may not have written
(never through a link, symbolic or hard), and the config values it may build ``config.json`` from (other keys
and the resolvers that read only the config). See :mod:`runner.cli.export`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from runner.files import hard_link_sentence
from runner.folders.foreign_config import PURE_RESOLVERS, RESOLVER

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A staging folder's name says which machine and process writes it, so that a later export tells one a killed
# export left (its process gone) from one being written now, here or by another machine sharing the disk.
_STAGING = re.compile(r"\..+\.partial-(?P<host>.+)-(?P<pid>[1-9][0-9]{0,9})-[0-9a-f]{16}")

# What a config value may hold for export to resolve it: a reference to another key (${a.b}, ${.sibling},
# ${..a.b}), or a resolver that reads only the config (its first argument a key, its default plain). Any other
# resolver may read this machine's environment or files, which config.json would carry to whoever it is shared with.
_KEY = r"\.*[\w\-]+(?:\.[\w\-]+)*"
_REFERENCES = (
    re.compile(rf"\$\{{\s*({_KEY})\s*\}}"),
    re.compile(
        rf"\$\{{\s*(?:oc\.select|oc\.dict\.keys|oc\.dict\.values|oc\.deprecated)\s*:\s*({_KEY})\s*"
        r"(?:,[^${}\\]*)?\}"
    ),
)
# now: registered by Hydra's app only, so it cannot resolve here
_PURE_RESOLVERS = tuple(name for name in PURE_RESOLVERS if name != "now")


class ExportError(Exception):
    """One sentence: what is wrong with the command line or the folder, and what to do."""


class ExportStopped(BaseException):
    """SIGTERM or SIGINT arrived before the export was whole: the staging folder is gone and ``--to`` untouched.

    A BaseException, as KeyboardInterrupt is, so that no ``except Exception`` on the way swallows it.
    """

    def __init__(self, number: int, destination: Path) -> None:
        super().__init__(f"export stopped by {signal.Signals(number).name}; nothing was written to {destination}.")
        self.exit_code = 128 + number


# ---------------------------------------------------------------------------- the staging folder and its commit
class _StopSignals:
    """While an export runs, SIGTERM and SIGINT raise :class:`ExportStopped`, so that the staging folder is removed
    on the way out: SIGTERM's default action would leave it behind, SIGINT's KeyboardInterrupt print a traceback.
    Once :attr:`stoppable` is cleared (the rename that commits the export) a signal is ignored: the export is then
    whole a moment later, or fails by itself. Handlers are set on the main thread only, where Python runs them."""

    def __init__(self, destination: Path) -> None:
        self.destination = destination
        self.stoppable = True
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._stop) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exception: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _stop(self, number: int, frame: object) -> None:
        if self.stoppable:
            self.stoppable = False  # a second signal must not cut the removal of the staging folder short
            raise ExportStopped(number, self.destination)


def _new_staging(destination: Path) -> Path:
    """A new folder beside ``destination``, under a name no one can plant beforehand: mkdir makes it or fails, and
    never follows or reuses what is there. Staging folders that killed exports left there are removed first."""
    _remove_abandoned_staging(destination.parent)
    token = secrets.token_hex(8)
    staging = destination.with_name(f".{destination.name}.partial-{_host()}-{os.getpid()}-{token}")
    try:
        staging.mkdir()
    except OSError as error:
        raise ExportError(
            f"--to {destination}: cannot create a folder in {destination.parent} ({error.strerror}); give a folder "
            "whose parent you can write."
        ) from None
    return staging


def _remove_abandoned_staging(parent: Path) -> None:
    """Remove the staging folders that exports on this machine left in ``parent`` when killed (SIGKILL, a power cut):
    real folders of this user's whose process is gone. A link or a file of such a name, another machine's folder
    (a shared disk) and a running export's are left alone."""
    if os.name != "posix":  # no way to ask whether a process lives without signalling it
        return
    try:
        entries = list(os.scandir(parent))
    except OSError:  # a folder we may not list: the staging folder is still made there, or refused
        return
    host = _host()
    for entry in entries:
        found = _STAGING.fullmatch(entry.name)
        if found is None or found["host"] != host or _is_alive(int(found["pid"])):
            continue
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid():
            shutil.rmtree(entry.path, ignore_errors=True)  # refuses a link put there since: never followed


def _host() -> str:
    return re.sub(r"[^\w.-]", "_", socket.gethostname()) or "host"


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a number no process has: leave it alone
        return True
    return True


def _commit(staging: Path, destination: Path) -> None:
    """Rename ``staging`` to ``destination``: new, or an empty folder, which the rename replaces in one step."""
    try:
        os.rename(staging, destination)
    except OSError as error:  # something appeared at --to since it was checked
        raise ExportError(
            f"--to {destination} changed during the export ({error.strerror}); give a new or empty folder (nothing "
            "was written)."
        ) from None


# ------------------------------------------------------------------------------ reading a folder you did not write
def _check_own_files(checkpoint: Path) -> None:
    """Refuse a link in what export reads: the checkpoint, the run's checkpoints folder itself and its model folder.

    A symbolic link, or a hard link (a file with other names, which may be outside the folder: a key in your home),
    would make export read, and copy into ``--to``, a file that is not the run's.
    """
    from runner.folders.layout import MODEL_DIR

    run = _run_folder(checkpoint)
    if run is not None:
        _refuse_link(checkpoint.parent, os.lstat(checkpoint.parent))
        _refuse_links(run / MODEL_DIR)
    _refuse_links(checkpoint)


def _refuse_links(folder: Path) -> None:
    """ExportError for the first symbolic or hard link at ``folder`` or under it (nothing if it is not there)."""
    try:
        pending = [(folder, os.lstat(folder))]
    except FileNotFoundError:
        return
    while pending:
        path, info = pending.pop()
        _refuse_link(path, info)
        if stat.S_ISDIR(info.st_mode):
            try:
                with os.scandir(path) as entries:
                    pending += [(Path(entry.path), entry.stat(follow_symlinks=False)) for entry in entries]
            except OSError as error:  # a folder you may not read, or one removed meanwhile
                raise _unreadable(path, error) from None


def _refuse_link(path: Path, info: os.stat_result) -> None:
    if stat.S_ISLNK(info.st_mode):
        raise _symbolic_link_error(path)
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        raise ExportError(hard_link_sentence(path, info.st_nlink, then="export the copy"))


def _symbolic_link_error(path: Path) -> ExportError:
    from runner.folders.layout import link_error

    try:
        return ExportError(str(link_error(path)))  # the sentence every command gives for a link in a run folder
    except OSError:  # no longer a link by the time it is read: still one when it was looked at
        return ExportError(f"{path} is a symbolic link; a run folder holds no links, so remove it.")


def _read_own_files(folder: Path, names: Iterable[str]) -> dict[str, bytes]:
    """The files ``names`` of ``folder`` that are there, by name. The folder and each file are opened without
    following a link and checked on what was opened (a regular file with no other name), so a link swapped in
    after :func:`_check_own_files` looked is refused as well."""
    try:
        directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise _unreadable(folder, error) from None
    try:
        found = {name: _read_own_file(folder / name, directory) for name in names}
    finally:
        os.close(directory)
    return {name: content for name, content in found.items() if content is not None}


def _read_own_file(path: Path, directory: int) -> bytes | None:
    try:  # O_NONBLOCK: a pipe planted under the name does not hang the open; it is refused below
        descriptor = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as error:
        raise _unreadable(path, error) from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        _refuse_link(path, info)
        if not stat.S_ISREG(info.st_mode):
            raise ExportError(f"{path} is not a regular file; the run folder is damaged, so export another run.")
        return file.read()


def _unreadable(path: Path, error: OSError) -> ExportError:
    if os.path.islink(path):  # what O_NOFOLLOW refused
        return _symbolic_link_error(path)
    return ExportError(f"{path} cannot be read ({error.strerror}); make it readable to you, then export again.")


# ------------------------------------------------------------------ values a config.json may be built from
def _check_plain_values(config, raw: dict, *, key: str, config_file: Path, fix: str) -> None:
    """Refuse a value that resolving the node at ``key`` would reach, itself or through the keys it refers to, and
    that reads anything but the config (``${oc.env:HF_TOKEN}``, ``${hydra:...}``, a resolver of
    one's own): see :data:`_REFERENCES`. ``raw`` is ``config`` unresolved; nothing is resolved here.

    Raises:
        ExportError: One sentence naming ``config_file``, the key and the resolver, ending with ``fix`` (its
            ``{key}`` that key).
    """
    pending, seen = [(tuple(key.split(".")), True)], set()
    while pending:
        path, required = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        value, found = _raw_value(raw, path)
        if not found and required:  # refused, not skipped: OmegaConf must not find what this lookup does not
            raise ExportError(
                f"{config_file}: {'.'.join(path)} is not in the config, though a value that export resolves refers to "
                "it; the checkpoint's config is damaged, so export another checkpoint."
            )
        if isinstance(value, dict):
            pending += [((*path, str(name)), True) for name in value]
        elif isinstance(value, list):
            pending += [((*path, str(index)), True) for index in range(len(value))]
        elif isinstance(value, str) and "${" in value:
            pending += _references(value, path, config_file=config_file, fix=fix)


def _references(
    value: str, path: tuple[str, ...], *, config_file: Path, fix: str
) -> list[tuple[tuple[str, ...], bool]]:
    """The keys ``value`` (at ``path``) refers to, each with whether it must exist (``oc.select`` has a default);
    ExportError if it holds anything else."""
    rest, keys = value, []
    for required, pattern in zip((True, False), _REFERENCES, strict=True):
        keys += [(_referenced(path, key), required) for key in pattern.findall(rest)]
        rest = pattern.sub("", rest)
    if "${" in rest:
        resolvers = sorted(RESOLVER.findall(rest), key=lambda name: name in _PURE_RESOLVERS)  # the culprit first
        what = f"uses the resolver {resolvers[0]}" if resolvers else f"is {value}, not a reference export resolves"
        raise ExportError(
            f"{config_file}: {'.'.join(path)} {what}, which export never resolves (the config.json it writes is meant "
            f"to be shared, and would carry this machine's environment or files); {fix.format(key='.'.join(path))}."
        )
    return keys


def _referenced(path: tuple[str, ...], key: str) -> tuple[str, ...]:
    """The path ``key`` names from the value at ``path``: absolute, or relative to the value's container
    (``.x`` a sibling, each further dot one level up), as OmegaConf resolves it."""
    name = key.lstrip(".")
    up = len(key) - len(name)
    if up == 0:
        return tuple(name.split("."))
    container = path[:-1]
    return (*container[: max(len(container) - (up - 1), 0)], *name.split("."))


def _raw_value(raw: Any, path: tuple[str, ...]) -> tuple[Any, bool]:
    """The unresolved value at ``path`` in ``raw``, and whether it is there (keys as OmegaConf looks them up)."""
    value = raw
    for part in path:
        if isinstance(value, dict) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None, False
    return value, True


def _run_folder(checkpoint: Path) -> Path | None:
    """The run folder of ``checkpoint`` (``<run>/checkpoints/checkpoint_N``); None for a folder save_state wrote."""
    from runner.engine.constants import CHECKPOINTS_DIR

    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS_DIR else None
