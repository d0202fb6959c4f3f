"""runner.data.Split: a named, sliced split of a dataset chosen by a ``train`` flag (torchvision's way)."""

import functools

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import runner.data
from runner.config import ConfigError
from runner.data import Split, prepare_datasets


class Digits(torch.utils.data.Dataset):
    """Stands in for torchvision's MNIST: ``train`` picks 6 items or 4, each item knows where it came from."""

    built = []

    def __init__(self, root: str, train: bool = True, offset: int = 0) -> None:
        Digits.built.append(train)
        self.items = [(("train" if train else "test"), offset + i) for i in range(6 if train else 4)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


def items(dataset) -> list:
    return [dataset[i] for i in range(len(dataset))]


@pytest.mark.parametrize(
    ("split", "expected"),
    [
        ("train", [("train", i) for i in range(6)]),
        ("test", [("test", i) for i in range(4)]),
        ("train[2:4]", [("train", 2), ("train", 3)]),
        ("test[-1:]", [("test", 3)]),
        ("train[:50%]", [("train", 0), ("train", 1), ("train", 2)]),
    ],
)
def test_the_split_name_chooses_the_flag_and_the_slice_the_items(split, expected):
    Digits.built.clear()
    subset = Split(dataset=functools.partial(Digits, root="r"), split=split)
    assert items(subset) == expected
    assert Digits.built == [split.startswith("train")]  # the dataset is built once
    assert subset.split == split


def test_a_yaml_node_with_a_partial_dataset_builds_the_split():
    node = OmegaConf.create(
        {
            "_target_": "runner.data.Split",
            "split": "test[1:3]",
            "dataset": {"_target_": f"{__name__}.Digits", "_partial_": True, "root": "r", "offset": 10},
        }
    )
    subset = instantiate(node)
    assert isinstance(subset, torch.utils.data.Subset)
    assert items(subset) == [("test", 11), ("test", 12)]
    assert runner.data.Split is Split and "Split" in runner.data.__all__


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ("valid", "Digits has no split 'valid' ('valid'); use 'train' or 'test' with an optional slice."),
        ("val[:10]", "Digits has no split 'val' ('val[:10]'); use 'train' or 'test' with an optional slice."),
        ("test[9:]", "Split 'test[9:]' selects none of the 4 items of Digits's test split; widen the slice."),
        ("test[:", "Split 'test[:' is not a split; write it like 'train', 'test[:8000]' or 'train[:10%]'."),
    ],
)
def test_a_split_that_is_not_there_says_what_to_write(split, message):
    Digits.built.clear()
    with pytest.raises(ValueError) as caught:
        Split(dataset=functools.partial(Digits, root="r"), split=split)
    assert str(caught.value) == message
    if "selects none" not in message:
        assert Digits.built == []  # refused before the dataset is built (nothing downloaded)


def test_a_dataset_built_already_says_to_make_its_node_partial():
    with pytest.raises(TypeError) as caught:
        Split(dataset=Digits(root="r"), split="train")
    assert str(caught.value) == (
        "dataset is a Digits already built, not a callable taking train=; add `_partial_: true` to its node."
    )


def test_prepare_data_builds_the_split_once_and_reports_the_same_errors():
    Digits.built.clear()
    assert Split.prepare_data(dataset=functools.partial(Digits, root="r"), split="test[:2]") is None
    assert Digits.built == [False]
    with pytest.raises(ValueError, match="selects none of the 6 items of Digits's train split"):
        Split.prepare_data(dataset=functools.partial(Digits, root="r"), split="train[6:]")


def test_the_launching_process_reports_an_empty_slice_naming_the_key():
    node = {"_target_": "runner.data.Split", "split": "${data.eval_split}"}
    node["dataset"] = {"_target_": f"{__name__}.Digits", "_partial_": True, "root": "r"}
    data = OmegaConf.create({"data": {"train": {**node, "split": "train"}, "eval": node, "eval_split": "test[7:]"}})
    with pytest.raises(ConfigError) as caught:
        prepare_datasets(data.data)
    assert str(caught.value) == (
        "data.eval: Split(split='test[7:]', dataset={...}) failed: Split 'test[7:]' selects none of the 4 items of "
        "Digits's test split; widen the slice."
    )
