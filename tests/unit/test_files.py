"""Atomic, durable writes: the data and the folder entry are fsynced, a failed write changes nothing, no link is
followed; a checkpoint is fsynced whole before the rename that makes it exist."""

import os

import pytest
import torch

from runner import files
from runner.engine import Accelerator, ProjectConfiguration
from runner.engine.checkpoint import staging_dir


@pytest.fixture
def synced(monkeypatch):
    """The paths os.fsync is called on, in order."""
    paths = []
    real_fsync = os.fsync

    def fsync(descriptor):
        paths.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)
    return paths


def test_a_file_is_fsynced_renamed_and_its_folder_fsynced(tmp_path, synced):
    target = tmp_path / "metrics.json"
    files.write_text_atomically(target, "{}\n")
    assert target.read_text() == "{}\n"
    assert synced == [str(tmp_path / "metrics.json.tmp"), str(tmp_path)]  # the data, then the new name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "summary.csv"
    target.write_text("old\n")

    def fails(partial):
        partial.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(target, fails)
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.csv"]


def test_no_link_is_followed_at_the_temporary_name_or_the_target(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "a.json.tmp").symlink_to(outside)  # planted at the temporary name
    (folder / "b.json").symlink_to(outside)  # planted at the target
    files.write_text_atomically(folder / "a.json", "a\n")
    files.write_text_atomically(folder / "b.json", "b\n")
    assert outside.read_text() == "keep\n"
    assert (folder / "a.json").read_text() == "a\n" and not (folder / "b.json").is_symlink()


def test_writers_of_one_shared_file_use_temporary_names_of_their_own(tmp_path):
    seen = []
    files.write_atomically(tmp_path / "summary.md", lambda partial: seen.append(partial.name), shared=True)
    assert seen == [f"summary.md.{os.getpid()}.tmp"]


def test_a_checkpoint_is_fsynced_whole_before_the_rename_that_commits_it(tmp_path, synced, monkeypatch):
    renames = []
    real_replace = os.replace

    def replace(source, destination):
        renames.append((str(source), len(synced)))
        real_replace(source, destination)

    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    monkeypatch.setattr(os, "replace", replace)
    accelerator.save_state()
    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    staging = str(staging_dir(checkpoint))
    synced_before = next(count for source, count in renames if source == staging)
    on_disk = {os.path.relpath(path, staging) for path in synced[:synced_before]}
    expected = {os.path.relpath(os.path.join(root, name), checkpoint) for root, _, names in os.walk(checkpoint)
                for name in names}  # fmt: skip
    assert expected <= on_disk and "." in on_disk  # every file, and the folder itself, before the rename
    assert synced[synced_before:] == [str(checkpoint.parent)]  # then the new entry in checkpoints/
    assert model.weight.shape == (2, 2)
