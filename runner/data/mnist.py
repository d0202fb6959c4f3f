"""MNIST from the standard IDX files (gzipped or raw), with checksum-verified download."""

from __future__ import annotations

import gzip
import math
import os
import struct
from pathlib import Path

import torch
from torch.utils.data import Dataset

from runner.data.mnist_files import MNIST_FILES, DataFileError, download_mnist, find_mnist_file
from runner.data.splits import parse_split

MEAN, STD = 0.1307, 0.3081
_IDX_DTYPES = {0x08: torch.uint8, 0x09: torch.int8, 0x0B: torch.int16, 0x0C: torch.int32, 0x0D: torch.float32}


def read_idx(path: str | os.PathLike) -> torch.Tensor:
    """Read an IDX file (``.gz`` or raw) into a tensor of its stored dtype and shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as error:  # unreadable, a truncated or damaged gzip stream
        raise DataFileError(
            f"{path} cannot be read ({error}); delete it and let data.download=true fetch it again, or replace it."
        ) from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DataFileError(f"{path} is not an IDX file (bad magic number); download it again.")
    dtype, ndim = _IDX_DTYPES[data[2]], data[3]
    if len(data) < 4 + 4 * ndim:
        raise DataFileError(f"{path} ends inside its header; it is truncated, so download it again.")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = data[4 + 4 * ndim :]
    expected = math.prod(shape) * dtype.itemsize
    if len(body) != expected:
        raise DataFileError(
            f"{path} holds {len(body)} bytes of data but its header promises {expected}; it is truncated."
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    tensor = torch.frombuffer(bytearray(body), dtype=dtype)
    if dtype.itemsize > 1:
        tensor = tensor.view(torch.uint8).view(-1, dtype.itemsize).flip(1).contiguous().view(dtype)  # big-endian
    return tensor.reshape(shape)


class MNIST(Dataset):
    """MNIST images as normalised ``[1, 28, 28]`` float tensors with ``int64`` labels.

    Args:
        root: Folder holding the IDX files (``.gz`` or raw, also in ``MNIST/raw/``).
        split: ``train`` or ``test`` with an optional slice, e.g. ``test[:8000]``.
        download: Fetch missing files (checksum-verified) into ``root``.
    """

    def __init__(self, root: str | os.PathLike, split: str = "train", download: bool = False) -> None:
        spec = parse_split(split)
        if spec.name not in MNIST_FILES:
            raise ValueError(f"MNIST has no split {spec.name!r}; use 'train' or 'test' (with an optional slice).")
        root = Path(root)
        paths = [find_mnist_file(root, name) for name in MNIST_FILES[spec.name]]
        if None in paths and download:
            download_mnist(root, (spec.name,))
            paths = [find_mnist_file(root, name) for name in MNIST_FILES[spec.name]]
        missing = [name for name, path in zip(MNIST_FILES[spec.name], paths, strict=True) if path is None]
        if missing:
            raise FileNotFoundError(
                f"MNIST files {', '.join(missing)} are not in {root}; set data.root to the folder that holds them "
                "or data.download=true to fetch them."
            )
        images, labels = read_idx(paths[0]), read_idx(paths[1])
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{paths[0]} has {images.shape[0]} images but {paths[1]} has {labels.shape[0]} labels.")
        keep = spec.indices(len(labels))
        if len(keep) == 0:
            raise ValueError(f"Split {split!r} selects no MNIST images out of {len(labels)}; widen the slice.")
        index = torch.arange(keep.start, keep.stop, keep.step)
        self.split = split
        self.images = ((images[index].float() / 255.0 - MEAN) / STD).unsqueeze(1)
        self.labels = labels[index].long()

    @classmethod
    def prepare_data(cls, root: str | os.PathLike, split: str = "train", download: bool = False) -> None:
        """Once, before the training processes start: fetch the split's files (``download``) or check they are there.

        Raises:
            ValueError: MNIST has no such split, or the slice selects no image.
            FileNotFoundError: A file is missing and ``download`` is off.
            DownloadError: No mirror delivered a file with its published checksum.
        """
        from runner.data import check_splits, download_missing, missing_files

        check_splits("mnist", [split])
        if download:
            download_missing("mnist", root=str(root), splits=[split])
            return
        missing = missing_files("mnist", root=str(root), splits=[split])
        if missing:
            raise FileNotFoundError(
                f"MNIST files {', '.join(missing)} are not in {root}; set data.root to the folder that holds them, "
                "or data.download=true to fetch them."
            )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]
