"""Two checkpoints and two runs' logged values compared bit for bit, each difference named."""

import math

import torch
from torch import nn

from runner.engine import Accelerator, ProjectConfiguration
from runner.folders.state_compare import (
    checkpoint_differences,
    describe_file,
    logged_differences,
    tensor_difference,
)
from tests.helpers import StepCounter


def _checkpoint(folder, *, nudge: bool = False, count: int = 3):
    accelerator = Accelerator(project_config=ProjectConfiguration(str(folder), automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counter = StepCounter()
    counter.count = count
    accelerator.register_for_checkpointing(counter)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.ones(4, 3)).sum())
    optimizer.step()
    if nudge:
        with torch.no_grad():
            model.weight[1, 2] += 1e-3
    accelerator.save_state()
    return folder / "checkpoints" / "checkpoint_0"


def test_the_same_state_has_no_difference_and_a_changed_value_is_named_with_its_tensor(tmp_path):
    first, same = _checkpoint(tmp_path / "a"), _checkpoint(tmp_path / "b")
    assert checkpoint_differences(first, same) == []
    nudged = _checkpoint(tmp_path / "c", nudge=True, count=4)
    found = [difference.sentence() for difference in checkpoint_differences(first, nudged)]
    assert found[0].startswith("model weights: weight: 1 of 6 values differ, by up to 0.001 (first at index 5: ")
    assert "registered object 0: count: 3 vs 4" in found
    assert all(not line.startswith(("optimizer", "RNG")) for line in found)  # the optimizer stepped alike


def test_tensors_differ_by_their_bits_and_files_are_named_as_users_read_them():
    assert tensor_difference(torch.tensor([1.0, math.nan]), torch.tensor([1.0, math.nan])) is None
    assert tensor_difference(torch.tensor([0.0]), torch.tensor([-0.0])) == (
        "the same values in other bits (signed zeros or NaN payloads)"
    )
    assert tensor_difference(torch.zeros(2), torch.zeros(3)) == "torch.float32[2] vs torch.float32[3]"
    assert (
        tensor_difference(torch.tensor([1, 2]), torch.tensor([1, 5]))
        == "1 of 2 values differ (first at index 1: 2 vs 5)"
    )
    assert [describe_file(name) for name in ("model.safetensors", "optimizer_1.bin", "random_states_3.pt",
                                             "model/__0_0.distcp", "custom_checkpoint_0.pt", "vocab.json")] == [
        "model weights", "optimizer state 1", "RNG states of process 3", "model weights (sharded)",
        "registered object 0", "file vocab.json"]  # fmt: skip


def test_logged_values_differ_at_their_first_step_in_step_order_and_timings_are_left_out():
    a = {"train/loss": [(1, 2.0), (2, 1.5), (3, 1.0)], "eval/accuracy": [(3, 0.5)],
         "train/samples_per_second": [(1, 100.0)], "train/mfu": [(1, 0.3)]}  # fmt: skip
    b = {"train/loss": [(1, 2.0), (2, 1.25), (3, 0.5)], "eval/accuracy": [(3, 0.5)],
         "train/samples_per_second": [(1, 250.0)], "train/lr": [(1, 0.1)]}  # fmt: skip
    found = [(d.what, d.where, d.detail) for d in logged_differences(a, b)]
    assert found == [
        ("logged train/loss", "step 2", "1.5 vs 1.25 (by 0.25, 1.67e-01 relative)"),
        ("logged train/lr", "", "only the second run logs it"),
    ]
