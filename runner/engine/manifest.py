"""A checkpoint's manifest: what it holds (files with sizes and sha256, data position, steps), written
last, and the check of every file against it before anything is loaded."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runner.engine.constants import MANIFEST_NAME

MANIFEST_FORMAT = 3
# Files are hashed in slices of this many bytes, all slices of all files in parallel threads
# (hashlib releases the GIL): verifying costs a fraction of one core per slice, not one core per file.
CHUNK_BYTES = 32 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: incomplete, damaged, or of other objects. One sentence."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint folder does not exist."""


def sha256_of(path: Path, offset: int = 0, length: int | None = None) -> str:
    """sha256 of ``length`` bytes of ``path`` from ``offset`` (to the end by default)."""
    digest = hashlib.sha256()
    remaining = float("inf") if length is None else length
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while remaining > 0 and (block := f.read(int(min(1 << 22, remaining)))):
            digest.update(block)
            remaining -= len(block)
    return digest.hexdigest()


def chunk_digests(paths: list[Path], chunk_bytes: int = CHUNK_BYTES) -> list[list[str]]:
    """For each file, the sha256 of each of its ``chunk_bytes`` slices (one slice for an empty file)."""
    tasks = []
    for index, path in enumerate(paths):
        size = path.stat().st_size
        tasks += [(index, path, offset) for offset in range(0, max(size, 1), chunk_bytes)]
    digests: list[list[str]] = [[] for _ in paths]
    workers = min(len(tasks), os.cpu_count() or 1, 16)
    if workers <= 1:
        hashed = [sha256_of(path, offset, chunk_bytes) for _, path, offset in tasks]
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            hashed = list(pool.map(lambda task: sha256_of(task[1], task[2], chunk_bytes), tasks))
    for (index, _, _), digest in zip(tasks, hashed, strict=True):
        digests[index].append(digest)
    return digests


def write_manifest(staging: Path, *, world_size: int, iteration: int | None, metadata: dict[str, Any]) -> None:
    paths = sorted(p for p in staging.rglob("*") if p.is_file())  # with the DCP folders of FSDP checkpoints
    digests = chunk_digests(paths)
    files = {
        p.relative_to(staging).as_posix(): {"bytes": p.stat().st_size, "sha256_chunks": d}
        for p, d in zip(paths, digests, strict=True)
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "chunk_bytes": CHUNK_BYTES,
        "iteration": iteration,
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **metadata,
        "files": files,
    }
    partial = staging / (MANIFEST_NAME + ".tmp")
    partial.write_text(json.dumps(manifest, indent=2))
    os.replace(partial, staging / MANIFEST_NAME)


def read_manifest(checkpoint: Path, *, verify_checksums: bool = True) -> dict[str, Any]:
    """The checkpoint's manifest, after checking every file it lists: present, complete, unchanged.

    Raises:
        CheckpointNotFoundError: The folder does not exist.
        CheckpointError: One sentence naming the first file that is missing, truncated or altered.
    """
    if not checkpoint.is_dir():
        raise CheckpointNotFoundError(f"Checkpoint folder {checkpoint} does not exist; check the path.")
    manifest_path = checkpoint / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(
            f"{checkpoint} is not a complete checkpoint (it has no {MANIFEST_NAME}); it was not fully "
            "written, so load a different checkpoint."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {name: (int(entry["bytes"]), _expected_digests(entry)) for name, entry in manifest["files"].items()}
        chunk_bytes = int(manifest.get("chunk_bytes", CHUNK_BYTES))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{manifest_path} is corrupted; load a different checkpoint.") from None
    for name, (size, _) in files.items():
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the checkpoint; load a different checkpoint.")
        if path.stat().st_size != size:
            raise CheckpointError(
                f"{path} has {path.stat().st_size} bytes but the manifest says {size}; the file is "
                "truncated or was changed, so load a different checkpoint."
            )
    if verify_checksums:
        _verify_digests(checkpoint, files, chunk_bytes)
    return manifest


def _expected_digests(entry: dict[str, Any]) -> list[str] | str:
    """A file's sha256 per slice (format 3), or of the whole file (format 2 manifests)."""
    if "sha256_chunks" in entry:
        return [str(digest) for digest in entry["sha256_chunks"]]
    return str(entry["sha256"])


def _verify_digests(checkpoint: Path, files: dict[str, tuple[int, list[str] | str]], chunk_bytes: int) -> None:
    """Raise for the first file (and slice) whose sha256 differs from the manifest's."""
    sliced = [name for name, (_, expected) in files.items() if isinstance(expected, list)]
    found = dict(zip(sliced, chunk_digests([checkpoint / name for name in sliced], chunk_bytes), strict=True))
    for name, (size, expected) in files.items():
        if isinstance(expected, str):  # a format 2 manifest: one sha256 of the whole file
            where, bad = "", sha256_of(checkpoint / name) != expected
        else:
            pairs = itertools.zip_longest(found[name], expected)
            index = next((i for i, (digest, wanted) in enumerate(pairs) if digest != wanted), None)
            bad, index = index is not None, index or 0
            where = f" (bytes {index * chunk_bytes}-{min((index + 1) * chunk_bytes, size)})"
        if bad:
            raise CheckpointError(
                f"{checkpoint / name} does not match its sha256 in the manifest{where}; the file is corrupted, so "
                "load a different checkpoint."
            )
