"""The is_*_available probes: right answers, and no import of the packages they ask about."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from runner.engine import utils
from runner.engine.imports import _is_package_available

PACKAGE_PROBES = {
    "is_datasets_available": "datasets",
    "is_deepspeed_available": "deepspeed",
    "is_torchvision_available": "torchvision",
    "is_transformers_available": "transformers",
    "is_wandb_available": "wandb",
    "is_mlflow_available": "mlflow",
    "is_schedulefree_available": "schedulefree",
    "is_pytest_available": "pytest",
    "is_hpu_available": "habana_frameworks",
}


@pytest.mark.parametrize(("probe", "module"), sorted(PACKAGE_PROBES.items()))
def test_package_probes_answer_whether_the_module_is_installed(probe, module):
    assert getattr(utils, probe)() is (importlib.util.find_spec(module) is not None)


def test_tensorboard_probe_accepts_either_package():
    expected = any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))
    assert utils.is_tensorboard_available() is expected


def test_a_folder_named_like_a_package_is_not_the_package(tmp_path, monkeypatch):
    (tmp_path / "runner_fake_pkg").mkdir()
    (tmp_path / "runner_fake_pkg" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importlib.util.find_spec("runner_fake_pkg") is not None
    assert not _is_package_available("runner_fake_pkg")


def test_probing_imports_none_of_the_heavy_packages():
    heavy = ["transformers", "datasets", "torchvision", "tensorboard", "wandb", "deepspeed", "torch_xla"]
    code = (
        "import sys; from runner.engine import utils\n"
        "for name in dir(utils):\n"
        "    if name.startswith('is_') and name.endswith('_available'): getattr(utils, name)()\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_device_probes_agree_with_torch():
    assert utils.is_cuda_available() is torch.cuda.is_available()
    assert utils.is_mps_available() is torch.backends.mps.is_available()
    assert utils.is_mps_available(min_version="999.0") is False
    assert utils.is_npu_available() is (importlib.util.find_spec("torch_npu") is not None and torch.npu.is_available())
    if not torch.cuda.is_available() and not torch.backends.mps.is_available() and not utils.is_xpu_available():
        assert utils.is_bf16_available()  # the CPU computes in bfloat16


def test_torch_xla_probe_can_be_switched_off_and_refuses_two_device_checks(monkeypatch):
    monkeypatch.setenv("USE_TORCH_XLA", "0")
    assert utils.is_torch_xla_available() is False
    with pytest.raises(ValueError, match="not both"):
        utils.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)


def test_the_device_probes_answer_for_a_cpu_only_machine_as_accelerate():
    expected = (None, None) if not torch.accelerator.is_available() else (torch.accelerator.current_accelerator().type,)
    assert utils.get_torch_accelerator_backend()[: len(expected)] == expected
    assert utils.is_fp16_available() is True
