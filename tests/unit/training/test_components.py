"""How a batch meets the model and the loss, and how a rejected constructor value reads."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.config import ConfigError
from runner.training.components import (
    BatchError,
    batch_size,
    build,
    build_loaders,
    compute_loss,
    forward,
    labels,
    predictions,
    split_batch,
)
from runner.training.loop import build_optimizer


class Echo(nn.Module):
    """Returns what it was called with, to see how a batch was spread over the arguments."""

    def forward(self, *args, **kwargs):
        return args, kwargs


def test_pairs_and_dicts_split_into_inputs_and_targets():
    x, y = torch.zeros(4, 2), torch.arange(4)
    assert split_batch((x, y), model_loss=False) == (x, y)
    assert split_batch([x, y], model_loss=True) == (x, y)
    batch = {"features": x, "labels": y}
    inputs, targets = split_batch(batch, model_loss=False)
    assert list(inputs) == ["features"] and targets is y  # labels are the loss's targets, not the model's input
    assert split_batch(batch, model_loss=True) == (batch, None)  # the model gets its labels and computes its loss


@pytest.mark.parametrize(
    ("batch", "model_loss", "sentence"),
    [
        (
            (torch.zeros(2), torch.zeros(2), torch.zeros(2)),
            False,
            "A batch arrived as a tuple of 3 (Tensor, Tensor, Tensor); the recipe expects (inputs, targets) or a dict "
            "of tensors (model(**batch)); return one of those from the dataset's __getitem__ or from data.collate_fn.",
        ),
        (
            torch.zeros(4, 3),
            False,
            "A batch arrived as a tensor of shape (4, 3); the recipe expects (inputs, targets)",
        ),
        (
            {"features": torch.zeros(2)},
            False,
            "A dict batch (keys features) needs a 'labels' entry for the loss node to compare against; add it in the "
            "dataset or collate_fn, or set loss=model if the model computes its own loss.",
        ),
    ],
)
def test_a_batch_of_another_shape_is_one_sentence(batch, model_loss, sentence):
    with pytest.raises(BatchError) as error:
        split_batch(batch, model_loss=model_loss)
    assert str(error.value).startswith(sentence) and "\n" not in str(error.value)


def test_forward_spreads_inputs_as_the_batch_holds_them():
    model, x, y = Echo(), torch.ones(2), torch.zeros(2)
    assert forward(model, x) == ((x,), {})
    assert forward(model, (x, y)) == ((x, y), {})
    assert forward(model, {"a": x}) == ((), {"a": x})
    assert forward(model, x, y, model_loss=True) == ((x, y), {})  # a model that computes its own loss gets targets


def test_the_loss_a_model_returns_is_found_in_each_documented_place():
    loss = torch.tensor(0.5)

    class Output:
        def __init__(self):
            self.loss, self.logits = loss, torch.zeros(2, 3)

    assert compute_loss(None, Output(), None) is loss
    assert compute_loss(None, {"loss": loss, "logits": torch.zeros(2)}, None) is loss
    assert compute_loss(None, loss, None) is loss
    assert compute_loss(nn.MSELoss(), torch.ones(3), torch.zeros(3)).item() == 1.0
    ending = r"but it returned a tensor of shape \(2, 3\); return the loss, or declare a loss node\.$"
    with pytest.raises(BatchError, match=r"^With loss=model the model must return its loss .* " + ending):
        compute_loss(None, torch.zeros(2, 3), None)
    assert predictions(Output()).shape == (2, 3) and predictions({"logits": torch.ones(1)}).tolist() == [1.0]
    with pytest.raises(BatchError, match="metrics need a tensor or outputs with 'logits'"):
        predictions({"loss": loss})
    assert batch_size({"mask": torch.tensor(1), "ids": torch.zeros(5, 2)}) == 5 and batch_size((torch.zeros(3),)) == 3


def test_a_constructor_that_rejects_a_value_names_the_key():
    with pytest.raises(ConfigError) as error:
        build(OmegaConf.create({"_target_": "torch.nn.Dropout", "p": 2.0}), key="model")
    assert str(error.value) == (
        "model: Dropout(p=2.0) failed: dropout probability has to be between 0 and 1, but got 2.0; "
        "fix the model.* keys."
    )
    node = OmegaConf.create({"_target_": "torch.optim.SGD", "_partial_": True, "lr": -1.0})
    with pytest.raises(ConfigError) as error:
        build_optimizer(node, nn.Linear(2, 2).parameters())
    assert str(error.value) == (
        "optimizer: SGD(lr=-1.0) failed: Invalid learning rate: -1.0; fix the optimizer.* keys."
    )


def test_a_bug_inside_the_users_constructor_keeps_its_own_error():
    with pytest.raises(ZeroDivisionError):
        build(OmegaConf.create({"_target_": "operator.truediv", "_args_": [1, 0]}), key="model")


def test_loaders_take_every_declared_option():
    data = OmegaConf.create({
        "batch_size": 4, "eval_batch_size": 3, "num_workers": 0, "shuffle": True, "drop_last": True,
        "pin_memory": False, "persistent_workers": False,
        "collate_fn": {"_target_": "torch.utils.data.default_collate", "_partial_": True},
    })  # fmt: skip
    samples = [(torch.tensor([float(i)]), torch.tensor(i)) for i in range(10)]
    train, evaluation = build_loaders(data, seed=3, datasets=(samples, samples[:5]))
    assert (train.batch_size, train.drop_last, len(train)) == (4, True, 2)
    assert [len(batch[0]) for batch in evaluation] == [3, 2]  # never dropped, never shuffled
    again, _ = build_loaders(data, seed=3, datasets=(samples, None))
    assert [b[1].tolist() for b in train] == [b[1].tolist() for b in again]  # the shuffle follows the seed
    assert build_loaders(data, seed=3, datasets=(samples, None))[1] is None


def test_metrics_compare_with_the_targets_or_a_dict_batchs_labels():
    y = torch.arange(3)
    assert labels(torch.zeros(3), y) is y and labels({"features": torch.zeros(3), "labels": y}, None) is y
    with pytest.raises(BatchError) as error:
        labels({"features": torch.zeros(3)}, None)
    assert str(error.value) == (
        "The metrics compare outputs with targets, but the dict batch (keys features) has no 'labels' entry; add it "
        "in the dataset or collate_fn, or declare no metrics."
    )


def test_a_nested_node_that_fails_is_named_itself():
    node = OmegaConf.create({"loss": {"_target_": "torch.nn.CrossEntropyLoss",
                                      "weight": {"_target_": "torch.ones", "_args_": [-1]}}})  # fmt: skip
    with pytest.raises(ConfigError) as error:
        build(node.loss, key="loss")
    assert str(error.value) == (
        "loss.weight: ones(-1) failed: Trying to create tensor with negative dimension -1: [-1]; fix the loss.weight.* "
        "keys."
    )
