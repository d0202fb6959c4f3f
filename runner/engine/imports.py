"""Accelerate's ``is_*_available`` probes, answered without importing the packages they ask about.

A package probe looks for the module (``importlib.util.find_spec``) and its installed distribution
(a stray folder of that name on ``sys.path`` is not the library), so asking never costs an import.
Device probes ask torch, which is imported anyway; only the XLA and NPU probes that must look at a
device import their plugin, as Accelerate's do.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch
from torch.torch_version import TorchVersion

from runner.engine.environment import patch_environment


def _is_package_available(module: str, distribution: str | None = None) -> bool:
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.metadata.distribution(distribution or module)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def is_tensorboard_available() -> bool:
    """Whether ``tensorboard`` or ``tensorboardX`` is installed."""
    return _is_package_available("tensorboard") or _is_package_available("tensorboardX")


def is_wandb_available() -> bool:
    return _is_package_available("wandb")


def is_mlflow_available() -> bool:
    return _is_package_available("mlflow")


def is_torchvision_available() -> bool:
    return _is_package_available("torchvision")


def is_transformers_available() -> bool:
    return _is_package_available("transformers")


def is_datasets_available() -> bool:
    return _is_package_available("datasets")


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (the engine has no DeepSpeed plugin; see docs/engine.md)."""
    return _is_package_available("deepspeed")


def is_schedulefree_available() -> bool:
    """Whether Meta's ``schedulefree`` optimizers are installed (see ``AcceleratedOptimizer.train``)."""
    return _is_package_available("schedulefree")


def is_torch_xla_available(check_is_tpu: bool = False, check_is_gpu: bool = False) -> bool:
    """Whether ``torch_xla`` is installed (and, if asked, drives a TPU or a GPU). ``USE_TORCH_XLA=0`` says no.

    Raises:
        ValueError: Both ``check_is_tpu`` and ``check_is_gpu`` are set.
    """
    if check_is_tpu and check_is_gpu:
        raise ValueError("is_torch_xla_available: set check_is_tpu or check_is_gpu, not both.")
    if os.environ.get("USE_TORCH_XLA", "1").lower() in ("0", "false", "no", "off"):
        return False
    if importlib.util.find_spec("torch_xla") is None:
        return False
    if not (check_is_tpu or check_is_gpu):
        return True
    try:  # the device type is known only to the runtime, so this one question imports it
        import torch_xla.runtime
    except ImportError:
        return False
    device_type = torch_xla.runtime.device_type()
    return device_type == "TPU" if check_is_tpu else device_type in ("GPU", "CUDA")


def is_cuda_available() -> bool:
    """Whether a CUDA device is usable, asked through NVML so the CUDA driver stays uninitialised (fork stays safe)."""
    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):
        return torch.cuda.is_available()


def is_mps_available(min_version: str = "1.12") -> bool:
    """Whether Apple's MPS backend is built and usable, with torch at least ``min_version``."""
    return TorchVersion(torch.__version__) >= min_version and torch.backends.mps.is_available()


def is_xpu_available(check_device: bool = False) -> bool:
    """Whether torch's own XPU backend (torch > 2.6) sees an Intel GPU."""
    if TorchVersion(torch.__version__.split("+")[0]) <= "2.6" or not hasattr(torch, "xpu"):
        return False
    try:
        if check_device:
            torch.xpu.device_count()  # raises RuntimeError where no XPU is present
        return torch.xpu.is_available()
    except RuntimeError:
        return False


def is_npu_available(check_device: bool = False) -> bool:
    """Whether ``torch_npu`` is installed and imports, and sees an Ascend NPU."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:  # torch.npu exists only once torch_npu is imported; it fails to import on some CPU-only hosts
        import torch_npu  # noqa: F401
    except Exception:
        return False
    try:
        if check_device:
            torch.npu.device_count()
        return torch.npu.is_available()
    except RuntimeError:
        return False


def is_bf16_available(ignore_tpu: bool = False) -> bool:
    """Whether this machine's accelerator computes in bfloat16 (the CPU always can).

    Args:
        ignore_tpu: Answer False on a TPU (as Accelerate's probe does).
    """
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_pytest_available() -> bool:
    return _is_package_available("pytest")


def is_hpu_available() -> bool:
    """Whether Habana's ``habana_frameworks.torch`` is installed (Gaudi); this engine runs nothing on it."""
    return importlib.util.find_spec("habana_frameworks") is not None and (
        importlib.util.find_spec("habana_frameworks.torch") is not None
    )


def is_fp16_available() -> bool:
    """Whether fp16 can be used: wherever torch runs (slowly on the CPU, see ``Fp16OnCpuWarning``)."""
    return True


def get_torch_accelerator_backend(check_available: bool = True) -> tuple[str | None, object | None]:
    """The accelerator torch sees and its module (``("cuda", torch.cuda)``), or ``(None, None)`` on a CPU-only
    machine (Accelerate's probe); ``check_available=False`` names it without asking whether a device is usable."""
    device = (
        torch.accelerator.current_accelerator() if torch.accelerator.is_available() or not check_available else None
    )
    if device is None:
        return None, None
    native = device.type in {"cuda", "mps", "xpu", "npu", "hpu"}
    return device.type, torch.get_device_module(device.type) if native else torch.accelerator
