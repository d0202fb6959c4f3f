"""Mixed precision: autocast around the model's forward, and loss scaling under fp16.

Master weights stay in fp32. bf16 needs no loss scaling; fp16 uses ``torch.amp.GradScaler``, which
torch supports on CPU as well as CUDA. fp16 works on the CPU but crawls there, so a Precision built
for fp16 on the CPU warns, once per process (:func:`warn_if_fp16_on_cpu`).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib.util
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MethodType
from typing import Any

import torch
from torch import nn


class PrecisionType(str, enum.Enum):
    """The values ``mixed_precision`` accepts (Accelerate's names)."""

    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"


@dataclass
class GradScalerKwargs:
    """Options for the fp16 loss scaler, passed to ``Accelerator(kwargs_handlers=[...])``."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class AutocastKwargs:
    """Options for autocast, passed to ``Accelerator(kwargs_handlers=[...])``."""

    enabled: bool = True
    cache_enabled: bool | None = None


_AUTOCAST_DTYPES = {
    PrecisionType.FP16: torch.float16,
    PrecisionType.BF16: torch.bfloat16,
    PrecisionType.FP8: torch.bfloat16,  # fp8 matmuls come from torchao; the rest runs in bf16
}


def parse_mixed_precision(value: str | None) -> PrecisionType:
    """Turn ``mixed_precision`` into a :class:`PrecisionType`, or say which values are valid."""
    if value is None:
        return PrecisionType.NO
    try:
        return PrecisionType(str(value).lower())
    except ValueError:
        valid = ", ".join(repr(p.value) for p in PrecisionType)
        raise ValueError(f"mixed_precision={value!r} is not supported; use one of {valid}.") from None


def check_fp8_support(device: torch.device) -> None:
    """Raise a one-sentence error unless this device and environment can train in fp8."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(
            "mixed_precision='fp8' needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); "
            f"this process runs on {device}; use 'bf16' instead."
        )
    if importlib.util.find_spec("torchao") is None:
        raise ValueError("mixed_precision='fp8' needs the torchao package (pip install torchao); or use 'bf16'.")


class Fp16OnCpuWarning(UserWarning):
    """Warns that ``mixed_precision='fp16'`` runs on the CPU, where it is far slower than fp32."""


FP16_ON_CPU_WARNING = (
    "mixed_precision='fp16' on the CPU runs torch's slow CPU fp16 kernels (convolution backward above all), "
    "about 40-100x slower than fp32 for a small CNN; use mixed_precision='bf16' or 'no' on the CPU, "
    "or train in fp16 on a GPU."
)


def warn_if_fp16_on_cpu(mode: PrecisionType, device: torch.device) -> None:
    """Warn, once per process, when fp16 autocast is to run on the CPU (it works, but crawls).

    Args:
        mode: The parsed ``mixed_precision``.
        device: The device the Accelerator runs on (``cuda``, ``mps``, ... never warn).

    Example:
        >>> warn_if_fp16_on_cpu(PrecisionType.FP16, torch.device("cpu"))  # Fp16OnCpuWarning, the first time
    """
    if mode is PrecisionType.FP16 and device.type == "cpu":
        _warn_fp16_on_cpu()


# Once per process, not per Accelerator: tests and notebooks build many. A cache rather than Python's
# per-location warning registry, which any warnings.catch_warnings() elsewhere resets.
@functools.cache
def _warn_fp16_on_cpu() -> None:
    # Frames above: warn_if_fp16_on_cpu, Precision.__init__, Accelerator.__init__, then its caller's line.
    warnings.warn(FP16_ON_CPU_WARNING, Fp16OnCpuWarning, stacklevel=5)


class Bf16OnCpuWarning(UserWarning):
    """Warns that ``mixed_precision='bf16'`` runs on a CPU without bf16 instructions, where it is slower than fp32."""


BF16_ON_CPU_WARNING = (
    "mixed_precision='bf16' on a CPU without bf16 instructions (its flags have neither avx512_bf16 nor amx_bf16) "
    "emulates bf16 and runs several times slower than fp32 (4x for the GPT preset on an AVX2 CPU); use "
    "mixed_precision='no' on this CPU, or bf16 on a GPU or a CPU that has them."
)
# The CPU flags that mean native bf16 arithmetic: x86's AVX512-BF16 and AMX, Arm's BF16 (FEAT_BF16).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_bf16(cpuinfo: str | None = None) -> bool | None:
    """Whether this CPU has bf16 instructions, from the flags of ``/proc/cpuinfo`` (or ``cpuinfo``, its text);
    None where there is no such file to read (macOS, Windows: nothing is claimed).

    Example:
        >>> cpu_has_bf16("flags : fpu avx2 fma")
        False
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = set()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):  # x86, Arm
            flags.update(value.split())
    return bool(flags & BF16_CPU_FLAGS) if flags else None


def warn_if_bf16_is_emulated(mode: PrecisionType, device: torch.device) -> None:
    """Warn, once per process, when bf16 autocast is to run on a CPU without bf16 instructions (it works, slowly)."""
    if mode is PrecisionType.BF16 and device.type == "cpu" and cpu_has_bf16() is False:
        _warn_bf16_on_cpu()


@functools.cache
def _warn_bf16_on_cpu() -> None:
    # Frames above: warn_if_bf16_is_emulated, Precision.__init__, Accelerator.__init__, then its caller's line.
    warnings.warn(BF16_ON_CPU_WARNING, Bf16OnCpuWarning, stacklevel=5)


def _to_fp32(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float() if output.dtype in (torch.float16, torch.bfloat16) else output
    if isinstance(output, dict):
        return type(output)((k, _to_fp32(v)) for k, v in output.items())
    if isinstance(output, tuple) and hasattr(output, "_fields"):
        return type(output)(*(_to_fp32(v) for v in output))
    if isinstance(output, (list, tuple)):
        return type(output)(_to_fp32(v) for v in output)
    return output


class Precision:
    """The precision policy of one Accelerator: its autocast settings and, under fp16, its scaler."""

    def __init__(
        self,
        mode: PrecisionType,
        device: torch.device,
        *,
        scaler_kwargs: GradScalerKwargs | None = None,
        autocast_kwargs: AutocastKwargs | None = None,
    ) -> None:
        if mode is PrecisionType.FP8:
            check_fp8_support(device)
        warn_if_fp16_on_cpu(mode, device)
        warn_if_bf16_is_emulated(mode, device)
        self.mode = mode
        self.device_type = device.type
        self.dtype = _AUTOCAST_DTYPES.get(mode)
        autocast_kwargs = autocast_kwargs or AutocastKwargs()
        self._autocast_enabled = autocast_kwargs.enabled and self.dtype is not None
        self._cache_enabled = autocast_kwargs.cache_enabled
        self.scaler: torch.amp.GradScaler | None = None
        if mode is PrecisionType.FP16:
            self.scaler = torch.amp.GradScaler(device.type, **asdict(scaler_kwargs or GradScalerKwargs()))

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """A fresh autocast context for this policy (a no-op context under ``no``)."""
        if not (enabled and self._autocast_enabled):
            return contextlib.nullcontext()
        kwargs = {} if self._cache_enabled is None else {"cache_enabled": self._cache_enabled}
        return torch.autocast(self.device_type, dtype=self.dtype, **kwargs)

    def apply(self, model: nn.Module) -> nn.Module:
        """Check fp32 master weights under fp16, convert for fp8 where asked, run the forward under autocast.

        The forward is replaced on the instance by a bound method, so ``copy.deepcopy`` of the model
        (EMA copies, for one) rebinds it to the copy. Half-precision outputs come back as fp32, so
        losses computed outside the model are computed in full precision.
        """
        if self.mode is PrecisionType.FP16:
            half = [name for name, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
            if half:
                raise ValueError(
                    f"mixed_precision='fp16' keeps fp32 master weights, but parameter {half[0]!r} is already fp16 "
                    "(the loss scaler would fail with 'Attempting to unscale FP16 gradients'); build the model in "
                    "fp32 (autocast runs it in fp16), or use mixed_precision='bf16'."
                )
        if self.mode is PrecisionType.FP8:
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model)
        if not self._autocast_enabled or getattr(model.forward, "_autocast_wrapped", False):
            return model
        forward = model.forward.__func__ if isinstance(model.forward, MethodType) else type(model).forward
        autocast = self.autocast

        @functools.wraps(forward)
        def autocast_forward(self_model, *args, **kwargs):
            with autocast():
                output = forward(self_model, *args, **kwargs)
            return _to_fp32(output)

        autocast_forward._autocast_wrapped = True
        autocast_forward._instance_forward = model.__dict__.get("forward")
        model.forward = MethodType(autocast_forward, model)
        return model


def remove_autocast(model: nn.Module) -> nn.Module:
    """Undo :meth:`Precision.apply`'s forward wrapper (used by ``unwrap_model(keep_fp32_wrapper=False)``)."""
    wrapped = model.__dict__.get("forward")
    if getattr(wrapped, "_autocast_wrapped", False):
        del model.forward
        if wrapped._instance_forward is not None:
            model.forward = wrapped._instance_forward
    return model
