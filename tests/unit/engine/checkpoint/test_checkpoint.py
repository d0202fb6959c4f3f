import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from runner.engine import Accelerator, CheckpointError, ProjectConfiguration
from tests.helpers import StepCounter


def build(project_dir=None, *, total_limit=None, automatic=True, precision="no"):
    config = ProjectConfiguration(project_dir, automatic_checkpoint_naming=automatic, total_limit=total_limit)
    accelerator = Accelerator(project_config=config, mixed_precision=precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler, counter


def step(accelerator, model, optimizer, scheduler, counter, batch):
    x, y = batch
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    counter.count += 1


BATCHES = [(torch.randn(8, 4, generator=torch.Generator().manual_seed(i)), torch.randn(8, 1)) for i in range(6)]


@pytest.mark.parametrize("precision", ["no", "fp16"])
def test_load_state_restores_everything_exactly(tmp_path, precision):
    parts = build(tmp_path, precision=precision)
    for batch in BATCHES[:3]:
        step(*parts, batch)
    parts[0].save_state()
    saved_epoch = parts[3].scheduler.last_epoch  # 3, or fewer under fp16 where overflowing steps were skipped
    draws = (torch.rand(2), random.random(), np.random.rand())
    for batch in BATCHES[3:]:
        step(*parts, batch)
    uninterrupted = parts[1].state_dict()

    resumed = build(tmp_path, precision=precision)
    torch.manual_seed(999), random.seed(999), np.random.seed(999)  # streams that differ from the saved ones
    resumed[0].load_state(tmp_path / "checkpoints" / "checkpoint_0")
    assert resumed[4].count == 3 and resumed[3].scheduler.last_epoch == saved_epoch > 0
    again = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(again[0], draws[0]) and again[1:] == draws[1:]
    for batch in BATCHES[3:]:
        step(*resumed, batch)
    for key, value in uninterrupted.items():
        assert torch.equal(value, resumed[1].state_dict()[key]), key
    if precision == "fp16":
        assert resumed[0].scaler.state_dict() == parts[0].scaler.state_dict()


def save_n(tmp_path, n, **kwargs):
    accelerator = build(tmp_path, **kwargs)[0]
    for _ in range(n):
        accelerator.save_state()
    return accelerator


def names(tmp_path):
    return sorted(p.name for p in (tmp_path / "checkpoints").iterdir())


def test_automatic_naming_total_limit_and_numbering_after_load(tmp_path):
    accelerator = save_n(tmp_path, 3, total_limit=2)
    assert names(tmp_path) == ["checkpoint_1", "checkpoint_2"]
    assert accelerator.save_iteration == 3

    resumed = build(tmp_path, total_limit=2)[0]
    resumed.load_state()  # the newest committed checkpoint
    assert resumed.save_iteration == 3
    assert resumed.save_state().endswith("checkpoint_3")
    assert names(tmp_path) == ["checkpoint_2", "checkpoint_3"]

    older = build(tmp_path, total_limit=3)[0]
    older.load_state(tmp_path / "checkpoints" / "checkpoint_2")
    assert older.save_iteration == 3
    with pytest.warns(
        UserWarning, match=r"checkpoint_3 is taken \(the newest is checkpoint_3\); saving as checkpoint_4"
    ):
        assert older.save_state().endswith("checkpoint_4")  # never overwrite a newer checkpoint, never fail
    assert names(tmp_path) == ["checkpoint_2", "checkpoint_3", "checkpoint_4"]
    assert older.save_iteration == 5


def test_rotation_never_deletes_the_checkpoint_the_run_loaded(tmp_path):
    save_n(tmp_path, 2)
    accelerator = build(tmp_path, total_limit=1)[0]
    accelerator.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    accelerator.project_configuration.iteration = 2
    accelerator.save_state()
    accelerator.save_state()
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_3"]


def test_incomplete_and_stray_folders_are_ignored(tmp_path):
    save_n(tmp_path, 2, total_limit=5)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "checkpoint_7").mkdir()  # no manifest: a save that never committed
    (checkpoints / "checkpoint_9.incomplete").mkdir()
    (checkpoints / "notes").mkdir()
    (checkpoints / "README.txt").write_text("mine")
    accelerator = build(tmp_path, total_limit=1)[0]
    accelerator.load_state()
    assert accelerator.save_iteration == 2  # loaded checkpoint_1, not the uncommitted checkpoint_7
    with pytest.warns(UserWarning, match="saving as checkpoint_8 so nothing is overwritten"):
        accelerator.save_state()
    # Rotation counted only committed checkpoints: it deleted checkpoint_0, kept the loaded checkpoint_1.
    assert names(tmp_path) == [
        "README.txt", "checkpoint_1", "checkpoint_7", "checkpoint_8", "checkpoint_9.incomplete", "notes",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"checkpoint_7 is not a complete checkpoint \(it has no manifest.json\)"):
        accelerator.load_state(checkpoints / "checkpoint_7")


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    save_n(tmp_path, 1)
    folder = tmp_path / "checkpoints" / "checkpoint_0"
    accelerator = build(tmp_path)[0]
    (folder / "scheduler.bin").unlink()
    with pytest.raises(ValueError, match=r"scheduler.bin is missing from the checkpoint"):
        accelerator.load_state(folder)
    weights = folder / "optimizer.bin"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"optimizer.bin has \d+ bytes but the manifest says \d+"):
        accelerator.load_state(folder)
    with pytest.raises(FileNotFoundError, match=r"checkpoint_5 does not exist"):
        accelerator.load_state(tmp_path / "checkpoints" / "checkpoint_5")


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    accelerator = save_n(tmp_path, 1)
    other = Accelerator()
    other.prepare(nn.Linear(4, 1), nn.Linear(1, 1))
    with pytest.raises(ValueError, match=r"holds 1 model\(s\) but 2 were prepared"):
        other.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    wider = Accelerator()
    wider.prepare(nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 1)))
    with pytest.raises(ValueError, match=r"model.safetensors does not fit the prepared model \(size mismatch"):
        wider.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    renamed = Accelerator()
    renamed.prepare(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1)))
    with pytest.raises(ValueError, match=r"does not fit the prepared model \(missing keys: \['1.weight'"):
        renamed.load_state(tmp_path / "checkpoints" / "checkpoint_0")
    assert accelerator.save_iteration == 1


def test_explicit_output_dir_is_replaced_whole(tmp_path):
    accelerator, model, *_ = build(automatic=False)
    target = tmp_path / "state"
    accelerator.save_state(target)
    (target / "leftover.txt").write_text("from before")  # inside a checkpoint: replaced with it
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    accelerator.save_state(target)
    assert not (target / "leftover.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    fresh, fresh_model, *_ = build(automatic=False)
    fresh.load_state(target)
    assert torch.equal(fresh_model[0].weight, torch.full((8, 4), 3.0))
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["iteration"] is None and manifest["world_size"] == 1


def test_save_state_needs_a_folder(tmp_path):
    accelerator = build(automatic=False)[0]
    with pytest.raises(ValueError, match=r"save_state\(\) needs an output_dir unless"):
        accelerator.save_state()
    with pytest.raises(ValueError, match=r"automatic_checkpoint_naming needs a project_dir"):
        build(None)[0].save_state()
    with pytest.raises(ValueError, match=r"register_for_checkpointing needs objects with state_dict"):
        accelerator.register_for_checkpointing(object())


def test_save_and_load_pre_hooks(tmp_path):
    accelerator, model, *_ = build(tmp_path)
    calls = []

    def on_save(models, weights, output_dir):
        calls.append(("save", len(models), sorted(weights[0]), output_dir))
        Path(output_dir, "config.yaml").write_text("lr: 0.1\n")

    handle = accelerator.register_save_state_pre_hook(on_save)
    accelerator.register_load_state_pre_hook(lambda models, input_dir: calls.append(("load", len(models), input_dir)))
    folder = accelerator.save_state()
    manifest = json.loads((tmp_path / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert "config.yaml" in manifest["files"]  # written by the hook, so part of the committed checkpoint
    assert calls[0][:3] == ("save", 1, ["0.bias", "0.weight", "2.bias", "2.weight"])
    assert calls[0][3].endswith("checkpoint_0.incomplete")
    accelerator.load_state(folder)
    assert calls[1] == ("load", 1, folder)
    handle.remove()
    accelerator.save_state()
    assert len(calls) == 2


def test_a_background_commit_returns_before_the_commit_and_every_wait_completes_it(tmp_path, monkeypatch):
    import threading

    import runner.engine.checkpoint.manifest as manifest_module

    release = threading.Event()
    write_manifest = manifest_module.write_manifest

    def slow_manifest(*args, **kwargs):
        release.wait(timeout=30)  # the commit cannot finish before the test lets it
        write_manifest(*args, **kwargs)

    monkeypatch.setattr(manifest_module, "write_manifest", slow_manifest)
    accelerator, model, *_ = build(tmp_path, total_limit=2)
    folder = Path(accelerator.save_state(async_save="commit"))
    assert not folder.exists() and (tmp_path / "checkpoints" / "checkpoint_0.incomplete").is_dir()
    release.set()
    accelerator.load_state()  # waits for the commit, then loads it
    assert (folder / "manifest.json").is_file()
    for _ in range(3):
        accelerator.save_state(async_save="commit")
    accelerator.end_training()  # waits for the last commit; rotation ran after each commit
    # The newest two stay, and checkpoint_0, which this run loaded.
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_2", "checkpoint_3"]


def test_a_failed_background_commit_surfaces_and_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    import runner.engine.checkpoint.manifest as manifest_module

    accelerator = build(tmp_path)[0]
    accelerator.save_state()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(manifest_module, "write_manifest", disk_full)
    accelerator.save_state(async_save="commit")
    with pytest.raises(CheckpointError, match="Committing the last checkpoint failed: OSError: .*No space left"):
        accelerator.wait_for_checkpoint()
    accelerator.wait_for_checkpoint()  # reported once
    assert names(tmp_path) == ["checkpoint_0", "checkpoint_1.incomplete"]
    fresh = build(tmp_path)[0]
    fresh.load_state()
    assert fresh.save_iteration == 1


def test_save_state_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path):
    accelerator = build(automatic=False)[0]
    (tmp_path / "results.txt").write_text("precious")
    with pytest.raises(CheckpointError, match=r"exists and is not a checkpoint; save_state replaces its output_dir"):
        accelerator.save_state(tmp_path)
    assert (tmp_path / "results.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.txt"]
    (tmp_path / "empty").mkdir()
    accelerator.save_state(tmp_path / "empty")  # an empty folder is fine
    assert (tmp_path / "empty" / "manifest.json").is_file()


def test_fsdp_checkpoints_on_one_process_use_dcp_and_refuse_another_model(tmp_path):
    import warnings

    from runner.engine import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"])
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # DCP's "no process group" warning is expected here, and silenced
        accelerator.save_state(tmp_path / "ck")
    assert (tmp_path / "ck" / "model" / ".metadata").is_file() and (
        tmp_path / "ck" / "optimizer" / ".metadata"
    ).is_file()

    other = Accelerator(fsdp_plugin=plugin)
    wrong = torch.nn.Sequential(torch.nn.Linear(3, 3))
    wrong, wrong_optimizer = other.prepare(wrong, torch.optim.SGD(wrong.parameters(), lr=0.1))
    with pytest.raises(CheckpointError) as error:
        other.load_state(tmp_path / "ck")
    assert str(error.value) == (
        f"{tmp_path / 'ck' / 'model'} does not fit the prepared model or optimizer (Size mismatch between saved "
        "torch.Size([4, 4]) and current: torch.Size([3, 3]) for model.0.weight); load a checkpoint of the same model."
    )
