"""Interrupted and resumed == uninterrupted, bit for bit: the engine from a plain script, one process."""

import json

import pytest
import torch

from runner.engine import Accelerator, ProjectConfiguration
from tests.helpers import assert_same_optimizer_state, resumable_run

# 60 samples, batch 4: 15 micro-steps an epoch. Stops mid-epoch, at an epoch's end, mid accumulation cycle.
CASES = [(1, "no", 5), (1, "no", 15), (1, "no", 22), (3, "no", 7), (3, "no", 21), (3, "fp16", 11), (1, "fp16", 8)]


@pytest.mark.parametrize(("accumulation", "precision", "stop_after"), CASES)
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, accumulation, precision, stop_after):
    check_resume(tmp_path, accumulation, precision, stop_after, augment=False)


@pytest.mark.parametrize("stop_after", [5, 22])
def test_resume_is_exact_with_random_augmentation_and_no_loader_generator(tmp_path, stop_after):
    check_resume(tmp_path, 1, "no", stop_after, augment=True)


@pytest.mark.parametrize("stop_after", [5, 22])
def test_resume_is_exact_with_random_augmentation_in_two_loader_workers(tmp_path, stop_after):
    check_resume(tmp_path, 1, "no", stop_after, augment=True, num_workers=2)


@pytest.mark.parametrize("augment", [False, True])
def test_resume_is_exact_with_the_seedable_sampler(tmp_path, augment):
    check_resume(tmp_path, 3, "no", 7, augment=augment, seedable=True)


def check_resume(tmp_path, accumulation, precision, stop_after, *, augment, num_workers=0, seedable=False):
    settings = {
        "accumulation": accumulation,
        "precision": precision,
        "augment": augment,
        "num_workers": num_workers,
        "seedable": seedable,
    }
    full = resumable_run(tmp_path / "full", **settings)
    first = resumable_run(tmp_path / "cut", stop_after=stop_after, **settings)
    rest = resumable_run(tmp_path / "cut", resume=True, **settings)

    assert first["seen"] + rest["seen"] == full["seen"]  # the same samples in the same order
    assert first["losses"] + rest["losses"] == full["losses"]  # the same numbers, exactly
    for key, value in full["weights"].items():
        assert torch.equal(value, rest["weights"][key]), key
    assert_same_optimizer_state(full["optimizer"], rest["optimizer"])
    assert full["scale"] == rest["scale"]

    manifest = json.loads((tmp_path / "cut" / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    epoch, in_epoch = divmod(stop_after, 15)
    position = manifest["dataloaders"][0]
    assert position["epoch"] == epoch and position["samples_seen"] == 4 * in_epoch
    if seedable:
        assert position["seed"] == 0  # torch.manual_seed(0)'s, with or without a loader generator, as in Accelerate
    else:  # what the pass drew from: the loader's generator, or (without one) a seed drawn from torch's
        assert "seed" not in position and len(position["generators"]) == (0 if augment else 1)
        assert (type(position["draw_seed"]) is int) == augment
        # At an epoch's end the pass is replayed on load, since its sampler may draw once more when it ends.
        assert position.get("replay", False) == (in_epoch == 0)
    assert manifest["accumulation_step"] == in_epoch  # micro-steps since the epoch began
    mid_cycle = in_epoch % accumulation != 0
    assert ("gradients_0.safetensors" in manifest["files"]) == mid_cycle
    assert manifest["checksum"] == "xxh3_128"
    for entry in manifest["files"].values():  # one xxh3_128 per 32 MiB slice of each file
        assert len(entry["digests"]) == max(1, -(-entry["bytes"] // (32 << 20)))
        assert all(len(digest) == 32 for digest in entry["digests"])
    if precision == "no" and accumulation == 1:
        assert manifest["step"] == stop_after and manifest["epoch"] == epoch


def test_mid_cycle_checkpoint_refuses_other_accumulation_settings(tmp_path):
    resumable_run(tmp_path, accumulation=3, stop_after=7)
    with pytest.raises(ValueError, match=r"saved in the middle of a gradient accumulation cycle by 1 process\(es\)"):
        resumable_run(tmp_path, accumulation=2, resume=True)


def test_skip_first_batches_skips_without_loading():
    accelerator = Accelerator()
    loads = []

    class Recorded(torch.utils.data.Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, index):
            loads.append(index)
            return index

    data = accelerator.prepare(torch.utils.data.DataLoader(Recorded(), batch_size=2))
    assert [b.tolist() for b in accelerator.skip_first_batches(data, 3)] == [[6, 7], [8, 9]]
    assert loads == [6, 7, 8, 9]
    assert [b.tolist() for b in data][0] == [0, 1]  # only the one pass skipped


def test_a_position_loaded_but_not_yet_used_is_saved_again(tmp_path):
    def build():
        accelerator = Accelerator(project_config=ProjectConfiguration(str(tmp_path), automatic_checkpoint_naming=True))
        return accelerator, accelerator.prepare(
            torch.utils.data.DataLoader(torch.arange(60), batch_size=4, shuffle=True)
        )

    accelerator, data = build()
    for step, _ in enumerate(data, start=1):
        if step == 10:
            accelerator.save_state()
            break
    accelerator, data = build()
    accelerator.load_state()
    accelerator.save_state()  # before the loader ever ran
    manifest = json.loads((tmp_path / "checkpoints" / "checkpoint_1" / "manifest.json").read_text())
    assert manifest["dataloaders"][0]["samples_seen"] == 40
    assert len(list(data)) == 5  # and the pass still starts after those 40 samples
