"""A checkpoint's manifest: what it holds (files with sizes and sha256, data position, steps), written
last, and the check of every file against it before anything is loaded."""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runner.engine.constants import MANIFEST_NAME

MANIFEST_FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: incomplete, damaged, or of other objects. One sentence."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint folder does not exist."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)  # hashlib releases the GIL on large chunks: files hash in parallel
    return digest.hexdigest()


def _hash_files(paths: list[Path]) -> list[str]:
    if len(paths) <= 1:
        return [sha256_of(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        return list(pool.map(sha256_of, paths))


def write_manifest(staging: Path, *, world_size: int, iteration: int | None, metadata: dict[str, Any]) -> None:
    paths = [p for p in sorted(staging.iterdir()) if p.is_file()]
    digests = _hash_files(paths)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": d} for p, d in zip(paths, digests, strict=True)}
    manifest = {
        "format": MANIFEST_FORMAT,
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
        files = {name: (int(entry["bytes"]), str(entry["sha256"])) for name, entry in manifest["files"].items()}
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
        names = list(files)
        for name, digest in zip(names, _hash_files([checkpoint / n for n in names]), strict=True):
            if digest != files[name][1]:
                raise CheckpointError(
                    f"{checkpoint / name} does not match its sha256 in the manifest; the file is corrupted, so "
                    "load a different checkpoint."
                )
    return manifest
