"""Checksum-verified downloads and the errors data files raise (no torch here)."""

from __future__ import annotations

import hashlib
import logging
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from runner.files import commit_file

logger = logging.getLogger(__name__)


class DownloadError(RuntimeError):
    """No mirror delivered a file with the published checksum."""


class DataFileError(ValueError):
    """A data file that cannot be read: truncated, corrupted, or of another format. One sentence."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(target: Path, *, urls: Iterable[str], sha256: str) -> Path:
    """Fetch ``target`` from the first of ``urls`` that delivers bytes with ``sha256``.

    The file is written under a temporary name and renamed only once its checksum matches, so a
    failed download leaves nothing behind.

    Raises:
        DownloadError: Every URL failed or delivered other bytes; the message lists each attempt.
    """
    partial = target.with_name(target.name + ".part")
    errors = []
    for url in urls:
        try:
            logger.info("Downloading %s", url)
            with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
                while chunk := response.read(1 << 20):
                    out.write(chunk)
        except (urllib.error.URLError, OSError) as error:
            errors.append(f"{url}: {error}")
            continue
        digest = sha256_of(partial)
        if digest == sha256:
            commit_file(partial, target)  # durable under its name only once its checksum matches
            return target
        errors.append(f"{url}: sha256 {digest} is not the published {sha256}")
    partial.unlink(missing_ok=True)
    raise DownloadError(
        f"Could not download {target.name} from any mirror into {target.parent} ({'; '.join(errors)}); check your "
        "connection, or set data.root to a folder that holds the files."
    )


@contextmanager
def download_folder(root: Path) -> Iterator[Path]:
    """``root``, created with its missing parents for a download; if the download fails, the folders it created
    are removed again where they are still empty, so a failed download leaves no trace."""
    created = []
    folder = root
    while not folder.exists() and folder != folder.parent:
        created.append(folder)  # deepest first
        folder = folder.parent
    root.mkdir(parents=True, exist_ok=True)
    try:
        yield root
    except BaseException:
        for folder in created:
            try:
                folder.rmdir()
            except OSError:  # something else was written there meanwhile: it is kept
                break
        raise
