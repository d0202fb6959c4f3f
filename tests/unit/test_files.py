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


def test_a_checkpoints_files_are_written_in_place_and_fsynced_in_the_background_before_the_manifest(
    tmp_path, monkeypatch
):
    import threading

    from runner.engine.checkpoint import manifest
    from runner.engine.checkpoint import staging as checkpoint_staging

    events = []
    real_fsync_path, real_write_manifest = checkpoint_staging.fsync_path, manifest.write_manifest

    def fsync_path(path):
        real_fsync_path(path)
        events.append((threading.current_thread().name.split("_")[0], os.path.basename(path)))

    def write_manifest(*args, **kwargs):
        events.append(("manifest", None))
        return real_write_manifest(*args, **kwargs)

    monkeypatch.setattr(checkpoint_staging, "fsync_path", fsync_path)
    monkeypatch.setattr(manifest, "write_manifest", write_manifest)
    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    accelerator.prepare(model, optimizer)
    accelerator.save_state(tmp_path / "ck")
    written = {"model.safetensors", "optimizer.bin", "random_states_0.pt"}
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == sorted([*written, "manifest.json"])
    assert set(events[:-1]) == {("runner-fsync", name) for name in written} and len(events) == 4
    assert events[-1] == ("manifest", None)  # every file on disk before the manifest lists it


def test_a_failed_fsync_of_a_checkpoint_file_fails_the_save_naming_the_file(tmp_path, monkeypatch):
    import errno

    from runner.engine import CheckpointError
    from runner.engine.checkpoint import staging as checkpoint_staging

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.save_state(tmp_path / "before")

    def fails(path):
        if path.name == "model.safetensors":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        files.fsync_path(path)

    monkeypatch.setattr(checkpoint_staging, "fsync_path", fails)
    with pytest.raises(CheckpointError) as error:
        accelerator.save_state(tmp_path / "ck")
    assert str(error.value) == (
        f"Saving ck failed (rank 0: Input/output error: {staging_dir(tmp_path / 'ck') / 'model.safetensors'}); the "
        "checkpoints saved before it are intact, so free the space (or fix the folder) and resume from the newest "
        "of them."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before"]
    accelerator.load_state(tmp_path / "before")
    assert model.weight.shape == (2, 2)
