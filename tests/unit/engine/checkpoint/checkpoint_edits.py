"""Edits to a saved checkpoint, as someone crafting or damaging one would make them."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterable
from pathlib import Path

from runner.engine.checkpoint.manifest import file_entries
from runner.engine.checkpoint.manifest_schema import manifest_digest


class CreatesFile:
    """Unpickling this creates ``path``: the smallest pickle that runs code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def code_running_pickle(marker: Path) -> bytes:
    return pickle.dumps(CreatesFile(marker))


def rewrite_manifest(
    checkpoint: Path,
    edit: Callable[[dict], None] | None = None,
    *,
    drop: Iterable[str] = (),
    relist: Iterable[str] = (),
    redigest: bool = True,
) -> dict:
    """Edit ``checkpoint``'s manifest: ``edit`` it, remove the ``drop`` files from it, list the ``relist``
    files as they are now on disk, and (unless ``redigest=False``) give it a matching digest again."""
    path = checkpoint / "manifest.json"
    manifest = json.loads(path.read_text())
    if edit is not None:
        edit(manifest)
    for name in drop:
        del manifest["files"][name]
    if relist:
        manifest["files"].update(file_entries(checkpoint, list(relist), manifest["checksum"], manifest["chunk_bytes"]))
    if redigest:
        manifest["digest"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest, indent=2))
    return manifest
