import torch
from torch import nn

from runner.engine import Accelerator, GradientAccumulationPlugin
from tests.helpers import assert_state_close, loader, regression_data, small_model, train


def test_k_accumulated_micro_batches_equal_one_k_times_larger_batch():
    accumulated = train(Accelerator(gradient_accumulation_steps=4), batch_size=2, epochs=2)
    large = train(Accelerator(), batch_size=8, epochs=2)
    assert_state_close(accumulated, large, atol=1e-6)


def test_sync_gradients_is_true_once_per_k_and_at_the_last_batch():
    accelerator = Accelerator(gradient_accumulation_steps=3)
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(regression_data(20), 2))
    flags, steps = [], 0
    for x, y in data:  # 10 micro-batches
        with accelerator.accumulate(model):
            before = model[0].weight.detach().clone()
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            flags.append(accelerator.sync_gradients)
            steps += not torch.equal(before, model[0].weight)
    assert flags == [False, False, True] * 3 + [True]
    assert steps == 4  # the optimizer really stepped only on syncing micro-steps


def test_gradients_accumulate_between_syncs_and_are_cleared_after():
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model = nn.Linear(1, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    grads = []
    for value in (1.0, 3.0, 5.0):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.tensor([[value]])).sum())
            grads.append(model.weight.grad.item())
            optimizer.step()
            optimizer.zero_grad()
    # backward divides by 2; zero_grad is a no-op until the sync at micro-step 2.
    assert grads == [0.5, 2.0, 2.5]


def test_without_sync_with_dataloader_the_cycle_spans_epochs():
    accelerator = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(3, sync_with_dataloader=False))
    model = accelerator.prepare(nn.Linear(8, 1))
    data = accelerator.prepare(loader(regression_data(8), 2))
    flags = []
    for _ in range(2):
        for _batch in data:
            with accelerator.accumulate(model):
                flags.append(accelerator.sync_gradients)
    assert flags == [False, False, True, False, False, True, False, False]
