"""DDP on 2 gloo processes computes what one process computes with the global batch."""

import torch

from runner.engine import Accelerator
from tests.helpers import assert_state_close, train


def _train_ddp(batch_size: int, accumulation: int):
    accelerator = Accelerator(gradient_accumulation_steps=accumulation)
    weights = train(accelerator, batch_size=batch_size, epochs=2)
    return accelerator.num_processes, accelerator.distributed_type.value, type(accelerator._models[0]).__name__, weights


def test_two_processes_match_one_process_with_the_global_batch(launch):
    results = launch(_train_ddp, 4, 1)
    reference = train(Accelerator(), batch_size=8, epochs=2)
    for world, kind, wrapper, weights in results:
        assert (world, kind, wrapper) == (2, "MULTI_CPU", "DistributedDataParallel")
        assert_state_close(weights, reference, atol=1e-5)
    # Sanity: training moved the weights, so the comparison is not between two initial models.
    untrained = train(Accelerator(), batch_size=8, epochs=0)
    assert not torch.allclose(untrained["0.weight"], reference["0.weight"], atol=1e-3)


def test_accumulation_across_processes_matches_the_larger_batch(launch):
    # 2 processes x batch 2 x 2 micro-steps == 1 process x batch 8.
    results = launch(_train_ddp, 2, 2)
    reference = train(Accelerator(), batch_size=8, epochs=2)
    for *_, weights in results:
        assert_state_close(weights, reference, atol=1e-5)


def _count_syncs():
    accelerator = Accelerator(gradient_accumulation_steps=3)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    loader = accelerator.prepare(
        torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(40, 2)), batch_size=2)
    )
    flags = []
    for (x,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
            flags.append(accelerator.sync_gradients)
    grads_equal = torch.equal(*accelerator.gather(model.module.weight.grad[None]))
    return flags, grads_equal


def test_sync_gradients_once_per_cycle_and_at_the_end_of_the_loader(launch):
    for flags, grads_equal in launch(_count_syncs):
        # 40 samples / (2 ranks x 2) = 10 micro-steps per rank: syncs at 3, 6, 9 and at the last.
        assert flags == [False, False, True] * 3 + [True]
        assert grads_equal


def _gradients_across_ranks(sync_each_batch: bool):
    from runner.engine import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(gradient_accumulation_plugin=plugin)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    data = torch.utils.data.TensorDataset(torch.arange(16.0).view(8, 2))  # each rank gets different rows
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=1))
    equal_after_backward = []
    for (x,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(x).sum())
        grads = accelerator.gather(model.module.weight.grad[None].clone())
        equal_after_backward.append(torch.equal(grads[0], grads[1]))
        if accelerator.sync_gradients:
            model.zero_grad()

    # no_sync by hand: local gradients only, until a backward outside it averages them.
    model.zero_grad()
    with accelerator.no_sync(model):
        accelerator.backward(model(data.tensors[0][accelerator.process_index :: 2]).sum())
    grads = accelerator.gather(model.module.weight.grad[None].clone())
    manual = [torch.equal(grads[0], grads[1])]
    accelerator.backward(model(data.tensors[0][:1]).sum())
    grads = accelerator.gather(model.module.weight.grad[None].clone())
    manual.append(torch.equal(grads[0], grads[1]))
    return equal_after_backward, manual


def test_gradients_differ_across_ranks_until_the_sync_step(launch):
    for equal, manual in launch(_gradients_across_ranks, False):
        assert equal == [False, True] * 2  # 4 micro-steps per rank, a sync every second
        assert manual == [False, True]
    for equal, _ in launch(_gradients_across_ranks, True):
        assert equal == [True] * 4  # sync_each_batch communicates on every micro-step
