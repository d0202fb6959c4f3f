"""Find the largest batch size that fits: retry on out-of-memory errors with a smaller one."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

import torch

_OOM_MESSAGES = (
    "CUDA out of memory.",  # torch.OutOfMemoryError's text, also when re-raised as a RuntimeError
    "CUDA error: out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  # cuDNN's answer to a batch too large for its kernels
    "CUBLAS_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",
    "MPS backend out of memory",
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` says the batch did not fit in memory (GPU, CPU or MPS)."""
    if isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exception, RuntimeError) and any(message in str(exception) for message in _OOM_MESSAGES)


def release_memory() -> None:
    """Collect garbage and return cached GPU memory to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def find_executable_batch_size(
    function: Callable[..., Any] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[int], int] | None = None,
) -> Callable[..., Any]:
    """Call ``function(batch_size, ...)``, retrying with a smaller batch size while it runs out of memory.

    Decorate a function whose first parameter is the batch size, and call it without that
    argument. After an out-of-memory error (see :func:`should_reduce_batch_size`), memory is
    released and the batch size becomes 90% of what it was (or ``reduce_batch_size_fn(batch_size)``);
    any other error propagates. Build the model, optimizer and loaders inside the function so a
    failed attempt leaves nothing behind.

    Each process searches on its own: in a distributed run, pick the batch size in one process
    first, or make every rank fail alike.

    Raises:
        RuntimeError: When the batch size reaches zero.
        TypeError: When the caller passes the batch size too.
    """
    if function is None:
        return functools.partial(
            find_executable_batch_size,
            starting_batch_size=starting_batch_size,
            reduce_batch_size_fn=reduce_batch_size_fn,
        )
    reduce = reduce_batch_size_fn or (lambda size: int(size * 0.9))
    parameters = list(inspect.signature(function).parameters)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        if len(args) + 1 > len(parameters) or parameters[0] in kwargs:
            raise TypeError(
                f"{function.__name__}() got its batch size from the caller, but find_executable_batch_size "
                f"passes it as the first argument; call {function.__name__}({', '.join(parameters[1:])}) without it."
            )
        batch_size = starting_batch_size
        release_memory()
        while batch_size > 0:
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:
                if not should_reduce_batch_size(error):
                    raise
            release_memory()  # outside the except block: the traceback's frames (and tensors) are gone
            batch_size = reduce(batch_size)
        raise RuntimeError(
            f"{function.__name__}() ran out of memory at every batch size down to 1; shrink the model or the "
            "inputs, or free the memory something else holds."
        )

    return run
