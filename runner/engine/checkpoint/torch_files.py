"""``torch.save`` and ``torch.load(weights_only=True)`` files: a checkpoint's other state, and ``.bin`` weights.

Checkpoint files are written with ``torch.save`` without the CRC32 it computes for every record of
its zip archive (a third of the write's time; ``torch.load`` never checks it, and the checkpoint's
manifest holds a digest of every byte), and read back through a memory map, with the tensors then
copied out of it (several times faster than ``torch.load``'s own reads of a large file).

:func:`torch_save` fails with the OSError behind a failed write (a full disk, say): ``torch.save``
reports it as ``RuntimeError: ... unexpected pos``, which would hide it from the callers that turn
it into one sentence. Nothing here unpickles arbitrary objects.

It may import torch, and nothing of the engine.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch

# torch.save's CRC32 option is process-wide: our saves without it switch it off one at a time.
_CRC32_OPTION = threading.Lock()


def torch_save(obj: Any, path: str | os.PathLike, *, crc32: bool = True) -> None:
    """``torch.save(obj)`` to a new file at ``path`` (a symbolic link there is refused, never followed).

    Args:
        crc32: Record the CRC32 of every record in the zip archive. Without it the write is several
            times faster and ``torch.load`` reads the file as before, but zip tools call it damaged:
            leave it out only where a digest of the file's bytes is kept elsewhere (a checkpoint's
            manifest). While such a save runs, ``torch.save`` in other threads skips it too.

    Raises:
        OSError: The write failed (its errno and reason, and ``path``).
    """
    try:
        with (
            os.fdopen(_open_emptied(path), "wb") as file,
            contextlib.nullcontext() if crc32 else _without_crc32(),
        ):
            writer = _ErrorKeepingWriter(file)
            try:
                torch.save(obj, writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None
    except OSError as error:
        if error.filename is None:
            raise OSError(error.errno, error.strerror, str(path)) from None
        raise


def _open_emptied(path: str | os.PathLike) -> int:
    """A descriptor to write ``path`` afresh (a symbolic link there is refused): the file created, or emptied.

    Only a file that holds something is truncated: ext4 flushes a truncated file to the disk when it is
    closed (its ``auto_da_alloc``), even one that was already empty, which stalls the writer (half a
    second for an 806 MB optimizer state) where the caller fsyncs the file later, or in another thread.
    """
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        if os.fstat(descriptor).st_size:
            os.ftruncate(descriptor, 0)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    with _CRC32_OPTION:
        previous = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            yield
        finally:
            torch.serialization.set_crc32_options(previous)


def torch_load(path: str | os.PathLike, *, mapped: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` onto the CPU, read through a memory map of the file.

    Args:
        mapped: Return the tensors as views of the mapping (the caller copies out what it keeps, see
            :func:`copied_out`; a tensor kept as it is keeps the file's pages, and its disk space once
            it is deleted, until the tensor is freed). By default every tensor is copied into memory of
            its own first, tensors that shared memory in the file still sharing it.
    """
    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return loaded if mapped else copy.deepcopy(loaded)


def copied_out(tensor: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor :func:`torch_load` returned mapped, in memory of its own: copied into ``into`` (returned) when
    that one is a plain tensor of the same shape and dtype (on any device), else into new memory."""
    if type(into) is torch.Tensor and into.shape == tensor.shape and into.dtype == tensor.dtype:
        return into.copy_(tensor)
    return tensor.clone()


class _ErrorKeepingWriter:
    """A file torch.save writes through, keeping the OSError of a failed write (torch reports only
    "unexpected pos")."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()
