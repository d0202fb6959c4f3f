"""What a well-formed manifest holds: its format, every field's type and range, its files against its contents.

Pure checks of a parsed manifest (:func:`manifest_problem` returns the first problem as a phrase, or
None) and of ``save_state(metadata=...)``; the manifest's own digest (:func:`manifest_digest`); the
slice digests it can record (:data:`CHECKSUMS`) and how each format lists them. Nothing here opens,
stat's or hashes a file: :mod:`runner.engine.checkpoint.manifest` writes and reads the document and
checks the files on disk. It may import the standard library, xxhash and the engine's constants.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
from pathlib import PurePosixPath
from typing import Any

import xxhash

from runner.engine.constants import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    MODEL_NAME,
    OPTIMIZER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    custom_state_name,
    gradients_name,
    indexed_name,
    rng_state_name,
)

MANIFEST_FORMAT = 5
SHA256_FORMAT = 4  # every slice's sha256 as sha256_chunks; still read
STATE_FORMATS = ("safetensors", "dcp")
# The slice digests a manifest can record, and how many hex digits each has.
CHECKSUMS = {"xxh3_128": (xxhash.xxh3_128, 32), "sha256": (hashlib.sha256, 64)}
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]+")


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def is_positive(value: Any) -> bool:
    """Whether ``value`` is an int of at least 1 (a bool is not)."""
    return type(value) is int and value >= 1


def _count_or_null(value: Any) -> bool:
    return value is None or _count(value)


_COUNT, _POSITIVE, _COUNT_OR_NULL = "a non-negative integer", "a positive integer", "a non-negative integer or null"
# What the engine writes itself; save_state(metadata=...) cannot set these keys.
_OWN_FIELDS = {
    "format": (is_positive, _POSITIVE),
    "chunk_bytes": (
        lambda value: is_positive(value) and value % mmap.ALLOCATIONGRANULARITY == 0,  # slices are mapped at it
        f"a positive multiple of {mmap.ALLOCATIONGRANULARITY}",
    ),
    "world_size": (is_positive, _POSITIVE),
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
    "accumulation_steps": (is_positive, _POSITIVE),
    "dataloaders": (
        lambda value: isinstance(value, list) and all(isinstance(d, dict) for d in value),
        "a list of objects",
    ),
}
_LOADER_FIELDS = {"epoch": (_count, _COUNT), "samples_seen": (_count, _COUNT)}
_BATCH_LOADER_FIELDS = {"batches_seen": (_count, _COUNT)}  # a loader that keeps the user's batches whole
# What a plain shuffle drew its pass from (runner.engine.loaders.shuffles.PlainShuffle).
_SHUFFLE_FIELDS = {
    "generators": (
        lambda value: isinstance(value, list) and all(isinstance(state, str) for state in value),
        "a list of strings",
    ),
    "draw_seed": (lambda value: value is None or type(value) is int, "an integer or null"),
    "replay": (lambda value: isinstance(value, bool), "true or false"),
    "global_state": (lambda value: isinstance(value, str), "a string"),
    "persistent": (lambda value: isinstance(value, bool), "true or false"),
}
_CONTENTS_FIELDS = {
    **dict.fromkeys(("models", "optimizers", "schedulers", "custom_objects", "dataloaders"), (_count, _COUNT)),
    **dict.fromkeys(("scaler", "gradients"), (lambda value: isinstance(value, bool), "true or false")),
}


def checksum_of(manifest: dict[str, Any]) -> str:
    """The digest a checked manifest records its files' slices with."""
    return "sha256" if manifest["format"] == SHA256_FORMAT else manifest["checksum"]


def _digests_key(manifest: dict[str, Any]) -> str:
    return "sha256_chunks" if manifest["format"] == SHA256_FORMAT else "digests"


def listed_digests(manifest: dict[str, Any], name: str) -> list[str]:
    """The digests a checked manifest lists for the slices of file ``name``."""
    return manifest["files"][name][_digests_key(manifest)]


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


def manifest_problem(manifest: Any) -> str | None:
    """The first field, digest or listed file of a parsed manifest that a save of ours never writes, or None."""
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


def _shown(value: Any, limit: int = 60) -> str:
    """A value as the sentence shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
