"""Context parallelism: every sequence of a batch split across the mesh's ``cp`` processes (torch's
``context_parallel``), each computing its slice's forward and backward, attention exchanged ring-wise.

The processes of a ``cp`` group read the same batch. Inside a training step the sequence tensors (the inputs,
the targets) and the tokens' positions are sharded along the sequence (dimension 1) in place, in torch's
load-balanced order (each process takes two chunks, one from each end, so causal attention costs each the same),
and the model's ``scaled_dot_product_attention`` becomes the ring's. The model must take the positions, since its
slice is not the sequence's start: a ``positions=`` keyword (``runner.models.GPT``) or ``position_ids=``
(Hugging Face's models). The loss must compare each position's output with that position's target: targets
shifted before the step (a language model's next tokens), never inside the loss, which would pair tokens across
slices. Each process's loss is its slice's mean; FSDP averages the gradients over
``dp_shard x cp`` (:attr:`~runner.engine.parallel.mesh.ParallelismConfig.fsdp_dim_names`), which makes them the
whole sequence's, and the loss reported is the mean over the group.

torch shards the attention of CUDA's kernels only (flash and memory-efficient SDPA); the CPU's has no sharding
rule, so a model with attention runs context-parallel on GPUs only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from runner.engine.parallel.base import unwrap_module

POSITION_KEYWORDS = ("positions", "position_ids")  # runner.models.GPT's, Hugging Face's


@contextlib.contextmanager
def sequence_sharded(mesh, model: nn.Module, args: tuple, kwargs: dict, target: Any) -> Iterator[dict]:
    """Shard the batch's sequences over ``mesh`` (the ``cp`` submesh) for the step inside; yields the keyword
    arguments to call the model with (``kwargs`` and the positions). The tensors are restored on leaving.

    Raises:
        ValueError: The model takes no positions, or the sequence does not split into the group's chunks.
    """
    from torch.distributed.tensor.experimental import context_parallel

    keyword = positions_keyword(model)
    sequences: dict[int, torch.Tensor] = {}
    for value in (*args, *kwargs.values(), target):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            sequences.setdefault(id(value), value)  # one tensor given twice (ids as inputs and labels) once
    if not sequences:
        raise ValueError("Context parallelism splits sequences, but the batch holds no tensor of (batch, sequence).")
    length, size = next(iter(sequences.values())).shape[1], mesh.size()
    if length % (2 * size):
        raise ValueError(
            f"A sequence of {length} tokens does not split into the {2 * size} chunks context parallelism balances "
            f"over parallel.cp={size} processes; use a sequence length that is a multiple of {2 * size}."
        )
    positions = torch.arange(length, device=next(iter(sequences.values())).device).unsqueeze(0)
    buffers = [*sequences.values(), positions]
    try:
        with context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers), no_restore_buffers={positions}
        ):
            yield {**kwargs, keyword: positions}
    except NotImplementedError as error:
        if "scaled_dot_product" in str(error) and "cpu" in str(error):
            raise RuntimeError(
                "parallel.cp shards attention with CUDA's kernels only, and this model's attention runs on the CPU "
                "(torch has no sharding rule for it); set parallel.cp=1, or run on GPUs."
            ) from None
        raise


def positions_keyword(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes the tokens' positions by.

    Raises:
        ValueError: It takes none.
    """
    keyword = _position_keyword_of(type(unwrap_module(model)))
    if keyword is not None:
        return keyword
    raise ValueError(
        f"Context parallelism hands each process a slice of every sequence, so the model must be told where its "
        f"tokens sit; {type(unwrap_module(model)).__name__}.forward takes neither positions= (as runner.models.GPT) "
        "nor position_ids= (as Hugging Face's models)."
    )


@functools.cache
def _position_keyword_of(model_class: type) -> str | None:
    """The first of :data:`POSITION_KEYWORDS` the class's ``forward`` takes (read once per class, not per step)."""
    parameters = inspect.signature(model_class.forward).parameters
    return next((keyword for keyword in POSITION_KEYWORDS if keyword in parameters), None)


def group_mean(loss: torch.Tensor, mesh) -> torch.Tensor:
    """The mean of the group's losses (each its slice's mean; the slices are equal), on every process of it."""
    import torch.distributed as dist

    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return total / mesh.size()
