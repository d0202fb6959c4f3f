"""Datasets the runner builds by name from the ``data`` config group.

This package's top level imports no torch, so the launcher can check data files before any worker
starts; the dataset classes load on first use.
"""

from __future__ import annotations

from pathlib import Path

from runner.data.splits import SplitSpec, parse_split

__all__ = ["SplitSpec", "build_dataset", "check_splits", "download_missing", "missing_files", "parse_split"]

DATASETS = ("mnist",)


def check_splits(name: str, splits: list[str]) -> None:
    """Raise ValueError for a split ``name`` does not have, or a slice that selects nothing."""
    if name != "mnist":
        raise ValueError(f"data.name={name!r} is not a known dataset; use one of {', '.join(DATASETS)}.")
    from runner.data.mnist_files import MNIST_SIZES

    for split in splits:
        spec = parse_split(split)
        if spec.name not in MNIST_SIZES:
            raise ValueError(
                f"MNIST has no split {spec.name!r} ({split!r}); use 'train' or 'test' with an optional slice."
            )
        if len(spec.indices(MNIST_SIZES[spec.name])) == 0:
            raise ValueError(f"Split {split!r} selects none of MNIST's {MNIST_SIZES[spec.name]} {spec.name} images.")


def missing_files(name: str, *, root: str, splits: list[str]) -> list[str]:
    """The files ``name`` needs for ``splits`` that are not under ``root``."""
    if name == "mnist":
        from runner.data.mnist_files import MNIST_FILES, find_mnist_file

        names = list(dict.fromkeys(parse_split(s).name for s in splits))
        unknown = [name for name in names if name not in MNIST_FILES]
        if unknown:
            raise ValueError(f"MNIST has no split {unknown[0]!r}; use 'train' or 'test' (with an optional slice).")
        wanted = [file for name in names for file in MNIST_FILES[name]]
        return [file for file in wanted if find_mnist_file(Path(root), file) is None]
    raise ValueError(f"data.name={name!r} is not a known dataset; use one of {', '.join(DATASETS)}.")


def download_missing(name: str, *, root: str, splits: list[str]) -> list[Path]:
    """Fetch (checksum-verified) the files of ``splits`` that are not under ``root``; returns those fetched.

    Raises:
        DownloadError: No mirror delivered a file with its published checksum.
    """
    if name != "mnist":
        raise ValueError(f"data.name={name!r} is not a known dataset; use one of {', '.join(DATASETS)}.")
    from runner.data.mnist_files import download_mnist

    if not missing_files(name, root=root, splits=splits):
        return []
    return download_mnist(root, tuple(dict.fromkeys(parse_split(s).name for s in splits)))


def build_dataset(name: str, *, root: str, split: str, download: bool = False):
    """The dataset ``name`` restricted to ``split`` (e.g. ``"test[:8000]"``)."""
    if name == "mnist":
        from runner.data.mnist import MNIST

        return MNIST(root, split=split, download=download)
    raise ValueError(f"data.name={name!r} is not a known dataset; use one of {', '.join(DATASETS)}.")
