"""On one process gather and reduce behave as Accelerate 1.x's: gather detaches, reduce keeps its defaults."""

import inspect
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator, ops
from runner.engine import utils as engine_utils

Pair = namedtuple("Pair", "first second")


def _loss_requiring_grad():
    weight = torch.ones(3, requires_grad=True)
    return (weight * 2).sum()


def test_gather_returns_a_detached_copy_of_a_loss_that_requires_grad():
    accelerator = Accelerator()
    loss = _loss_requiring_grad()
    for gathered in (ops.gather(loss), accelerator.gather(loss), engine_utils.gather(loss)):
        assert not gathered.requires_grad
        assert gathered.item() == 6.0
    assert loss.requires_grad and loss.grad_fn is not None  # the caller's loss can still go backward


def test_gather_detaches_every_tensor_of_a_nest_and_keeps_its_structure():
    weight = torch.ones(2, requires_grad=True)
    nest = {"loss": weight.sum(), "parts": [weight * 3, (weight + 1,)], "pair": Pair(weight, "label")}
    gathered = ops.gather(nest)
    assert type(gathered["pair"]) is Pair and gathered["pair"].second == "label"
    assert isinstance(gathered["parts"], list) and isinstance(gathered["parts"][1], tuple)
    tensors = [gathered["loss"], gathered["parts"][0], gathered["parts"][1][0], gathered["pair"].first]
    assert [t.requires_grad for t in tensors] == [False] * 4
    assert [t.tolist() for t in tensors] == [2.0, [3.0, 3.0], [2.0, 2.0], [1.0, 1.0]]


def test_gather_for_metrics_takes_predictions_that_require_grad():
    accelerator = Accelerator()
    linear = torch.nn.Linear(1, 1)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(5.0)[:, None]), batch_size=2))
    outputs = [accelerator.gather_for_metrics(linear(batch)) for (batch,) in loader]
    assert all(not output.requires_grad for output in outputs)
    assert [len(output) for output in outputs] == [2, 2, 1]


def test_reduce_defaults_mean_in_utils_and_sum_on_the_accelerator():
    assert inspect.signature(engine_utils.reduce).parameters["reduction"].default == "mean"
    assert inspect.signature(ops.reduce).parameters["reduction"].default == "mean"
    assert inspect.signature(Accelerator.reduce).parameters["reduction"].default == "sum"


@pytest.mark.parametrize("reduction", ["mean", "sum", "max", "min", "none"])
def test_reduce_on_one_process_returns_a_copy(reduction):
    tensor = torch.tensor([1.0, -2.0])
    reduced = engine_utils.reduce(tensor, reduction=reduction)
    assert reduced.tolist() == [1.0, -2.0] and reduced is not tensor
    reduced.add_(1)
    assert tensor.tolist() == [1.0, -2.0]  # a new tensor, as all_reduce would give
    assert Accelerator().reduce({"a": [tensor]}, reduction=reduction, scale=2.0)["a"][0].tolist() == [2.0, -4.0]


def test_reduce_rejects_an_unknown_reduction_naming_the_valid_ones():
    with pytest.raises(ValueError) as error:
        engine_utils.reduce(torch.ones(1), reduction="avg")
    assert str(error.value) == "reduction='avg' is not supported; use one of 'mean', 'sum', 'max', 'min', 'none'."
    with pytest.raises(ValueError, match="'max', 'min'"):
        Accelerator().reduce(torch.ones(1), reduction="product")
