"""Repeatable CPU math: oneMKL's vector-math kernels resolved before any two threads first call one at once.

torch sends a contiguous float tensor's ``exp``, ``tanh``, ``sqrt``, ``log``, ``erf``, ... to oneMKL's VML, each
intra-op thread its own chunk. oneMKL picks each VML function's kernel on its first call; when that first call
runs on several threads at once (a fresh process's first op big enough to split, under a busy CPU), one thread
may run a low-accuracy kernel for its whole chunk of that one call (pytorch/pytorch#188792, oneMKL 2024.2, the
version torch's wheels carry). The run goes on from values off by up to hundreds of ulp, so two identical runs
differ: the runner's own resume test saw it (bench/RESULTS.md), once in some dozens of runs. Calling each of
those functions once on one element, on one thread, settles the choice before training starts; it costs about
a millisecond and changes no result of a process where the race did not strike.
"""

from __future__ import annotations

import torch

# The functions torch routes to VML (aten/src/ATen/cpu/vml.h), as torch calls them.
VML_FUNCTIONS = (
    "abs", "acos", "asin", "atan", "cos", "cosh", "erf", "erfc", "erfinv", "exp", "expm1", "lgamma", "log",
    "log10", "log1p", "log2", "sin", "sinh", "sqrt", "tan", "tanh", "trunc",
)  # fmt: skip
_resolved = False


def resolve_math_kernels() -> None:
    """Call every VML function once, on one element of float32 and of float64 (once per process)."""
    global _resolved
    if _resolved or not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        one = torch.full((1,), 0.5, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(one)
    _resolved = True
