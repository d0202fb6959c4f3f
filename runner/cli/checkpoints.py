"""List a run's checkpoints: ``python -m runner.checkpoints <run folder>``.

Prints one line per ``checkpoints/checkpoint_N`` folder: its number, step, epoch, when it was saved,
its size, and whether it is intact (manifest present and undamaged, every file complete and matching
its digests), damaged (with the sentence saying why), incomplete, or a symbolic link (ignored).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runner.engine.checkpoint import checkpoint_number, read_manifest
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.constants import CHECKPOINTS_DIR, MANIFEST_NAME
from runner.folders.provenance import check_unchanged


def describe(run_dir: Path, *, verify_checksums: bool = True) -> list[dict]:
    """One record per checkpoint folder of ``run_dir``, oldest first."""
    folder = run_dir / CHECKPOINTS_DIR
    found = sorted((n, p) for p in folder.iterdir() if (n := checkpoint_number(p)) is not None and p.is_dir())
    records = []
    for number, path in found:
        record = {"name": path.name, "number": number, "step": None, "epoch": None, "saved": None, "bytes": None}
        if path.is_symlink():
            record["status"] = "ignored: a symbolic link, not a checkpoint of this run"
        elif not (path / MANIFEST_NAME).is_file():
            record["status"] = f"incomplete: no {MANIFEST_NAME}"
        else:
            try:
                check_unchanged(path)  # one of yours changed since: damaged, as resume= treats it
                _fill(record, read_manifest(path, verify_checksums=verify_checksums))
                record["status"] = "intact"
            except CheckpointError as error:
                record["status"] = "damaged: " + str(error).replace(f"{path}/", "").replace(f"{path} ", "")
                _fill(record, _readable_part(path / MANIFEST_NAME))
        records.append(record)
    return records


def _readable_part(manifest_path: Path) -> dict:
    """What can still be shown of a damaged manifest: its step, epoch, date and sizes where they have their types."""
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _fill(record: dict, manifest: dict) -> None:
    for key, field in (("step", "step"), ("epoch", "epoch"), ("saved", "created")):
        value = manifest.get(field)
        record[key] = value if isinstance(value, (int, str)) and not isinstance(value, bool) else None
    files = manifest.get("files")
    sizes = (
        [entry.get("bytes") for entry in files.values() if isinstance(entry, dict)] if isinstance(files, dict) else []
    )
    record["bytes"] = sum(sizes) if sizes and all(type(size) is int for size in sizes) else None


def _size(count: int | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return "-"


def format_table(records: list[dict]) -> str:
    rows = [("checkpoint", "step", "epoch", "saved", "size", "status")]
    for r in records:
        shown = [r["name"], r["step"], r["epoch"], r["saved"]]
        rows.append((*("-" if value is None else str(value) for value in shown), _size(r["bytes"]), r["status"]))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[5]
                     for row in rows)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.checkpoints", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a run folder (the one holding checkpoints/)")
    parser.add_argument("--quick", action="store_true", help="check file sizes only, not the digests")
    args = parser.parse_args(argv)
    if not (args.run_dir / CHECKPOINTS_DIR).is_dir():
        print(f"runner.checkpoints: error: {args.run_dir} has no {CHECKPOINTS_DIR}/ folder; pass a run folder.",
              file=sys.stderr)  # fmt: skip
        return 2
    records = describe(args.run_dir, verify_checksums=not args.quick)
    print(format_table(records) if records else f"{args.run_dir / CHECKPOINTS_DIR} holds no checkpoint.")
    return 0
