"""Declared datasets: each class's prepare_data runs once per arguments, and its errors name the key."""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import runner.data
from runner.config import ConfigError
from runner.data import prepare_datasets
from tests.shared_data import MNIST

CALLS = []


class Recorded:
    """A dataset class whose prepare_data notes each call."""

    def __init__(self, size: int, tag: str = "") -> None:
        self.size = size

    @classmethod
    def prepare_data(cls, size: int, tag: str = "") -> None:
        if size < 0:
            raise ValueError("size must be at least 0.")
        CALLS.append((size, tag))


def data(train: dict, evaluation: dict | None = None):
    return OmegaConf.create({"data": {"train": train, "eval": evaluation, "root": "/r"}}).data


def test_prepare_data_gets_the_resolved_arguments_once_per_distinct_call():
    CALLS.clear()
    node = {"_target_": f"{__name__}.Recorded", "size": 3, "tag": "${data.root}"}
    prepare_datasets(data(node, {**node, "size": 4}))
    prepare_datasets(data(node, {**node, "size": 4}))  # the run after the command-line check: nothing again
    assert CALLS == [(3, "/r"), (4, "/r")]
    prepare_datasets(data({"_target_": "torch.utils.data.TensorDataset"}))  # no prepare_data: nothing to call


def test_a_value_prepare_data_rejects_names_the_key_and_the_class():
    with pytest.raises(ConfigError) as error:
        prepare_datasets(data({"_target_": f"{__name__}.Recorded", "size": 1}, {"_target_": f"{__name__}.Recorded",
                                                                                 "size": -1}))  # fmt: skip
    assert str(error.value) == "data.eval: Recorded(size=-1) failed: size must be at least 0."


def test_mnist_prepare_data_checks_the_split_and_the_files(tmp_path):
    with pytest.raises(ValueError, match="MNIST has no split 'validation'"):
        runner.data.MNIST.prepare_data(tmp_path, split="validation")
    with pytest.raises(FileNotFoundError) as error:
        runner.data.MNIST.prepare_data(tmp_path, split="test[:10]")
    assert str(error.value) == (
        f"MNIST files t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz are not in {tmp_path}; set data.root to the "
        "folder that holds them, or data.download=true to fetch them."
    )
    if MNIST.is_dir():
        runner.data.MNIST.prepare_data(MNIST, split="test[:10]")  # there: nothing to do


def test_the_package_still_imports_without_torch():
    code = "import runner.data, sys; assert 'torch' not in sys.modules; print(sorted(runner.data._LAZY))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(["CharCorpus", "MNIST", "Mixture", "Packed", "Split", "causal_lm_blocks",
                                         "stream_slice"])  # fmt: skip
