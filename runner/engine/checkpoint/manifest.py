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
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import stat
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

import xxhash

from runner.engine.constants import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    MODEL_NAME,
    OPTIMIZER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    VERIFIED_CHECKPOINT_ENV,
    custom_state_name,
    gradients_name,
    indexed_name,
    rng_state_name,
)
from runner.files import write_text_atomically

MANIFEST_FORMAT = 5
SHA256_FORMAT = 4  # every slice's sha256 as sha256_chunks; still read
# Files are hashed in slices of this many bytes, all slices of all files in parallel threads (xxhash
# and hashlib release the GIL): verifying costs a fraction of one core per slice, not one core per file.
CHUNK_BYTES = 32 << 20
STATE_FORMATS = ("safetensors", "dcp")
# The slice digests a manifest can record, and how many hex digits each has.
CHECKSUMS = {"xxh3_128": (xxhash.xxh3_128, 32), "sha256": (hashlib.sha256, 64)}
DEFAULT_CHECKSUM = "xxh3_128"
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]+")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: incomplete, damaged, or of other objects. One sentence."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint folder does not exist."""


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _positive(value: Any) -> bool:
    return type(value) is int and value >= 1


def _count_or_null(value: Any) -> bool:
    return value is None or _count(value)


_COUNT, _POSITIVE, _COUNT_OR_NULL = "a non-negative integer", "a positive integer", "a non-negative integer or null"
# What the engine writes itself; save_state(metadata=...) cannot set these keys.
_OWN_FIELDS = {
    "format": (_positive, _POSITIVE),
    "chunk_bytes": (
        lambda value: _positive(value) and value % mmap.ALLOCATIONGRANULARITY == 0,  # slices are mapped at it
        f"a positive multiple of {mmap.ALLOCATIONGRANULARITY}",
    ),
    "world_size": (_positive, _POSITIVE),
    "iteration": (_count_or_null, _COUNT_OR_NULL),
    "created": (lambda value: isinstance(value, str), "a string"),
    "state_format": (lambda value: value in STATE_FORMATS, " or ".join(map(repr, STATE_FORMATS))),
    "contents": (lambda value: isinstance(value, dict), "an object"),
    "files": (lambda value: isinstance(value, dict), "an object"),
    "digest": (lambda value: isinstance(value, str) and _HEX_DIGEST.fullmatch(value), "a sha256 hex digest"),
}
_CHECKSUM_FIELDS = {"checksum": (lambda value: value in CHECKSUMS, " or ".join(map(repr, CHECKSUMS)))}
# Only in a node's copy of a checkpoint saved with save_on_each_node (checked against world_size below).
_NODE_LOCAL_FIELDS = {
    "node_local_ranks": (
        lambda value: (
            isinstance(value, list) and bool(value) and all(map(_count, value)) and value == sorted(set(value))
        ),
        "a non-empty ascending list of distinct ranks",
    ),
}
# The facts engine_metadata records (a bare save_training_state may leave them out).
_POSITION_FIELDS = {
    "step": (_count_or_null, _COUNT_OR_NULL),
    "epoch": (_count_or_null, _COUNT_OR_NULL),
    "optimizer_steps": (
        lambda value: isinstance(value, list) and all(map(_count, value)),
        "a list of non-negative integers",
    ),
    "accumulation_step": (_count, _COUNT),
    "accumulation_steps": (_positive, _POSITIVE),
    "dataloaders": (
        lambda value: isinstance(value, list) and all(isinstance(d, dict) for d in value),
        "a list of objects",
    ),
}
_LOADER_FIELDS = {"epoch": (_count, _COUNT), "samples_seen": (_count, _COUNT)}
_BATCH_LOADER_FIELDS = {"batches_seen": (_count, _COUNT)}  # a loader that keeps the user's batches whole
# What a plain shuffle drew its pass from (runner.engine.data.sampling.PlainShuffle).
_SHUFFLE_FIELDS = {
    "generators": (
        lambda value: isinstance(value, list) and all(isinstance(state, str) for state in value),
        "a list of strings",
    ),
    "draw_seed": (lambda value: value is None or type(value) is int, "an integer or null"),
    "replay": (lambda value: isinstance(value, bool), "true or false"),
}
_CONTENTS_FIELDS = {
    **dict.fromkeys(("models", "optimizers", "schedulers", "custom_objects", "dataloaders"), (_count, _COUNT)),
    **dict.fromkeys(("scaler", "gradients"), (lambda value: isinstance(value, bool), "true or false")),
}


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


def checksum_of(manifest: dict[str, Any]) -> str:
    """The digest a checked manifest records its files' slices with."""
    return "sha256" if manifest["format"] == SHA256_FORMAT else manifest["checksum"]


def _digests_key(manifest: dict[str, Any]) -> str:
    return "sha256_chunks" if manifest["format"] == SHA256_FORMAT else "digests"


def listed_digests(manifest: dict[str, Any], name: str) -> list[str]:
    """The digests a checked manifest lists for the slices of file ``name``."""
    return manifest["files"][name][_digests_key(manifest)]


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


def mark_verified(checkpoint: Path, manifest: dict[str, Any]) -> None:
    """Tell the processes this one starts (its training workers) that ``checkpoint``'s files matched
    ``manifest`` here: their load of the same save, unchanged since, hashes nothing again."""
    os.environ[VERIFIED_CHECKPOINT_ENV] = f"{manifest['digest']}:{Path(checkpoint).resolve()}"


def take_verified(checkpoint: Path, manifest: dict[str, Any]) -> bool:
    """Whether the launching process verified this very save of ``checkpoint`` (see :func:`mark_verified`);
    the mark is used once in this process (a restarted worker drops it, see ``runner.launch.worker``)."""
    mark = f"{manifest['digest']}:{Path(checkpoint).resolve()}"
    if os.environ.get(VERIFIED_CHECKPOINT_ENV) != mark:
        return False
    del os.environ[VERIFIED_CHECKPOINT_ENV]
    return True


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces), leaving out its ``digest``."""
    content = {key: value for key, value in manifest.items() if key != "digest"}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_metadata(metadata: dict[str, Any]) -> None:
    """Refuse ``save_state(metadata=...)`` that the manifest cannot hold, or that would make it read as damaged.

    Raises:
        ValueError: One sentence naming the key.
    """
    taken = sorted(set(metadata) & (set(_OWN_FIELDS) | set(_CHECKSUM_FIELDS) | set(_NODE_LOCAL_FIELDS)))
    if taken:
        raise ValueError(f"save_state(metadata=...) sets {taken[0]!r}, which the manifest records itself; rename it.")
    try:
        json.dumps(metadata)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"save_state(metadata=...) is not JSON ({error}); pass numbers, strings, lists and dicts."
        ) from None
    problem = _fields_problem(metadata, _POSITION_FIELDS, required=False) or _loaders_problem(metadata)
    if problem:
        raise ValueError(f"save_state(metadata=...): {problem}; pass a value of that type.")


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
) -> None:
    """List every file under ``staging`` (the DCP folders' included) with its slices' digests, then the manifest.

    Args:
        node_local_ranks: The ranks whose files this node's copy holds, under save_on_each_node (else None).
        checksum: The slices' digest (a key of :data:`CHECKSUMS`).
        entries: What the ranks that wrote some of the files already hashed (:func:`file_entries`);
            every other file is hashed here.
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
        if _positive(format_) and format_ < SHA256_FORMAT:
            raise CheckpointError(
                f"{manifest_path}: format is {format_}, not {MANIFEST_FORMAT}: it was written by an earlier version "
                "and carries no digest of its own, so load a checkpoint saved by this version or start a new run."
            )
        problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{manifest_path}: {problem}; the manifest is damaged, so load a different checkpoint.")
    return manifest


def _manifest_problem(manifest: Any) -> str | None:
    if not isinstance(manifest, dict):
        return "it is not a JSON object"
    if manifest.get("format") not in (None, SHA256_FORMAT, MANIFEST_FORMAT):
        return f"format is {_shown(manifest['format'])}, not {MANIFEST_FORMAT}"
    return (
        _fields_problem(manifest, _OWN_FIELDS, required=True)
        or (None if manifest["format"] == SHA256_FORMAT else _fields_problem(manifest, _CHECKSUM_FIELDS, required=True))
        or _fields_problem(manifest, _POSITION_FIELDS, required=False)
        or _fields_problem(manifest, _NODE_LOCAL_FIELDS, required=False)
        or _node_local_problem(manifest)
        or _fields_problem(manifest["contents"], _CONTENTS_FIELDS, required=True, prefix="contents.")
        or _loaders_problem(manifest)
        or _files_problem(manifest)
        or (None if manifest["digest"] == manifest_digest(manifest) else _DIGEST_PROBLEM)
        or _contents_problem(manifest)
    )


def _node_local_problem(manifest: dict) -> str | None:
    ranks = manifest.get("node_local_ranks", [])
    if ranks and ranks[-1] >= manifest["world_size"]:
        return f"node_local_ranks lists rank {ranks[-1]}, outside world_size {manifest['world_size']}"
    return None


_DIGEST_PROBLEM = "its digest does not match its content (it was edited or damaged after the save)"


def _fields_problem(record: dict, fields: dict, *, required: bool, prefix: str = "") -> str | None:
    for key, (valid, wanted) in fields.items():
        if key not in record:
            if required:
                return f"{prefix}{key} is missing"
        elif not valid(record[key]):
            return f"{prefix}{key} is {_shown(record[key])}, not {wanted}"
    return None


def _loaders_problem(record: dict) -> str | None:
    for index, position in enumerate(record.get("dataloaders", [])):
        problem = _fields_problem(position, _LOADER_FIELDS, required=True, prefix=f"dataloaders[{index}].")
        if problem:
            return problem
        if "seed" in position and type(position["seed"]) is not int:
            return f"dataloaders[{index}].seed is {_shown(position['seed'])}, not an integer"
        problem = _fields_problem(position, _SHUFFLE_FIELDS, required=False, prefix=f"dataloaders[{index}].")
        if problem:
            return problem
        problem = _fields_problem(position, _BATCH_LOADER_FIELDS, required=False, prefix=f"dataloaders[{index}].")
        if problem:
            return problem
    return None


def _files_problem(manifest: dict) -> str | None:
    """A listed name that leaves the folder, or an entry without a size and one digest per slice."""
    files, chunk_bytes, checksum = manifest["files"], manifest["chunk_bytes"], checksum_of(manifest)
    key = _digests_key(manifest)
    hex_digits = CHECKSUMS[checksum][1]
    for name, entry in files.items():
        if not _is_inside(name):
            return f"files lists {_shown(name, limit=240)}, which is not a path inside the checkpoint folder"
        if not isinstance(entry, dict):
            return f"files[{name!r}] is {_shown(entry)}, not an object"
        if not _count(entry.get("bytes")):
            return f"files[{name!r}].bytes is {_shown(entry.get('bytes'))}, not {_COUNT}"
        digests = entry.get(key)
        slices = max(1, -(-entry["bytes"] // chunk_bytes))
        if not isinstance(digests, list) or not all(
            isinstance(d, str) and len(d) == hex_digits and _HEX.fullmatch(d) for d in digests
        ):
            return f"files[{name!r}].{key} is {_shown(digests)}, not a list of {checksum} hex digests"
        if len(digests) != slices:
            return f"files[{name!r}].{key} has {len(digests)} digests, not {slices} for {entry['bytes']} bytes"
    return None


def _is_inside(name: str) -> bool:
    """A relative POSIX path in its normal form, without ``..``: it cannot name anything outside the folder."""
    path = PurePosixPath(name)
    return (
        bool(name)
        and "\\" not in name
        and "\0" not in name
        and not path.is_absolute()
        and path.as_posix() == name
        and ".." not in path.parts
        and name != MANIFEST_NAME
    )


def _contents_problem(manifest: dict) -> str | None:
    """A file that ``contents`` and ``state_format`` call for but ``files`` does not list."""
    contents, files = manifest["contents"], manifest["files"]
    if "dataloaders" in manifest and len(manifest["dataloaders"]) != contents["dataloaders"]:
        return f"dataloaders lists {len(manifest['dataloaders'])} position(s), not contents.dataloaders"
    if "optimizer_steps" in manifest and len(manifest["optimizer_steps"]) != contents["optimizers"]:
        return f"optimizer_steps lists {len(manifest['optimizer_steps'])} count(s), not contents.optimizers"
    step, steps = manifest.get("accumulation_step", 0), manifest.get("accumulation_steps", 1)
    if (step % steps != 0) != contents["gradients"]:  # gradients are saved exactly in the middle of a cycle
        gradients = json.dumps(contents["gradients"])
        return f"contents.gradients is {gradients}, but accumulation_step {step} of {steps} says otherwise"
    missing = sorted(expected_files(manifest) - set(files))
    if missing:
        return f"files does not list {missing[0]}, which its contents and state_format call for"
    return None


def expected_files(manifest: dict[str, Any]) -> set[str]:
    """The engine's files a checkpoint with this ``contents``, ``state_format`` and world size holds (a node's
    copy: the per-rank files of its ``node_local_ranks`` only)."""
    contents = manifest["contents"]
    ranks = manifest.get("node_local_ranks", range(manifest["world_size"]))
    if manifest["state_format"] == "dcp":
        names = {f"{indexed_name(MODEL_NAME, i, '')}/{DCP_METADATA_NAME}" for i in range(contents["models"])}
        names |= {f"{indexed_name(OPTIMIZER_NAME, i, '')}/{DCP_METADATA_NAME}" for i in range(contents["optimizers"])}
    else:
        names = {indexed_name(MODEL_NAME, i, ".safetensors") for i in range(contents["models"])}
        names |= {indexed_name(OPTIMIZER_NAME, i, ".bin") for i in range(contents["optimizers"])}
    names |= {indexed_name(SCHEDULER_NAME, i, ".bin") for i in range(contents["schedulers"])}
    names |= {custom_state_name(i) for i in range(contents["custom_objects"])}
    names |= {rng_state_name(rank) for rank in ranks}
    if contents["gradients"]:
        names |= {gradients_name(rank) for rank in ranks}
    if contents["scaler"]:
        names.add(SCALER_NAME)
    return names


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


def _shown(value: Any, limit: int = 60) -> str:
    """A value as the sentence shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
