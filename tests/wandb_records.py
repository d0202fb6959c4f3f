"""Read a W&B offline run file (``run-<id>.wandb``) with W&B's own record schema.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
chunks (checksum, length, type: full, first, middle, last), each record a ``wandb_internal_pb2.Record``.
wandb no longer ships a Python reader of its own (``wandb sync`` reads it in its Go core).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _HEADER:  # the block's zero trailer
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _HEADER])
        if kind == 0 and length == 0:
            position += left
            continue
        chunk = data[position + _HEADER : position + _HEADER + length]
        position += _HEADER + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""


def read_run(path: Path) -> dict:
    """The run's id, group and name, its config keys, its history rows (each with ``_step``) and its artifacts."""
    from wandb.proto import wandb_internal_pb2

    run = {"id": None, "group": None, "name": None, "config": {}, "history": [], "artifacts": []}
    for payload in _payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, group=record.run.run_group, name=record.run.display_name)
        elif kind == "config":
            for item in record.config.update:
                run["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            row.setdefault("_step", record.history.step.num)
            run["history"].append(row)
        elif kind == "artifact":
            run["artifacts"].append(
                {"name": record.artifact.name, "type": record.artifact.type,
                 "files": sorted(entry.path for entry in record.artifact.manifest.contents)}
            )  # fmt: skip
    return run


def offline_runs(folder: Path) -> list[Path]:
    """The ``run-<id>.wandb`` files of W&B's offline runs in ``folder/wandb``, oldest first.

    Not in name order: a folder is ``offline-run-<start second>-<id>``, and a run that starts within the same
    second as an earlier one of the same id (a resume) gets ``-1`` appended, which sorts before the first
    (``-`` before ``/``).
    """

    def started(path: Path) -> tuple[str, int]:
        parts = path.parent.name.split("-")  # offline, run, <start second>, <id>[, <n>]
        return parts[2], int(parts[4]) if len(parts) > 4 else 0

    return sorted(Path(folder, "wandb").glob("offline-run-*/run-*.wandb"), key=started)
