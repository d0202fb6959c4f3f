"""Resume on 2 gloo processes: exact on the same world size; on another, every remaining sample once."""

import json
import warnings

import pytest
import torch

from tests.helpers import assert_same_optimizer_state, resumable_run


def _run(project_dir, options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = resumable_run(project_dir, **options)
    result["warnings"] = [str(w.message) for w in caught if "re-derived" in str(w.message)]
    return result


def assert_continues_exactly(full, first, rest):
    """On every rank the cut run and its resumption saw, computed and ended with what the uninterrupted run did."""
    for rank in (0, 1):
        assert first[rank]["seen"] + rest[rank]["seen"] == full[rank]["seen"]
        assert first[rank]["losses"] + rest[rank]["losses"] == full[rank]["losses"]
        for key, value in full[rank]["weights"].items():
            assert torch.equal(value, rest[rank]["weights"][key]), key
        assert_same_optimizer_state(full[rank]["optimizer"], rest[rank]["optimizer"])
        assert rest[rank]["warnings"] == []


def test_two_processes_interrupted_and_resumed_equal_uninterrupted(launch, tmp_path):
    options = {"accumulation": 2, "precision": "fp16", "batch_size": 2}  # 15 micro-steps an epoch per rank
    full = launch(_run, str(tmp_path / "full"), options)
    first = launch(_run, str(tmp_path / "cut"), {**options, "stop_after": 20})  # epoch 1, mid-cycle
    rest = launch(_run, str(tmp_path / "cut"), {**options, "resume": True})
    assert_continues_exactly(full, first, rest)
    manifest = json.loads((tmp_path / "cut" / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert {"gradients_0.safetensors", "gradients_1.safetensors"} <= set(manifest["files"])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_random_augmentation_resumes_exactly_on_two_processes(launch, tmp_path, num_workers):
    # __getitem__ draws from torch's RNG: in the process itself, or in each loader worker.
    options = {"augment": True, "num_workers": num_workers, "epochs": 2}  # 60 samples: 8 micro-steps an epoch
    full = launch(_run, str(tmp_path / "full"), options)
    first = launch(_run, str(tmp_path / "cut"), {**options, "stop_after": 11})  # 3 steps into epoch 1
    rest = launch(_run, str(tmp_path / "cut"), {**options, "resume": True})
    assert_continues_exactly(full, first, rest)
    assert full[0]["losses"] != full[1]["losses"]  # the ranks' augmentations differ


def _epoch_samples(parts, epoch_start, epoch_end):
    """Sample ids used in micro-steps [epoch_start, epoch_end) of a rank's list of batches."""
    return [i for batch in parts[epoch_start:epoch_end] for i in batch]


def test_two_to_one_process_continues_the_epoch_with_each_sample_once(launch, tmp_path):
    # 48 samples: 6 global batches of 8 on 2 processes, 12 of 4 on one. Stop 3 steps into epoch 1.
    options = {"n": 48, "batch_size": 4, "epochs": 2}
    first = launch(_run, str(tmp_path), {**options, "stop_after": 9})
    (rest,) = launch(_run, str(tmp_path), {**options, "resume": True}, nproc=1)
    before = [i for rank in first for i in _epoch_samples(rank["seen"], 6, 9)]
    after = _epoch_samples(rest["seen"], 0, 6)
    assert len(rest["seen"]) == 6  # the rest of epoch 1, then the run ends
    assert sorted(before + after) == list(range(48))
    assert rest["warnings"] == [
        "checkpoint_0 was saved by 2 process(es) and is loaded by 1: the data continues exactly, random "
        "streams are re-derived per rank."
    ]


def test_one_to_two_processes_continues_the_epoch_with_each_sample_once(launch, tmp_path):
    options = {"n": 48, "batch_size": 4, "epochs": 1}
    (first,) = launch(_run, str(tmp_path), {**options, "stop_after": 5}, nproc=1)  # 20 of 48 samples
    rest = launch(_run, str(tmp_path), {**options, "resume": True})
    after = [i for rank in rest for batch in rank["seen"] for i in batch]
    # 28 samples: 3 global batches of 8 and one of 4, rank 0's whole; the epoch's first 4 pad rank 1's (even_batches)
    padding = first["seen"][0]
    assert rest[1]["seen"][-1] == padding
    assert sorted(_epoch_samples(first["seen"], 0, 5) + after) == sorted([*range(48), *padding])
    assert [len(rank["seen"]) for rank in rest] == [4, 4]
    assert all(rank["warnings"] for rank in rest)
    assert rest[0]["losses"] != rest[1]["losses"]
