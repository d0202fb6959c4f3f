"""Stopping mid-epoch and resuming from save_state continues the same data order exactly."""

import json

import pytest
import torch
from torch import nn

from runner.engine import Accelerator, ProjectConfiguration
from tests.helpers import loader, regression_data, small_model

EPOCHS = 3


def run(project_dir, *, accumulation=1, stop_after=None, resume=False):
    accelerator = Accelerator(
        gradient_accumulation_steps=accumulation,
        project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True),
    )
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(regression_data(60), 4))
    if resume:
        accelerator.load_state()
    seen, micro_steps = [], 0
    while data.iteration < EPOCHS:
        for x, y in data:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            seen.append(x[:, 0].tolist())
            micro_steps += 1
            if micro_steps == stop_after:
                accelerator.save_state()
                return seen, None
    return seen, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("accumulation", "stop_after"), [(1, 5), (1, 15), (1, 22), (3, 6), (3, 21)])
def test_resume_mid_epoch_continues_the_same_data_and_weights(tmp_path, accumulation, stop_after):
    full_seen, full_weights = run(tmp_path / "full", accumulation=accumulation)
    first, _ = run(tmp_path / "cut", accumulation=accumulation, stop_after=stop_after)
    rest, weights = run(tmp_path / "cut", accumulation=accumulation, resume=True)
    assert first + rest == full_seen  # 15 batches an epoch: 5 and 22 stop mid-epoch, 15 at its end
    for key, value in full_weights.items():
        assert torch.equal(value, weights[key]), key
    manifest = json.loads((tmp_path / "cut" / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    epoch, batches = divmod(stop_after, 15)
    assert manifest["dataloaders"] == [{"epoch": epoch, "batches_yielded": batches, "global_batch_size": 4}]


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
