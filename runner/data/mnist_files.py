"""The MNIST files: names, published checksums, mirrors, and where they may sit under a root folder."""

from __future__ import annotations

from pathlib import Path

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
