"""Text corpora on disk: file names, split names, the published checksum and download (no torch here)."""

from __future__ import annotations

import os
from pathlib import Path

from runner.data.download import download_file, download_folder

SHAKESPEARE_FILE = "input.txt"
SHAKESPEARE_URLS = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",)
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TEXT_SPLITS = ("train", "val")


def find_corpus(root: str | os.PathLike) -> Path | None:
    """The corpus file under ``root``, or None."""
    path = Path(root) / SHAKESPEARE_FILE
    return path if path.is_file() else None


def download_shakespeare(root: str | os.PathLike) -> list[Path]:
    """Fetch tiny-shakespeare into ``root`` unless a corpus is there; returns the files fetched.

    A corpus already in ``root`` is kept as it is (it may be a text of the user's own).

    Raises:
        DownloadError: The file could not be fetched with its published sha256.
    """
    root = Path(root)
    if find_corpus(root) is not None:
        return []
    with download_folder(root):
        return [download_file(root / SHAKESPEARE_FILE, urls=SHAKESPEARE_URLS, sha256=SHAKESPEARE_SHA256)]


def split_boundary(characters: int, val_fraction: float) -> int:
    """Where ``train`` ends and ``val`` begins: after the first ``1 - val_fraction`` of the characters, rounded down."""
    return int(characters * (1 - val_fraction))


def window_counts(root: str | os.PathLike, *, block_size: int, val_fraction: float) -> dict[str, int] | None:
    """Windows of ``block_size + 1`` characters in each split of the corpus in ``root`` (None if it cannot be read).

    ``train`` has one per offset, ``val`` one every ``block_size`` characters, as the datasets do.
    """
    path = find_corpus(root)
    try:
        characters = len(path.read_text(encoding="utf-8")) if path is not None else None
    except (OSError, UnicodeDecodeError):
        characters = None
    if characters is None:
        return None
    boundary = split_boundary(characters, val_fraction)
    train, val = boundary - block_size, characters - boundary - block_size
    return {"train": max(train, 0), "val": max(-(-val // block_size), 0)}
