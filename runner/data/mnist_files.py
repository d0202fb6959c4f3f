"""The MNIST files: names, published checksums, mirrors, where they sit, and their download (no torch here)."""

from __future__ import annotations

import os
from pathlib import Path

from runner.data.download import DataFileError, DownloadError, download_file, download_folder, sha256_of

__all__ = ["DataFileError", "DownloadError", "download_mnist", "find_mnist_file", "sha256_of"]

MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
MNIST_SHA256 = {
    "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
    "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
    "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
    "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
}
MNIST_SIZES = {"train": 60_000, "test": 10_000}
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


def find_mnist_file(root: Path, gz_name: str) -> Path | None:
    """The file ``gz_name`` under ``root``: gzipped or raw, directly or in torchvision's ``MNIST/raw``."""
    for folder in (root, root / "MNIST" / "raw"):
        for candidate in (folder / gz_name, folder / gz_name.removesuffix(".gz")):
            if candidate.is_file():
                return candidate
    return None


def download_mnist(root: str | os.PathLike, splits: tuple[str, ...] = ("train", "test")) -> list[Path]:
    """Fetch the official files of ``splits`` into ``root``, verifying each one's sha256.

    Files already present with the right checksum are kept. A file is written under a temporary
    name and renamed only once its checksum matches, so a failed download leaves nothing behind.
    """
    fetched = []
    with download_folder(Path(root)) as root:
        for split in splits:
            for name in MNIST_FILES[split]:
                target = root / name
                if target.is_file() and sha256_of(target) == MNIST_SHA256[name]:
                    continue
                fetched.append(_download_one(name, target))
    return fetched


def _download_one(name: str, target: Path) -> Path:
    return download_file(target, urls=[mirror + name for mirror in MIRRORS], sha256=MNIST_SHA256[name])
