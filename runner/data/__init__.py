"""Datasets the runner builds by name from the ``data`` config group."""

from runner.data.mnist import MNIST, MNIST_FILES, download_mnist
from runner.data.splits import SplitSpec, parse_split

__all__ = ["MNIST", "MNIST_FILES", "SplitSpec", "build_dataset", "download_mnist", "parse_split"]


def build_dataset(name: str, *, root: str, split: str, download: bool = False):
    """The dataset ``name`` restricted to ``split`` (e.g. ``"test[:8000]"``)."""
    if name == "mnist":
        return MNIST(root, split=split, download=download)
    raise ValueError(f"data.name={name!r} is not a known dataset; use 'mnist'.")
