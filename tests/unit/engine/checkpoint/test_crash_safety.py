"""A process killed while it writes a checkpoint leaves the previous one loadable and the partial one ignored."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from runner.engine import Accelerator, ProjectConfiguration

SCRIPT = textwrap.dedent(
    """
    import pathlib, sys, time
    import torch
    from runner.engine import Accelerator, ProjectConfiguration

    project = sys.argv[1]
    accelerator = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True))
    model = accelerator.prepare(torch.nn.Linear(64, 64))
    torch.nn.init.constant_(model.weight, 1.0)
    accelerator.save_state()  # checkpoint_0: complete

    def stall(models, weights, output_dir):
        # Half a file on disk, then wait to be killed, as a crash in the middle of a write would leave it.
        pathlib.Path(output_dir, "model.safetensors").write_bytes(b"partial")
        pathlib.Path(project, "writing").touch()
        time.sleep(60)

    accelerator.register_save_state_pre_hook(stall)
    torch.nn.init.constant_(model.weight, 2.0)
    accelerator.save_state()  # checkpoint_1: killed while writing
    """
)


def test_sigkill_during_a_save_leaves_the_previous_checkpoint_intact(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (tmp_path / "writing").exists():
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()

    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1.incomplete"]
    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    model = accelerator.prepare(torch.nn.Linear(64, 64))
    accelerator.load_state()  # the newest committed checkpoint: checkpoint_0, not the partial one
    assert torch.equal(model.weight, torch.ones(64, 64))
    assert accelerator.save_state().endswith("checkpoint_1")  # the next save replaces the partial folder
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1"]


def test_a_full_disk_during_a_save_fails_in_one_sentence_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno
    import hashlib

    from runner.engine import CheckpointError
    from runner.engine.checkpoint import staging as checkpoint_staging

    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    model = accelerator.prepare(torch.nn.Linear(8, 8))
    accelerator.save_state()
    first = tmp_path / "checkpoints" / "checkpoint_0"
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in first.iterdir()}

    def full_disk(tensors, path, *args, **kwargs):
        pathlib.Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_staging, "save_safetensors", full_disk)
    with pytest.raises(CheckpointError) as error:
        accelerator.save_state()
    staging = tmp_path / "checkpoints" / "checkpoint_1.incomplete"
    assert str(error.value) == (
        f"Saving checkpoint_1 failed (rank 0: No space left on device: {staging / 'model.safetensors'}); the "
        "checkpoints saved before it are intact, so free the space (or fix the folder) and resume from the newest "
        "of them."
    )
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0"]  # the partial one is gone
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in first.iterdir()} == before

    monkeypatch.undo()  # space freed: the next save takes the number the failed one did not use
    torch.nn.init.zeros_(model.weight)
    assert pathlib.Path(accelerator.save_state()).name == "checkpoint_1"
