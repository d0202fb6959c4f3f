"""Across 2 processes: triggers, a forced gradient sync, joining uneven inputs, copy_tensor_to_devices."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator, DataLoaderConfiguration
from runner.engine.utils import copy_tensor_to_devices


def _triggers():
    accelerator = Accelerator()
    seen = [accelerator.check_trigger()]
    if accelerator.process_index == 1:
        accelerator.set_trigger()
    seen += [accelerator.check_trigger(), accelerator.check_trigger()]
    return seen


def test_a_trigger_set_on_one_process_is_seen_by_every_process_once(launch):
    assert launch(_triggers) == [[False, True, False], [False, True, False]]


def _linear(accelerator, weight):
    model = nn.Linear(len(weight), 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([weight]))
    return accelerator.prepare(model)


def _forced_sync():
    accelerator = Accelerator()
    scale = accelerator.process_index + 1.0
    input_a, input_b = torch.tensor([[scale, 0.0]]), torch.tensor([[0.0, 10 * scale]])
    grads = {}
    for trigger in (False, True):
        model = _linear(accelerator, [1.0, 1.0])
        with accelerator.no_sync(model):
            loss_a, loss_b = model(input_a).sum(), model(input_b).sum()
        accelerator.backward(loss_a)  # forward ran under no_sync: accumulates locally
        with accelerator.trigger_sync_in_backward(model) if trigger else accelerator.no_sync(model):
            accelerator.backward(loss_b)
        grads[trigger] = model.module.weight.grad.clone()
    return grads


def test_trigger_sync_in_backward_syncs_the_gradients_accumulated_under_no_sync(launch):
    rank0, rank1 = launch(_forced_sync)
    assert torch.equal(rank0[False], torch.tensor([[1.0, 10.0]]))  # without the trigger: local sums
    assert torch.equal(rank1[False], torch.tensor([[2.0, 20.0]]))
    assert torch.equal(rank0[True], torch.tensor([[1.5, 15.0]])) and torch.equal(rank1[True], rank0[True])


def _train_joined(config_even_batches, join_even_batches):
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=config_even_batches))
    model = _linear(accelerator, [1.0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # Five samples of batch 1 on two ranks: global batches [1, 2], [3, 4], [5]. Rank 0 gets 1, 3, 5.
    data = DataLoader(TensorDataset(torch.arange(1.0, 6.0).unsqueeze(1)), batch_size=1)
    optimizer, loader = accelerator.prepare(optimizer, data)
    steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=join_even_batches):
            inside = loader.batch_sampler.even_batches
            for (inputs,) in loader:
                accelerator.backward(model(inputs).sum())  # d(loss)/d(weight) = the input
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
    return {
        "steps": steps,
        "weight": model.module.weight.item(),
        "warnings": [str(w.message) for w in caught if "join_uneven_inputs" in str(w.message)],
        "even_batches": (inside, loader.batch_sampler.even_batches),
    }


def test_join_uneven_inputs_lets_the_rank_with_fewer_batches_finish_first(launch):
    rank0, rank1 = launch(_train_joined, False, None)
    assert (rank0["steps"], rank1["steps"]) == (3, 2)
    # Steps 1-2 average both ranks' inputs (1.5, 3.5); step 3 is rank 0's 5 over the initial world size of 2.
    # Joining ends with rank 0, the last to finish, sending its weights to rank 1.
    assert rank0["weight"] == pytest.approx(1.0 - 0.1 * (1.5 + 3.5 + 2.5))
    assert rank1["weight"] == rank0["weight"]
    assert rank0["warnings"] == rank1["warnings"] == []


def test_join_uneven_inputs_overrides_the_loaders_even_batches_inside_the_block(launch):
    rank0, rank1 = launch(_train_joined, True, False)
    # Inside the block the padded loader is uneven, as in Accelerate: rank 1 has one batch fewer and joins early.
    assert (rank0["steps"], rank1["steps"]) == (3, 2)
    assert rank0["weight"] == pytest.approx(1.0 - 0.1 * (1.5 + 3.5 + 2.5)) and rank1["weight"] == rank0["weight"]
    assert rank0["even_batches"] == rank1["even_batches"] == (False, True)  # and even again after it
    assert rank0["warnings"] == []


def _copy(holders):
    accelerator = Accelerator()
    mine = torch.arange(6).reshape(2, 3) if accelerator.process_index in holders else None
    try:
        copy = copy_tensor_to_devices(mine)
    except ValueError as error:
        return str(error)
    return copy


def test_copy_tensor_to_devices_sends_one_process_tensor_to_all(launch):
    rank0, rank1 = launch(_copy, [1])
    assert torch.equal(rank0, torch.arange(6).reshape(2, 3)) and rank0.dtype == torch.int64
    assert torch.equal(rank1, rank0)


def test_copy_tensor_to_devices_refuses_two_holders_on_every_rank(launch):
    rank0, rank1 = launch(_copy, [0, 1])
    assert rank0 == rank1 and "exactly one process" in rank0 and "[0, 1]" in rank0


def _join_over_a_dispatched_loader():
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    model = _linear(accelerator, [1.0])
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(5.0)), batch_size=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with accelerator.join_uneven_inputs([model], even_batches=False):
            inside = loader.sharding.even_batches
    return inside, [str(w.message) for w in caught if "join_uneven_inputs" in str(w.message)]


def test_join_uneven_inputs_leaves_a_dispatched_loaders_even_batches_and_says_so(launch):
    for inside, said in launch(_join_over_a_dispatched_loader):
        assert inside is True
        assert said == [
            "join_uneven_inputs(even_batches=False): overriding even_batches is only supported for map-style "
            "datasets each process reads itself; the loaders over TensorDataset (dispatched by rank 0, or streamed) "
            "keep theirs."
        ]
