"""``runner env``: what a bug report needs about this machine and its launch config, as ``accelerate env`` prints.

Package versions come from their installed metadata (nothing but torch is imported: CUDA and cuDNN
are torch's to say).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

from runner.launch.flags import build_parser, parse_settings_flags
from runner.launch.settings import LaunchError, config_file_path, read_config_file

PACKAGES = ("hydra-core", "omegaconf", "safetensors", "tensorboard", "torchmetrics", "transformers", "datasets",
            "torchvision")  # fmt: skip
# Variables that change what a launch or an Accelerator does, shown when set.
VARIABLES = ("CUDA_VISIBLE_DEVICES", "RUNNER_CONFIG_FILE", "RUNNER_MIXED_PRECISION", "RUNNER_USE_CPU",
             "OMP_NUM_THREADS", "NCCL_DEBUG", "TORCH_DISTRIBUTED_DEBUG")  # fmt: skip


def main(argv: list[str]) -> int:
    """``runner env [--config_file F]``: print the report; returns the exit code."""
    namespace, _ = parse_settings_flags(build_parser("env"), argv)
    print("Copy and paste the text below into your bug report.\n")
    print(environment_report(namespace.config_file))
    return 0


def environment_report(config_file: str | None = None) -> str:
    """``- name: value`` lines, then the launch config in use (``config_file``, else the default file)."""
    import torch

    import runner

    cuda = torch.cuda.is_available()
    gpus = [torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())] if cuda else []
    cudnn = torch.backends.cudnn.is_available()
    lines = {
        "runner version": runner.__version__,
        "Python version": f"{platform.python_version()} ({sys.executable})",
        "Platform": platform.platform(),
        "CPUs": str(os.cpu_count()),
        "Memory": _memory(),
        "torch version": f"{torch.__version__} ({_build(torch.version.cuda)})",
        "CUDA available": str(cuda),
        "GPUs": f"{len(gpus)}" + (f": {', '.join(gpus)}" if gpus else ""),
        "cuDNN": f"{torch.backends.cudnn.version()}" if cudnn else "not available",
        "Packages": ", ".join(f"{name} {_version(name)}" for name in PACKAGES),
        "Environment": ", ".join(f"{name}={os.environ[name]}" for name in VARIABLES if name in os.environ) or "-",
    }
    return "\n".join(f"- {name}: {value}" for name, value in lines.items()) + "\n" + _launch_config(config_file)


def _build(cuda: str | None) -> str:
    return f"built for CUDA {cuda}" if cuda else "CPU-only build of torch"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _memory() -> str:
    try:
        return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    except (AttributeError, ValueError, OSError):
        return "unknown"


def _launch_config(named: str | None) -> str:
    path = config_file_path(named)
    if not path.is_file():
        return f"- Launch config: none (no file at {path}; `runner config` writes one)"
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        read_config_file(path)
        verdict = ""
    except OSError as error:
        return f"- Launch config: {path} (cannot be read: {error.strerror or error})"
    except LaunchError as error:
        verdict = f" (runner launch refuses it: {error})"
    body = "".join(f"    {line}\n" for line in text.splitlines() if line.strip() and not line.startswith("#"))
    return f"- Launch config: {path}{verdict}\n{body}".rstrip("\n")
