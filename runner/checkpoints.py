"""List a run's checkpoints: ``python -m runner.checkpoints <run folder>``.

Prints one line per ``checkpoints/checkpoint_N`` folder: its number, step, epoch, when it was saved,
its size, and whether it is intact (manifest present, every file complete and matching its sha256).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runner.engine.checkpoint import CheckpointError, checkpoint_number, read_manifest
from runner.engine.constants import CHECKPOINTS_DIR, MANIFEST_NAME


def describe(run_dir: Path, *, verify_checksums: bool = True) -> list[dict]:
    """One record per checkpoint folder of ``run_dir``, oldest first."""
    folder = run_dir / CHECKPOINTS_DIR
    found = sorted((n, p) for p in folder.iterdir() if p.is_dir() and (n := checkpoint_number(p)) is not None)
    records = []
    for number, path in found:
        record = {"name": path.name, "number": number, "step": None, "epoch": None, "saved": None, "bytes": None}
        try:
            manifest = read_manifest(path, verify_checksums=verify_checksums)
        except CheckpointError as error:
            record["status"] = "damaged: " + str(error).replace(f"{path}/", "").replace(f"{path} ", "")
            if (path / MANIFEST_NAME).is_file():
                _fill(record, json.loads((path / MANIFEST_NAME).read_text()))
            else:
                record["status"] = f"incomplete: no {MANIFEST_NAME}"
        else:
            record["status"] = "intact"
            _fill(record, manifest)
        records.append(record)
    return records


def _fill(record: dict, manifest: dict) -> None:
    record.update(step=manifest.get("step"), epoch=manifest.get("epoch"), saved=manifest.get("created"))
    record["bytes"] = sum(int(entry["bytes"]) for entry in manifest.get("files", {}).values())


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
    parser.add_argument("--quick", action="store_true", help="check file sizes only, not sha256")
    args = parser.parse_args(argv)
    if not (args.run_dir / CHECKPOINTS_DIR).is_dir():
        print(f"runner.checkpoints: error: {args.run_dir} has no {CHECKPOINTS_DIR}/ folder; pass a run folder.",
              file=sys.stderr)  # fmt: skip
        return 2
    records = describe(args.run_dir, verify_checksums=not args.quick)
    print(format_table(records) if records else f"{args.run_dir / CHECKPOINTS_DIR} holds no checkpoint.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
