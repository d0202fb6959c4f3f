"""A ported Accelerate loop gets Accelerate's data: the same batches on every rank, the same padding, the same
global random stream after every pass, on 1 and 2 gloo processes (tests/distributed/data/accelerate_orders.json).
"""

import pytest

from tests.distributed.accelerate_orders import SCENARIOS, TRAIN_SAMPLES, record_with_runner, reference


@pytest.mark.parametrize("nproc", [1, 2])
def test_prepared_loaders_give_accelerates_batches_and_random_stream(launch, nproc):
    expected = reference(nproc)
    ranks = launch(record_with_runner, nproc=nproc)
    for rank, (ours, theirs) in enumerate(zip(ranks, expected, strict=True)):
        for scenario in SCENARIOS:
            assert ours[scenario] == theirs[scenario], f"rank {rank}, {scenario}"
        # The same data and random streams train to Accelerate's numbers: every loss, every evaluation, the weights.
        assert ours["training"] == theirs["training"], f"rank {rank}, training"


def _standalone_seedable_order():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from runner.engine import Accelerator
    from runner.engine.data_loader import prepare_data_loader

    Accelerator()  # joins the process group, as a script's does before it shards a loader by hand
    loader = DataLoader(TensorDataset(torch.arange(TRAIN_SAMPLES)), batch_size=4, shuffle=True)
    # Accelerate's positional order: device, num_processes, process_index, split_batches, put_on_device, ...
    prepared = prepare_data_loader(loader, None, None, None, False, True, use_seedable_sampler=True, data_seed=3)
    return [batch.tolist() for (batch,) in prepared]


@pytest.mark.parametrize("nproc", [1, 2])
def test_prepare_data_loader_alone_takes_accelerates_arguments_and_gives_its_order(launch, nproc):
    orders = launch(_standalone_seedable_order, nproc=nproc)
    assert orders == [rank["seedable_data_seed"]["epochs"][0]["train"] for rank in reference(nproc)]
