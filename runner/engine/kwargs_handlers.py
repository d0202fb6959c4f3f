"""Accelerate's ``kwargs_handlers``: which dataclass configures which part of an Accelerator."""

from __future__ import annotations

from typing import Any

from runner.engine.distributed import InitProcessGroupKwargs
from runner.engine.parallel import DistributedDataParallelKwargs
from runner.engine.precision import AutocastKwargs, GradScalerKwargs
from runner.engine.profiling import ProfileKwargs

KWARGS_HANDLERS = (
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    AutocastKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
)


def sort_kwargs_handlers(handlers: list | None) -> dict[type, Any]:
    """``Accelerator(kwargs_handlers=...)`` by class.

    Raises:
        ValueError: A handler of another class, or two of one class.
    """
    found: dict[type, Any] = {}
    for handler in handlers or []:
        kind = next((k for k in KWARGS_HANDLERS if isinstance(handler, k)), None)
        if kind is None:
            raise ValueError(
                f"kwargs_handlers got {type(handler).__name__}; pass DistributedDataParallelKwargs, "
                "GradScalerKwargs, AutocastKwargs, InitProcessGroupKwargs or ProfileKwargs."
            )
        if kind in found:
            raise ValueError(f"kwargs_handlers holds two {kind.__name__}; pass one.")
        found[kind] = handler
    return found
