"""save_state(async_save=True) on one process: a snapshot of the state, written and committed in the background."""

import errno
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from runner.engine import Accelerator, CheckpointError, ProjectConfiguration
from runner.engine.checkpoint import async_saves as async_checkpoints
from runner.engine.checkpoint import staging as checkpoint_staging
from runner.engine.checkpoint.async_saves import AsyncSave
from runner.engine.checkpoint.manifest import read_manifest
from tests.helpers import (
    assert_same_optimizer_state,
    checkpointed_run,
    indexed_regression_data,
    loader,
    small_model,
    train_steps,
)


def names(project_dir: Path) -> list[str]:
    return sorted(p.name for p in (project_dir / "checkpoints").iterdir())


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def first_exp_avg(optimizer) -> torch.Tensor:
    return optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]


def blocked_weight_writes(monkeypatch, release: threading.Event, written: list[str] | None = None) -> None:
    """Make each model.safetensors write in a staging folder wait for ``release`` (at most 30 s) before it writes."""
    original = checkpoint_staging.save_safetensors

    def blocked(tensors, path, *args, **kwargs):
        if written is not None:
            written.append(Path(path).parent.name)
        assert release.wait(timeout=30), "the test never released the background write"
        return original(tensors, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_staging, "save_safetensors", blocked)


class History:
    """A registered object whose state_dict hands out its own (mutable) dict, not a copy."""

    def __init__(self) -> None:
        self.state = {"seen": [1, 2, 3]}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def test_the_saved_state_is_a_snapshot_taken_when_save_state_returns(tmp_path, monkeypatch):
    accelerator, model, optimizer, train_loader, scheduler = checkpointed_run(tmp_path)
    history = History()
    accelerator.register_for_checkpointing(history)
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 3)
    release = threading.Event()
    blocked_weight_writes(monkeypatch, release)  # nothing reaches the disk before the state has changed below

    saved = accelerator.save_state(async_save=True)
    rand_after_save = torch.rand(3)
    weights = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    exp_avg, lr = first_exp_avg(optimizer).clone(), scheduler.get_last_lr()
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 3)  # weights, moments, schedule move on
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1)
    history.state["seen"].append(4)
    release.set()
    accelerator.wait_for_checkpoint()

    assert names(tmp_path) == ["checkpoint_0"] and Path(saved) == tmp_path / "checkpoints" / "checkpoint_0"
    fresh, model, optimizer, _, scheduler = checkpointed_run(tmp_path / "fresh")
    restored_history = History()
    fresh.register_for_checkpointing(restored_history)
    fresh.load_state(saved)
    assert torch.equal(torch.rand(3), rand_after_save)
    restored = fresh.get_state_dict(model)
    assert restored.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(restored[key], value), key
    assert torch.equal(first_exp_avg(optimizer), exp_avg)
    assert scheduler.get_last_lr() == lr == [1e-2 * 0.5]  # 3 steps of StepLR(step_size=2, gamma=0.5)
    assert restored_history.state == {"seen": [1, 2, 3]}


class Sampler:
    """A registered object with a generator of its own: its state_dict returns a new tensor on each call."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def test_tensors_made_for_the_save_are_each_snapshotted_even_when_freed_in_between(tmp_path):
    # Each state_dict() below makes a tensor that is freed once copied; the next one made, of the same
    # size, often gets the same address. Each must still get a copy of its own, not the first one's.
    accelerator = Accelerator()
    samplers = [Sampler(1), Sampler(2)]
    accelerator.register_for_checkpointing(*samplers)
    accelerator.prepare(nn.Linear(2, 2))
    expected = [sampler.generator.get_state() for sampler in samplers]
    torch.manual_seed(5)
    saved = accelerator.save_state(tmp_path / "ck", async_save=True)
    rand_after_save = torch.rand(3)
    accelerator.wait_for_checkpoint()

    fresh = Accelerator()
    restored = [Sampler(0), Sampler(0)]
    fresh.register_for_checkpointing(*restored)
    fresh.prepare(nn.Linear(2, 2))
    fresh.load_state(saved)
    for index, (sampler, state) in enumerate(zip(restored, expected, strict=True)):
        assert torch.equal(sampler.generator.get_state(), state), f"sampler {index}"
    assert torch.equal(torch.rand(3), rand_after_save)


def build_dropout_run(project_dir: Path):
    """Shuffled data and dropout: a resume is exact only if the data position and every RNG stream are restored."""
    accelerator = Accelerator(project_config=ProjectConfiguration(str(project_dir), automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
    data = loader(indexed_regression_data(60), 4)  # 15 micro-steps an epoch
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    torch.manual_seed(1000)
    return accelerator, model, optimizer, data, scheduler


def train_to_the_end(project_dir: Path, *, save_at: int | None = None, resume: bool = False, epochs: int = 2):
    accelerator, model, optimizer, data, scheduler = build_dropout_run(project_dir)
    if resume:
        accelerator.load_state()
    losses, micro_steps = [], 0
    while data.iteration < epochs:
        for x, y, _ in data:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            micro_steps += 1
            if micro_steps == save_at:
                accelerator.save_state(async_save=True)  # training goes on while it is written
    accelerator.end_training()  # waits for the background save
    weights = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    return {"losses": losses, "weights": weights, "optimizer": optimizer.state_dict()}


def test_a_run_resumed_from_an_async_checkpoint_equals_the_run_that_saved_it(tmp_path):
    unsaved = train_to_the_end(tmp_path / "unsaved")
    saving = train_to_the_end(tmp_path / "run", save_at=7)
    assert names(tmp_path / "run") == ["checkpoint_0"]
    resumed = train_to_the_end(tmp_path / "run", resume=True)

    assert saving["losses"] == unsaved["losses"]  # saving in the background changes nothing in the run
    assert resumed["losses"] == saving["losses"][7:]  # 30 micro-steps in all, 23 after the checkpoint
    for run in (saving, resumed):
        assert run["weights"].keys() == unsaved["weights"].keys()
        for key, value in unsaved["weights"].items():
            assert torch.equal(run["weights"][key], value), key
        assert_same_optimizer_state(run["optimizer"], unsaved["optimizer"])
    manifest = read_manifest(tmp_path / "run" / "checkpoints" / "checkpoint_0")
    assert manifest["step"] == 7 and manifest["dataloaders"][0]["samples_seen"] == 28


def test_a_full_disk_in_the_background_fails_at_the_next_wait_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    accelerator, model, optimizer, train_loader, scheduler = checkpointed_run(tmp_path)
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 2)
    accelerator.save_state()
    previous = tmp_path / "checkpoints" / "checkpoint_0"
    before = file_hashes(previous)

    def full_disk(tensors, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint_staging, "save_safetensors", full_disk)
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 2)
    assert accelerator.save_state(async_save=True) == str(tmp_path / "checkpoints" / "checkpoint_1")  # no error yet
    with pytest.raises(CheckpointError) as error:
        accelerator.wait_for_checkpoint()
    staging = tmp_path / "checkpoints" / "checkpoint_1.incomplete"
    assert str(error.value) == (
        f"Saving checkpoint_1 in the background failed (rank 0: No space left on device: "
        f"{staging / 'model.safetensors'}); the checkpoints saved before it are intact, so free the space (or fix "
        "the folder) and resume from the newest of them."
    )
    accelerator.wait_for_checkpoint()  # reported once
    assert names(tmp_path) == ["checkpoint_0"]  # neither checkpoint_1 nor its staging folder
    assert read_manifest(previous, verify_checksums=True)["step"] == 2
    assert file_hashes(previous) == before

    monkeypatch.undo()  # space freed: the next save works (the failed one kept its number)
    expected = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    saved = accelerator.save_state(async_save=True)
    accelerator.wait_for_checkpoint()
    assert Path(saved).name == "checkpoint_2" and names(tmp_path) == ["checkpoint_0", "checkpoint_2"]
    assert read_manifest(Path(saved))["step"] == 4
    fresh, model, *_ = checkpointed_run(tmp_path)
    fresh.load_state()
    assert all(torch.equal(value, fresh.get_state_dict(model)[key]) for key, value in expected.items())


def limited_run(project_dir: Path, total_limit: int):
    project = ProjectConfiguration(str(project_dir), automatic_checkpoint_naming=True, total_limit=total_limit)
    accelerator = Accelerator(project_config=project)
    model = small_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def test_total_limit_rotates_only_once_the_background_save_is_committed(tmp_path, monkeypatch):
    accelerator, model, _ = limited_run(tmp_path, total_limit=1)
    accelerator.save_state()
    release, written = threading.Event(), []
    blocked_weight_writes(monkeypatch, release, written)
    accelerator.save_state(async_save=True)
    deadline = time.monotonic() + 30
    while not written:  # until the background thread waits inside the write
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # In flight: the only checkpoint that loads is still there, and the new one does not exist yet.
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_1.incomplete"]
    read_manifest(tmp_path / "checkpoints" / "checkpoint_0", verify_checksums=True)
    release.set()
    accelerator.wait_for_checkpoint()
    assert names(tmp_path) == ["checkpoint_1"]
    read_manifest(tmp_path / "checkpoints" / "checkpoint_1", verify_checksums=True)


def test_a_second_save_waits_until_the_first_is_committed(tmp_path, monkeypatch, caplog):
    accelerator, model, optimizer = limited_run(tmp_path, total_limit=None)
    events: list[tuple[str, str]] = []
    written: list[str] = []
    release = threading.Event()
    blocked_weight_writes(monkeypatch, release, written)
    copy_tensors, commit = async_checkpoints.Snapshot.save_tensors, async_checkpoints.commit_folder

    def recorded_copy(self, tensors, name):
        events.append(("copy", self.path.name))
        return copy_tensors(self, tensors, name)

    def recorded_commit(staging, target):
        commit(staging, target)
        events.append(("commit", target.name))

    monkeypatch.setattr(async_checkpoints.Snapshot, "save_tensors", recorded_copy)
    monkeypatch.setattr(async_checkpoints, "commit_folder", recorded_commit)

    with caplog.at_level("INFO", logger="runner"):
        accelerator.save_state(async_save=True)
    kept = accelerator._checkpointer._background.kept  # the first save's host copies, kept for the next
    buffers = {key: tensor.data_ptr() for key, tensor in kept.items()}
    parameters = list(model.parameters())
    assert len(buffers) >= len(parameters) and sum(t.numel() * t.element_size() for t in kept.values()) >= sum(
        t.numel() * t.element_size() for t in parameters
    )
    with torch.no_grad():
        model[0].weight.add_(1)
    second_weights = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    releaser = threading.Timer(0.5, release.set)
    releaser.start()
    started = time.monotonic()
    accelerator.save_state(async_save=True)  # blocks until the first save is committed
    assert time.monotonic() - started >= 0.4
    # copied into the same buffers, none allocated: the weights' by their source, the RNG states (made anew by
    # each save) into the free buffer of their shape
    assert sorted(tensor.data_ptr() for tensor in kept.values()) == sorted(buffers.values())
    assert all(kept[key].data_ptr() == pointer for key, pointer in buffers.items() if key in kept)
    accelerator.wait_for_checkpoint()
    releaser.join()
    said = [r.getMessage() for r in caplog.records if "host memory" in r.getMessage()]
    assert said == [
        f"Asynchronous saves keep {sum(t.numel() * t.element_size() for t in kept.values()) / 1e6:.1f} MB of host "
        "memory for their copies of the state between saves (one copy per save, no allocation); end_training() "
        "frees it."
    ]  # once: the second save kept as much

    assert events == [
        ("copy", "checkpoint_0.incomplete"),
        ("commit", "checkpoint_0"),
        ("copy", "checkpoint_1.incomplete"),
        ("commit", "checkpoint_1"),
    ]
    assert written == ["checkpoint_0.incomplete", "checkpoint_1.incomplete"]
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_1"]
    first = load_file(tmp_path / "checkpoints" / "checkpoint_0" / "model.safetensors")
    second = load_file(tmp_path / "checkpoints" / "checkpoint_1" / "model.safetensors")
    assert torch.equal(second["0.weight"], second_weights["0.weight"])
    assert torch.equal(first["0.weight"] + 1, second["0.weight"])  # written before its buffers took the second
    accelerator.end_training()
    assert kept == {}


KILLED_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from safetensors.torch import save_file
    from runner.engine import Accelerator, ProjectConfiguration
    from runner.engine.checkpoint.staging import StagingFolder

    project = sys.argv[1]
    accelerator = Accelerator(project_config=ProjectConfiguration(project, automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = torch.randn(16, 8), torch.randn(16, 1)

    def steps(count):
        for _ in range(count):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    steps(3)
    accelerator.save_state()  # checkpoint_0: committed
    save_file({k: v.contiguous() for k, v in accelerator.get_state_dict(model).items()}, project + "/saved.safetensors")
    steps(3)
    write_object = StagingFolder.save_object

    def slow(self, obj, name):
        write_object(self, obj, name)
        print("background write started", flush=True)
        time.sleep(30)  # killed here: some of checkpoint_1's files are on disk, not all

    StagingFolder.save_object = slow
    accelerator.save_state(async_save=True)  # checkpoint_1: killed in the background
    steps(3)  # training goes on
    time.sleep(60)
    """
)


def test_sigkill_during_the_background_write_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(KILLED_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            ready, _, _ = select.select([process.stdout], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, "the script never started its background write"
            line = process.stdout.readline()
            assert line, f"the script ended early: {process.stderr.read()}"
            if line.strip() == "background write started":
                break
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL

    checkpoints = tmp_path / "checkpoints"
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_1.incomplete"]
    assert not (checkpoints / "checkpoint_1.incomplete" / "manifest.json").exists()
    assert read_manifest(checkpoints / "checkpoint_0", verify_checksums=True)["step"] == 3

    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.load_state()  # the newest committed checkpoint
    saved = load_file(tmp_path / "saved.safetensors")
    restored = accelerator.get_state_dict(model)
    assert restored.keys() == saved.keys()
    assert all(torch.equal(restored[key], value) for key, value in saved.items())
    assert accelerator.save_iteration == 1 and optimizer.steps == 3


def test_the_metadata_is_copied_when_save_state_returns_and_an_unknown_mode_is_refused(tmp_path):
    accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path)))
    accelerator.prepare(torch.nn.Linear(2, 2))
    losses = [1, 2]
    folder = accelerator.save_state(tmp_path / "ck", metadata={"losses": losses}, async_save=True)
    losses.append(999)  # the caller's list, changed while the manifest is still to be written
    accelerator.wait_for_checkpoint()
    assert json.loads((Path(folder) / "manifest.json").read_text())["losses"] == [1, 2]
    with pytest.raises(ValueError) as error:
        accelerator.save_state(tmp_path / "other", async_save="later")
    assert str(error.value) == (
        "save_state(async_save='later') is not a mode; pass 'none', 'writes' (or True) or 'commit'."
    )
    assert not (tmp_path / "other").exists()
    assert [AsyncSave.of(value) for value in (False, True, "none", "writes", "commit", AsyncSave.COMMIT)] == [
        AsyncSave.NONE, AsyncSave.WRITES, AsyncSave.NONE, AsyncSave.WRITES, AsyncSave.COMMIT, AsyncSave.COMMIT,
    ]  # fmt: skip
