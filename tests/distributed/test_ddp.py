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
