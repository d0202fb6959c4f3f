"""gather and reduce on 2 gloo processes behave as Accelerate 1.x's (tensors requiring grad, reductions, defaults)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator
from runner.engine import utils as engine_utils


def _gather_tensors_requiring_grad():
    accelerator = Accelerator()
    rank = accelerator.process_index
    weight = torch.full((2,), float(rank + 1), requires_grad=True)
    loss = (weight * 2).sum()  # 4 on rank 0, 8 on rank 1; a 0-dim tensor with a grad_fn
    gathered = accelerator.gather(loss)
    nested = engine_utils.gather({"w": weight, "parts": [weight * 10, (loss,)]})
    linear = torch.nn.Linear(1, 1)
    with torch.no_grad():
        linear.weight.fill_(1.0)
        linear.bias.zero_()
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(5.0)[:, None]), batch_size=2))
    predictions = [accelerator.gather_for_metrics(linear(batch)) for (batch,) in loader]
    loss.backward()  # the caller's graph is intact after gathering
    tensors = [gathered, nested["w"], nested["parts"][0], nested["parts"][1][0], *predictions]
    return {
        "requires_grad": [t.requires_grad for t in tensors],
        "loss": gathered.tolist(),
        "w": nested["w"].tolist(),
        "parts": nested["parts"][0].tolist(),
        "loss_in_nest": nested["parts"][1][0].tolist(),
        "predictions": sorted(torch.cat(predictions).flatten().tolist()),
        "grad": weight.grad.tolist(),
    }


def test_gather_takes_tensors_that_require_grad_and_returns_them_detached(launch):
    for result in launch(_gather_tensors_requiring_grad):
        assert not any(result["requires_grad"])
        assert result["loss"] == [4.0, 8.0]
        assert result["w"] == [1.0, 1.0, 2.0, 2.0]
        assert result["parts"] == [10.0, 10.0, 20.0, 20.0]
        assert result["loss_in_nest"] == [4.0, 8.0]
        assert result["predictions"] == [0.0, 1.0, 2.0, 3.0, 4.0]  # each sample once, padding dropped
        assert result["grad"] == [2.0, 2.0]


def _reductions():
    accelerator = Accelerator()
    rank = accelerator.process_index
    values = torch.tensor([float(rank), 10.0 - rank])  # [0, 10] on rank 0, [1, 9] on rank 1
    results = {name: engine_utils.reduce(values, reduction=name).tolist() for name in ("sum", "max", "min", "none")}
    results["utils_default"] = engine_utils.reduce(values).tolist()
    results["accelerator_default"] = accelerator.reduce(values).tolist()
    results["accelerator_max"] = accelerator.reduce({"v": [values]}, reduction="max")["v"][0].tolist()
    results["scaled_mean"] = engine_utils.reduce(values, reduction="mean", scale=2.0).tolist()
    results["untouched"] = values.tolist()
    try:
        accelerator.reduce(values, reduction="avg")
    except ValueError as error:
        results["error"] = str(error)
    results["after_error"] = accelerator.reduce(values, reduction="min").tolist()  # no rank was left mid-collective
    return results


@pytest.mark.parametrize("nproc", [1, 2])
def test_reductions_on_one_and_two_processes(launch, nproc):
    for rank, result in enumerate(launch(_reductions, nproc=nproc)):
        if nproc == 1:
            expected = {"sum": [0.0, 10.0], "max": [0.0, 10.0], "min": [0.0, 10.0], "mean": [0.0, 10.0]}
        else:
            expected = {"sum": [1.0, 19.0], "max": [1.0, 10.0], "min": [0.0, 9.0], "mean": [0.5, 9.5]}
        assert result["sum"] == result["accelerator_default"] == expected["sum"]
        assert result["utils_default"] == expected["mean"]
        assert result["max"] == result["accelerator_max"] == expected["max"]
        assert result["min"] == result["after_error"] == expected["min"]
        assert result["scaled_mean"] == [2 * v for v in expected["mean"]]
        assert result["none"] == result["untouched"] == [float(rank), 10.0 - rank]
        assert result["error"] == "reduction='avg' is not supported; use one of 'mean', 'sum', 'max', 'min', 'none'."
