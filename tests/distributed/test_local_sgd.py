"""LocalSGD on 2 gloo processes: replicas drift between averages, meet at their mean, and plain DDP when disabled."""

import torch

from runner.engine import Accelerator
from runner.engine.local_sgd import LocalSGD

LOCAL_SGD_STEPS = 2
STEPS = 5  # averages after steps 2 and 4, then once more on leaving the context


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([parameter.detach().flatten() for parameter in model.parameters()])


def _train(accelerator: Accelerator, *, enabled: bool) -> dict:
    """Steps on data that differs by rank; each step's parameters before and after ``local_sgd.step()``."""
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(3, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs = torch.arange(6.0).reshape(2, 3) * (accelerator.process_index + 1)
    before, after = [], []
    with LocalSGD(accelerator, model, local_sgd_steps=LOCAL_SGD_STEPS, enabled=enabled) as local_sgd:
        for _ in range(STEPS):
            accelerator.backward(model(inputs).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            before.append(_flat(model))
            local_sgd.step()
            after.append(_flat(model))
    return {"before": before, "after": after, "on_exit": _flat(model), "enabled": local_sgd.enabled}


def _local_sgd_and_disabled():
    accelerator = Accelerator()
    return _train(accelerator, enabled=True), _train(accelerator, enabled=False)


def test_local_sgd_averages_every_k_steps_and_on_exit(launch):
    (local0, plain0), (local1, plain1) = launch(_local_sgd_and_disabled)
    assert local0["enabled"] and local1["enabled"]
    for step in range(STEPS):
        mean = (local0["before"][step] + local1["before"][step]) / 2
        # No gradient all-reduce: from equal parameters, different data moves the ranks apart.
        assert not torch.allclose(local0["before"][step], local1["before"][step])
        if (step + 1) % LOCAL_SGD_STEPS == 0:
            assert torch.equal(local0["after"][step], local1["after"][step])
            torch.testing.assert_close(local0["after"][step], mean)
        else:
            assert torch.equal(local0["after"][step], local0["before"][step])
            assert torch.equal(local1["after"][step], local1["before"][step])
    last = (local0["after"][-1] + local1["after"][-1]) / 2
    assert torch.equal(local0["on_exit"], local1["on_exit"])
    torch.testing.assert_close(local0["on_exit"], last)
    # Disabled: DDP all-reduces the gradients, so the ranks agree after every step and step() changes nothing.
    assert not plain0["enabled"] and not plain1["enabled"]
    for step in range(STEPS):
        assert torch.equal(plain0["before"][step], plain1["before"][step])
        assert torch.equal(plain0["after"][step], plain0["before"][step])
    assert torch.equal(plain0["on_exit"], plain0["after"][-1])
