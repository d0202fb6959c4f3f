"""A checkpoint's manifest: what the checkpoint holds and how it was written, checked before anything is loaded.

Rank 0 writes ``manifest.json`` last (under ``save_on_each_node``, each node's local main process
writes its node's copy's, see ``node_local_ranks``). It lists every file with its size and the digest of each
``chunk_bytes`` slice (``checksum``: xxHash's ``xxh3_128`` by default, a fast integrity digest;
``sha256`` where ``ProjectConfiguration(checksum="sha256")`` asks for a cryptographic one), and records
what the save wrote: ``state_format`` (``"safetensors"``: models
as safetensors and optimizers as ``torch.save`` files; ``"dcp"``: FSDP's sharded model and optimizer
folders), ``contents`` (how many models, optimizers, schedulers, custom objects and dataloaders, and
whether a loss scaler and pending gradients were saved), the world size and the engine's position
facts. ``digest`` is the sha256 of the manifest's own canonical JSON (everything but the digest), so
a manifest edited or damaged after the save is refused like a damaged file; it also covers the keys
the caller added through ``save_state(metadata=...)``.

``node_local_ranks`` is there only in one node's copy of a checkpoint saved with
``ProjectConfiguration(save_on_each_node=True)``: the ranks whose own files (RNG states, pending
gradients) that copy holds. The files every rank needs (models, optimizers, schedulers, ...) are in
every copy; the other ranks' are on their nodes. Without it the folder holds every rank's files.

:func:`read_manifest` treats the folder as data, in this order: every field's type and range; every
listed name is a plain relative path (no ``..``, not absolute); the digest; the listed files against
``contents`` and ``state_format``; then, on disk, no listed name is or goes through a symbolic link;
the sizes; and last the digest of every slice. Nothing is opened, stat'ed or hashed before the names
are known to stay inside the folder. Any problem is one CheckpointError sentence naming the file.
Loading hashes each slice once, on one rank (see :func:`share_of`), as it maps the file's bytes.

Format 4 manifests (sha256 of every slice, listed as ``sha256_chunks``) still verify. Those of
formats 2 and 3 are refused: they carry no digest, so accepting them would let any edit pass by
lowering the format number. Checkpoints saved by those versions are listed as damaged, and resuming
a run folder falls back past them.

What every field must be, the listed files against ``contents`` and the manifest's own digest are checked
by :mod:`runner.engine.checkpoint.manifest_schema`; this module hashes the files, writes the manifest,
and reads it back with the files it lists.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from runner.engine.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from runner.engine.checkpoint.manifest_schema import (
    CHECKSUMS,
    MANIFEST_FORMAT,
    SHA256_FORMAT,
    checksum_of,
    is_positive,
    listed_digests,
    manifest_digest,
    manifest_problem,
)
from runner.engine.constants import MANIFEST_NAME
from runner.files import write_text_atomically

# Files are hashed in slices of this many bytes, all slices of all files in parallel threads (xxhash
# and hashlib release the GIL): verifying costs a fraction of one core per slice, not one core per file.
CHUNK_BYTES = 32 << 20
DEFAULT_CHECKSUM = "xxh3_128"


class Slice(NamedTuple):
    """Bytes ``offset`` to ``offset + length`` of the listed file ``name``: its ``index``-th slice."""

    name: str
    index: int
    offset: int
    length: int


def file_slices(name: str, size: int, chunk_bytes: int = CHUNK_BYTES) -> list[Slice]:
    """The slices of a file of ``size`` bytes (one, empty, for an empty file)."""
    offsets = range(0, max(size, 1), chunk_bytes)
    return [Slice(name, i, offset, min(chunk_bytes, size - offset)) for i, offset in enumerate(offsets)]


def slice_digest(path: Path, offset: int, length: int, checksum: str) -> str:
    """The ``checksum`` digest of ``length`` bytes of ``path`` from ``offset``, hashed through a memory map of them
    (no copy; a file shorter than that gets a digest that matches nothing)."""
    hasher = CHECKSUMS[checksum][0]()
    if length:
        with open(path, "rb", buffering=0) as file:
            try:
                mapped = mmap.mmap(file.fileno(), length, offset=offset, access=mmap.ACCESS_READ)
            except ValueError:  # the file is shorter than its listed size now
                return ""
            with mapped:
                hasher.update(mapped)
    return hasher.hexdigest()


def hash_slices(folder: Path, slices: Sequence[Slice], checksum: str) -> list[str]:
    """The digest of each slice of the files under ``folder``, all slices in parallel threads."""

    def digest(piece: Slice) -> str:
        return slice_digest(folder / piece.name, piece.offset, piece.length, checksum)

    workers = min(len(slices), os.cpu_count() or 1, 16)
    if workers <= 1:
        return [digest(piece) for piece in slices]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(digest, slices))


def file_entries(
    folder: Path, names: Collection[str], checksum: str = DEFAULT_CHECKSUM, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, dict[str, Any]]:
    """The manifest's entries for the files ``names`` under ``folder``: their sizes and slice digests."""
    sizes = {name: (folder / name).stat().st_size for name in names}
    slices = [piece for name in names for piece in file_slices(name, sizes[name], chunk_bytes)]
    entries: dict[str, dict[str, Any]] = {name: {"bytes": sizes[name], "digests": []} for name in names}
    for piece, digest in zip(slices, hash_slices(folder, slices, checksum), strict=True):
        entries[piece.name]["digests"].append(digest)
    return entries


def manifest_slices(manifest: dict[str, Any], names: Collection[str] | None = None) -> list[Slice]:
    """The slices of the listed files (of ``names`` only, if given), in the manifest's order."""
    files = manifest["files"]
    return [
        piece
        for name, entry in files.items()
        if names is None or name in names
        for piece in file_slices(name, entry["bytes"], manifest["chunk_bytes"])
    ]


def share_of(slices: Sequence[Slice], *, rank: int, ranks: int, owners: dict[str, int]) -> list[Slice]:
    """The slices rank ``rank`` of ``ranks`` hashes when they verify a checkpoint together, each slice once.

    A file ``owners`` maps to a rank (a rank's own RNG state, say) is hashed by that rank alone; the
    others (the model every rank reads, under DDP) are split into ``ranks`` runs of about equal bytes.
    """
    shared = [piece for piece in slices if piece.name not in owners]
    total = sum(piece.length for piece in shared)
    mine = [piece for piece in slices if owners.get(piece.name) == rank]
    start = 0
    for piece in shared:
        if min(ranks - 1, start * ranks // total if total else 0) == rank:
            mine.append(piece)
        start += piece.length
    return mine


def first_mismatch(checkpoint: Path, manifest: dict[str, Any], slices: Sequence[Slice]) -> str | None:
    """The sentence for the first of ``slices`` whose digest differs from the manifest's, or None."""
    checksum = checksum_of(manifest)
    try:
        found = hash_slices(checkpoint, slices, checksum)
    except OSError as error:  # a file that vanished, or a disk that fails to read
        return f"{checkpoint} could not be read ({error}); load a different checkpoint, or fix the disk."
    for piece, digest in zip(slices, found, strict=True):
        if digest != listed_digests(manifest, piece.name)[piece.index]:
            where = f"bytes {piece.offset}-{piece.offset + piece.length}"
            return (
                f"{checkpoint / piece.name} does not match its {checksum} digest in the manifest ({where}); the file "
                "is corrupted, so load a different checkpoint."
            )
    return None


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A save whose files were hashed and matched its manifest, named by the folder and the manifest's digest.

    The launching process verifies the checkpoint a run resumes (``runner resume=``), and the ranks of a
    restarted run the newest one, together; an Accelerator given this value
    (:meth:`~runner.engine.checkpoint.verbs.CheckpointVerbs.load_verified`) loads that very save without hashing it
    again. A save written in place since has another digest, and is verified as any other.
    """

    folder: Path
    digest: str

    @classmethod
    def of(cls, checkpoint: Path, manifest: dict[str, Any]) -> VerifiedCheckpoint:
        return cls(Path(checkpoint).resolve(), manifest["digest"])

    def covers(self, checkpoint: Path, manifest: dict[str, Any]) -> bool:
        """Whether this is the save of ``checkpoint`` that ``manifest`` describes."""
        return self.folder == Path(checkpoint).resolve() and self.digest == manifest["digest"]


def write_manifest(
    staging: Path,
    *,
    world_size: int,
    iteration: int | None,
    state_format: str,
    contents: dict[str, Any],
    metadata: dict[str, Any],
    node_local_ranks: list[int] | None = None,
    checksum: str = DEFAULT_CHECKSUM,
    entries: dict[str, dict[str, Any]] | None = None,
    after_manifest: Callable[[Path], None] | None = None,
) -> None:
    """List every file under ``staging`` (the DCP folders' included) with its slices' digests, then the manifest.

    Args:
        node_local_ranks: The ranks whose files this node's copy holds, under save_on_each_node (else None).
        checksum: The slices' digest (a key of :data:`~runner.engine.checkpoint.manifest_schema.CHECKSUMS`).
        entries: What the ranks that wrote some of the files already hashed (:func:`file_entries`);
            every other file is hashed here.
        after_manifest: Called with ``staging`` once the manifest is written (before the caller syncs and
            renames it): what it writes there is committed with the checkpoint but not listed in the manifest
            (a signature of the manifest, say).
    """
    names = [path.relative_to(staging).as_posix() for path in _regular_files(staging)]
    known = {name: entry for name, entry in (entries or {}).items() if name in names}
    files = {**known, **file_entries(staging, [name for name in names if name not in known], checksum)}
    own = {
        "format": MANIFEST_FORMAT,
        "chunk_bytes": CHUNK_BYTES,
        "checksum": checksum,
        "iteration": iteration,
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "state_format": state_format,
        "contents": contents,
        "files": {name: files[name] for name in names},
    }
    if node_local_ranks is not None:
        own["node_local_ranks"] = list(node_local_ranks)
    manifest = json.loads(json.dumps({**metadata, **own}))  # as it will read back: tuples as lists, str keys
    manifest["digest"] = manifest_digest(manifest)
    write_text_atomically(staging / MANIFEST_NAME, json.dumps(manifest, indent=2))
    if after_manifest is not None:
        after_manifest(staging)


def _regular_files(staging: Path) -> list[Path]:
    paths = []
    for path in sorted(staging.rglob("*")):
        if path.is_symlink():
            raise CheckpointError(
                f"{path} is a symbolic link; a checkpoint holds only its own files, so write a copy there instead."
            )
        if path.is_file():
            paths.append(path)
    return paths


def read_manifest(checkpoint: Path, *, verify_checksums: bool = True) -> dict[str, Any]:
    """The checkpoint's manifest, after checking it and every file it lists: present, complete, unchanged.

    With ``verify_checksums=False`` everything but the files' digests is checked (the manifest, its
    digest, the names and the sizes): cheap enough to run on every checkpoint after every save.

    Raises:
        CheckpointNotFoundError: The folder does not exist.
        CheckpointError: One sentence naming the manifest field, or the first file that is missing,
            truncated, altered or a symbolic link.
    """
    if not checkpoint.is_dir():
        raise CheckpointNotFoundError(f"Checkpoint folder {checkpoint} does not exist; check the path.")
    manifest_path = checkpoint / MANIFEST_NAME
    if manifest_path.is_symlink():
        raise CheckpointError(_symlink_sentence(manifest_path, manifest_path))
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{checkpoint} is not a complete checkpoint (it has no {MANIFEST_NAME}); it was not fully "
            "written, so load a different checkpoint."
        )
    manifest = _parse(manifest_path)
    files = manifest["files"]
    for name, entry in files.items():
        _check_size(checkpoint, name, entry["bytes"])
    if verify_checksums:
        mismatch = first_mismatch(checkpoint, manifest, manifest_slices(manifest))
        if mismatch is not None:
            raise CheckpointError(mismatch)
    return manifest


def _parse(manifest_path: Path) -> dict[str, Any]:
    """The manifest, if every field, the digest and the listed files are what a save of ours writes."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        problem = f"it is not valid JSON ({str(error).splitlines()[0]})"
    else:
        format_ = manifest.get("format") if isinstance(manifest, dict) else None
        if is_positive(format_) and format_ < SHA256_FORMAT:
            raise CheckpointError(
                f"{manifest_path}: format is {format_}, not {MANIFEST_FORMAT}: it was written by an earlier version "
                "and carries no digest of its own, so load a checkpoint saved by this version or start a new run."
            )
        problem = manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{manifest_path}: {problem}; the manifest is damaged, so load a different checkpoint.")
    return manifest


def _check_size(checkpoint: Path, name: str, size: int) -> None:
    """lstat every component of ``name``: a symbolic link on the way, or a missing or resized file, is refused."""
    path = checkpoint
    for part in PurePosixPath(name).parts:
        path = path / part
        try:
            info = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointError(
                f"{checkpoint / name} is missing from the checkpoint; load a different checkpoint."
            ) from None
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(_symlink_sentence(checkpoint / name, path))
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file; the checkpoint is damaged, so load a different one.")
    if info.st_size != size:
        raise CheckpointError(
            f"{path} has {info.st_size} bytes but the manifest says {size}; the file is truncated or was changed, "
            "so load a different checkpoint."
        )


def _symlink_sentence(listed: Path, link: Path) -> str:
    where = f"{link} is a symbolic link" if listed == link else f"{listed} goes through the symbolic link {link}"
    return f"{where}; a checkpoint holds only its own files, so load a different checkpoint."
