"""python -m runner.checkpoints lists number, step, epoch, time, size and integrity of each checkpoint."""

import torch

from runner.cli.checkpoints import describe, format_table, main
from runner.engine import Accelerator, ProjectConfiguration
from tests.unit.engine.checkpoint.checkpoint_edits import rewrite_manifest


def make_run(run_dir):
    accelerator = Accelerator(project_config=ProjectConfiguration(str(run_dir), automatic_checkpoint_naming=True))
    accelerator.prepare(torch.nn.Linear(4, 4))
    for step in (5, 10, 15):
        accelerator.save_state(metadata={"step": step})
    return run_dir / "checkpoints"


def test_listing_reports_each_checkpoint_and_its_integrity(tmp_path, capsys):
    checkpoints = make_run(tmp_path)
    weights = checkpoints / "checkpoint_1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    (checkpoints / "checkpoint_3").mkdir()
    (checkpoints / "checkpoint_4.incomplete").mkdir()

    records = describe(tmp_path)
    assert [(r["name"], r["step"], r["status"]) for r in records] == [
        ("checkpoint_0", 5, "intact"),
        ("checkpoint_1", 10, "damaged: model.safetensors does not match its xxh3_128 digest in the manifest (bytes "
         "0-256); the file is corrupted, so load a different checkpoint."),
        ("checkpoint_2", 15, "intact"),
        ("checkpoint_3", None, "incomplete: no manifest.json"),
    ]  # fmt: skip
    assert records[0]["bytes"] > 0 and records[0]["saved"].startswith("20")
    assert describe(tmp_path, verify_checksums=False)[1]["status"] == "intact"  # sizes alone cannot see a flip

    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["checkpoint", "step", "epoch", "saved", "size", "status"]
    assert lines[1].split()[:3] == ["checkpoint_0", "5", "-"] and lines[1].endswith("intact")
    assert len(lines) == 5
    assert format_table([]).startswith("checkpoint")


def test_a_folder_without_checkpoints_is_refused(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "has no checkpoints/ folder; pass a run folder" in capsys.readouterr().err


def test_a_damaged_manifest_or_a_linked_folder_is_listed_not_a_traceback(tmp_path, capsys):
    checkpoints = make_run(tmp_path)
    rewrite_manifest(checkpoints / "checkpoint_0", lambda m: m.update(chunk_bytes=0))
    (checkpoints / "checkpoint_1" / "manifest.json").write_text("{not json")
    (checkpoints / "checkpoint_5").symlink_to(checkpoints / "checkpoint_2")

    records = describe(tmp_path)
    assert [(r["name"], r["step"], r["status"]) for r in records] == [
        ("checkpoint_0", 5, "damaged: manifest.json: chunk_bytes is 0, not a positive multiple of 4096; the manifest "
         "is damaged, so load a different checkpoint."),
        ("checkpoint_1", None, "damaged: manifest.json: it is not valid JSON (Expecting property name enclosed in "
         "double quotes: line 1 column 2 (char 1)); the manifest is damaged, so load a different checkpoint."),
        ("checkpoint_2", 15, "intact"),
        ("checkpoint_5", None, "ignored: a symbolic link, not a checkpoint of this run"),
    ]  # fmt: skip
    assert main([str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[1].split()[:2] == ["checkpoint_0", "5"] and "chunk_bytes is 0" in lines[1]
