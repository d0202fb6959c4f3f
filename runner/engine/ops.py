"""Collectives and device moves on tensors and nested lists/tuples/dicts of tensors.

Every function works in a single process too (it then returns its input, or a copy where the
distributed version would return a new tensor). In a process group each one is a collective: every
rank must call it, in the same order, or the job hangs.

Debug mode (Accelerate's): with ``ACCELERATE_DEBUG_MODE`` or ``RUNNER_DEBUG_MODE`` set to 1, true or
yes, :func:`gather` (and so ``gather_for_metrics``), :func:`reduce`, :func:`broadcast` and
:func:`pad_across_processes` first exchange the shapes of their tensors in one small object
all-gather. Where they cannot work together (different shapes; for padding, different numbers of
dimensions) every rank raises the same :class:`DistributedOperationException`, naming the operation
and each process's shapes, instead of hanging in the collective until the timeout. Without it they
add no collective; the environment is read on each call, so it can be switched on mid-run, as can
``PartialState().debug = True`` (:func:`set_debug_mode`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from runner.engine.constants import ACCELERATE_DEBUG_MODE_ENV, DEBUG_MODE_ENV

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older releases only have it.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _world_size(group: Any = None) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


class DistributedOperationException(Exception):
    """A collective's tensors cannot work together across the processes (Accelerate's name).

    Raised in debug mode only (see the module docstring), on every rank alike and before the
    collective, so no rank is left waiting.
    """


_debug_mode: bool | None = None  # set by PartialState().debug = ...; None: the environment decides


def set_debug_mode(on: bool | None) -> None:
    """Switch debug mode on or off for this process (``PartialState().debug``); None: the environment decides."""
    global _debug_mode
    _debug_mode = on


def is_debug_mode() -> bool:
    """Whether debug mode was switched on (:func:`set_debug_mode`), else whether ``ACCELERATE_DEBUG_MODE`` or
    ``RUNNER_DEBUG_MODE`` is ``1``, ``true`` or ``yes`` (any case)."""
    if _debug_mode is not None:
        return _debug_mode
    names = (DEBUG_MODE_ENV, ACCELERATE_DEBUG_MODE_ENV)
    return any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in names)


def _verify_shapes(
    operation: str, tensor: Any, *, must_match: Callable[[list[int]], Any] = list, rule: str, hint: str
) -> None:
    """In debug mode, raise on every rank unless ``must_match`` of each tensor's shape agrees on all of them.

    One object all-gather; every rank sees every rank's shapes and so takes the same decision.
    """
    if not is_debug_mode():
        return
    shapes: list[list[int]] = []
    recursively_apply(lambda t: shapes.append(list(t.shape)), tensor)
    per_rank = gather_object([shapes])
    required = [[must_match(shape) for shape in rank_shapes] for rank_shapes in per_rank]
    if all(item == required[0] for item in required):
        return
    listed = "; ".join(f"process {rank}: {_describe(rank_shapes)}" for rank, rank_shapes in enumerate(per_rank))
    raise DistributedOperationException(f"Cannot apply {operation}: {rule}: {listed}. {hint}")


def _describe(shapes: list[list[int]]) -> str:
    return ", ".join(map(str, shapes)) if shapes else "no tensors"


def recursively_apply(func: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Apply ``func`` to every tensor in a nest of lists, tuples (named too) and mappings."""
    if isinstance(data, torch.Tensor):
        return func(data)
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(recursively_apply(func, item) for item in data))
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(func, item) for item in data)
    if isinstance(data, Mapping):
        return type(data)({key: recursively_apply(func, value) for key, value in data.items()})
    return data


def is_tensor_nest(data: Any) -> bool:
    """Whether ``data`` is a tensor, or lists/tuples/mappings holding only tensors."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return all(is_tensor_nest(item) for item in data)
    if isinstance(data, Mapping):
        return all(is_tensor_nest(item) for item in data.values())
    return False


def send_to_device(data: Any, device: torch.device | str, non_blocking: bool = False) -> Any:
    """Move every tensor (and every object with a ``.to``) in ``data`` to ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    if isinstance(data, (list, tuple, Mapping)):
        return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)
    if hasattr(data, "to") and callable(data.to):
        try:
            return data.to(device, non_blocking=non_blocking)
        except TypeError:
            return data.to(device)
    return data


def _gather_tensor(tensor: torch.Tensor, world_size: int, group: Any = None) -> torch.Tensor:
    # Detached first: the collective writes into views of `output` and autograd refuses that when the
    # input requires grad; the gathered values carry no gradient back anyway (as in Accelerate).
    tensor = tensor.detach()
    if tensor.ndim == 0:
        tensor = tensor[None]
    tensor = tensor.contiguous()
    output = torch.empty((world_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(output, tensor, group=group)
    return output


def gather(tensor: Any, group: Any = None) -> Any:
    """Concatenate ``tensor`` from all processes along dim 0, in rank order.

    Args:
        tensor: A tensor or a nest of tensors; every rank must pass the same structure and shapes
            (use :func:`pad_across_processes` first when the first dimension differs). Scalars
            become length-1 tensors.
        group: Gather from this process group's processes only (the data-parallel ranks of a mesh,
            say); every process still calls it, each with its own group.

    Returns:
        The same structure, each tensor ``num_processes`` times longer and detached from the
        autograd graph (on one process too, so a loop behaves the same at every world size).

    Raises:
        DistributedOperationException: In debug mode, the shapes differ between processes.

    Example:
        >>> losses = gather(loss)  # fine on a loss that requires grad; ``losses.requires_grad`` is False
    """
    world_size = _world_size(group)
    if world_size == 1:
        return recursively_apply(torch.Tensor.detach, tensor)
    _verify_shapes(
        "gather",
        tensor,
        rule="the tensors' shapes differ across processes (all must match)",
        hint="Make them equal on every process; pad_across_processes evens out one dimension.",
    )
    return recursively_apply(lambda t: _gather_tensor(t, world_size, group), tensor)


def gather_object(obj: list[Any], group: Any = None) -> list[Any]:
    """Concatenate a picklable list from all processes (or ``group``'s, see :func:`gather`), in rank order."""
    world_size = _world_size(group)
    if world_size == 1:
        return list(obj)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, list(obj), group=group)
    return [item for per_rank in gathered for item in per_rank]


def rank_zero_value(value: Any) -> Any:
    """Rank 0's ``value`` on every process (picklable; the value itself on one process)."""
    return broadcast_object_list([value])[0]


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Overwrite every tensor in ``tensor`` with ``from_process``'s, in place; returns it.

    Raises:
        DistributedOperationException: In debug mode, a process's shapes differ from ``from_process``'s.
    """
    if _world_size() == 1:
        return tensor
    # Every rank must receive into tensors of the source's shapes; equal everywhere is the same test.
    _verify_shapes(
        "broadcast",
        tensor,
        rule=f"the tensors' shapes differ across processes (all must match the source, process {from_process})",
        hint="Allocate the receiving tensors with the source's shapes (copy_tensor_to_devices needs no shapes).",
    )

    def _broadcast(t: torch.Tensor) -> torch.Tensor:
        dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(_broadcast, tensor)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Overwrite the picklable items of ``object_list`` with ``from_process``'s, in place; returns it."""
    if _world_size() > 1:
        dist.broadcast_object_list(object_list, src=from_process)
    return object_list


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """Send a tensor that exists on one process only to every process; the others pass None.

    Unlike :func:`broadcast`, the receivers need not know its shape or dtype (nor which process
    holds it). Two collectives: every process first learns the holder, shape and dtype (an object
    all-gather), then the holder broadcasts the data, so every rank must call it.

    Returns:
        A new tensor with the holder's values on every process: on this process's GPU under NCCL,
        else on the CPU (the holder keeps its tensor's device).

    Raises:
        ValueError: No process, or more than one, passed a tensor (raised on every rank alike,
            before the broadcast, so none is left waiting).

    Example:
        >>> loaded = torch.load(path, weights_only=True) if accelerator.is_main_process else None
        >>> weights = copy_tensor_to_devices(loaded)
    """
    if _world_size() == 1:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices got None on the only process; pass the tensor to copy.")
        return tensor.clone()
    described = gather_object([None if tensor is None else (tuple(tensor.shape), tensor.dtype)])
    holders = [rank for rank, description in enumerate(described) if description is not None]
    if len(holders) != 1:
        raise ValueError(
            f"copy_tensor_to_devices needs a tensor on exactly one process and None on the others; ranks "
            f"{holders} passed one."
        )
    holder = holders[0]
    if dist.get_rank() == holder:
        copy = tensor.clone()
        if dist.get_backend() == "nccl" and copy.device.type != "cuda":
            copy = copy.to(torch.device("cuda", torch.cuda.current_device()))  # NCCL sends GPU memory only
        dist.broadcast(copy, src=holder)
        return copy.to(tensor.device)
    shape, dtype = described[holder]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    received = torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(received, src=holder)
    return received


# reduction -> the ``dist.ReduceOp`` member that computes it; "mean" divides the sum afterwards and
# "none" keeps this process's values (no collective).
_REDUCE_OPS = {"mean": "SUM", "sum": "SUM", "max": "MAX", "min": "MIN", "none": None}


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0, group: Any = None) -> Any:
    """Reduce ``tensor`` (or a nest of tensors) over all processes, into new tensors.

    Args:
        tensor: A tensor or a nest of tensors with the same shapes on every rank.
        reduction: ``"mean"`` (the default, as ``accelerate.utils.reduce``), ``"sum"``, ``"max"``,
            ``"min"``, or ``"none"`` (this process's values, copied).
        scale: A factor applied to the result.
        group: Reduce over this process group's processes only (see :func:`gather`).

    Returns:
        The same structure, every tensor replaced by its reduction (on one process: a copy).

    Raises:
        ValueError: ``reduction`` is not one of the names above (raised on every rank before any
            collective, so no rank is left waiting).
        DistributedOperationException: In debug mode, the shapes differ between processes.

    Example:
        >>> reduce(torch.tensor([float(rank)]), reduction="max")  # tensor([1.]) on 2 processes
    """
    if reduction not in _REDUCE_OPS:
        raise ValueError(f"reduction={reduction!r} is not supported; use one of {', '.join(map(repr, _REDUCE_OPS))}.")
    world_size = _world_size(group)
    op_name = _REDUCE_OPS[reduction]
    if world_size > 1 and op_name is not None:  # "none" runs no collective, so nothing can hang
        _verify_shapes(
            "reduce",
            tensor,
            rule="the tensors' shapes differ across processes (all must match)",
            hint="Make them equal on every process.",
        )

    def _reduce(t: torch.Tensor) -> torch.Tensor:
        result = t.clone()  # all_reduce works in place; the caller's tensor stays untouched
        if world_size > 1 and op_name is not None:
            dist.all_reduce(result, op=getattr(dist.ReduceOp, op_name), group=group)
            if reduction == "mean":
                result /= world_size
        return result * scale if scale != 1.0 else result

    return recursively_apply(_reduce, tensor)


def pad_across_processes(
    tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False, group: Any = None
) -> Any:
    """Pad ``tensor`` along ``dim`` to the largest size any process has, so it can be gathered.

    Args:
        dim: The dimension whose size differs between processes.
        pad_index: The value to pad with.
        pad_first: Pad at the start instead of the end.
        group: Pad to the largest size of this process group's processes only (see :func:`gather`).

    Raises:
        DistributedOperationException: In debug mode, the numbers of dimensions differ between processes.
    """
    world_size = _world_size(group)
    if world_size == 1:
        return tensor
    # Sizes may differ; the number of dimensions may not: a process whose tensor lacks `dim` skips
    # the size exchange the others wait in.
    _verify_shapes(
        "pad_across_processes",
        tensor,
        must_match=len,
        rule="the tensors' numbers of dimensions differ across processes (all must match)",
        hint="Pass tensors with the same number of dimensions on every process.",
    )

    def _pad(t: torch.Tensor) -> torch.Tensor:
        if dim >= t.ndim or dim < -t.ndim:
            return t
        axis = dim % t.ndim
        size = torch.tensor([t.shape[axis]], device=t.device)
        sizes = _gather_tensor(size, world_size, group)
        longest = int(sizes.max())
        if longest == t.shape[axis]:
            return t
        shape = list(t.shape)
        shape[axis] = longest
        padded = t.new_full(shape, pad_index)
        index = [slice(None)] * t.ndim
        index[axis] = slice(longest - t.shape[axis], longest) if pad_first else slice(0, t.shape[axis])
        padded[tuple(index)] = t
        return padded

    return recursively_apply(_pad, tensor)


def truncate(data: Any, length: int) -> Any:
    """Keep the first ``length`` items of every tensor in ``data`` (used to drop padding samples)."""
    return recursively_apply(lambda t: t[:length], data)


def split_between_processes(inputs: Any, *, num_processes: int, process_index: int, apply_padding: bool = False):
    """This process's contiguous share of ``inputs``: a list, tuple, tensor, a Hugging Face ``datasets.Dataset``
    (its share is a ``Dataset`` too), or a dict of them.

    The first ``len % num_processes`` processes get one item more. With ``apply_padding`` the
    shorter shares repeat their last item (the input's last item if a share is empty), so every
    process gets as many and the results can be gathered; drop the padding after gathering.
    """
    if isinstance(inputs, Mapping):
        if len({len(value) for value in inputs.values()}) > 1:
            raise ValueError("split_between_processes needs the values of a dict to have the same length.")
        return type(inputs)(
            {
                key: split_between_processes(
                    value, num_processes=num_processes, process_index=process_index, apply_padding=apply_padding
                )
                for key, value in inputs.items()
            }
        )
    base, extra = divmod(len(inputs), num_processes)
    start = process_index * base + min(process_index, extra)
    stop = start + base + (process_index < extra)
    padded = apply_padding and extra and process_index >= extra and len(inputs)
    if _is_table(inputs):  # rows are chosen by index: slicing a Dataset would return a dict of columns
        rows = list(range(start, stop))
        return inputs.select(rows + ([rows[-1] if rows else len(inputs) - 1] if padded else []))
    share = inputs[start:stop]
    if padded:
        last = share[-1:] if len(share) else inputs[-1:]
        share = torch.cat([share, last]) if isinstance(share, torch.Tensor) else share + type(share)(last)
    return share


def _is_table(inputs: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` (checked without importing the library)."""
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(inputs, datasets.Dataset)
