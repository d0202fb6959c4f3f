"""Local SGD: each process trains its own replica for a few steps, then the replicas are averaged.

Inside the context the prepared (DDP) model runs under ``accelerator.no_sync``, so backward communicates
nothing and each rank's replica drifts on its own data; every ``local_sgd_steps`` steps, and once more on
leaving the context, all ranks replace their parameters by the mean over the processes. The collectives are
Accelerate's, in its order: a barrier, then one all-reduce per parameter in ``model.parameters()`` order, which
every replica of one model shares. The idea goes back at least to Zhang et al., "Parallel SGD: When does averaging
help?" (2016); the name to Stich, "Local SGD Converges Fast and Communicates Little" (ICLR 2019).

Only whole replicas can be averaged: FSDP keeps a different shard of each parameter on each process, so a sharded
model is refused (as Accelerate refuses everything but plain data parallelism).
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING

import torch
from torch import nn

from runner.engine.distributed import DistributedType

if TYPE_CHECKING:
    from runner.engine.accelerator import Accelerator

# Accelerate's list: no distribution, or one whole replica of the model per process.
_REPLICATED_TYPES = frozenset(
    {
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_XPU,
        DistributedType.MULTI_MLU,
        DistributedType.MULTI_HPU,
        DistributedType.MULTI_SDAA,
        DistributedType.MULTI_MUSA,
        DistributedType.MULTI_NPU,
        DistributedType.MULTI_NEURON,
    }
)


class LocalSGD:
    """Train without gradient synchronisation and average the model's parameters every ``local_sgd_steps`` steps.

    On one process, or with ``enabled=False``, it does nothing but count steps: the model trains as prepared
    (plain DDP when distributed).

    Args:
        accelerator: The Accelerator that prepared ``model``.
        model: The prepared model (DDP-wrapped when distributed) whose parameters are averaged.
        local_sgd_steps: Steps each process takes on its own between two averages.
        enabled: False makes it a no-op, so a script can switch local SGD off without changing its loop.

    Raises:
        NotImplementedError: The accelerator shards models (FSDP, tensor parallelism), even with ``enabled=False``,
            as in Accelerate.
        ValueError: ``local_sgd_steps`` is not a positive integer.

    Example:
        >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
        ...     for inputs, targets in loader:
        ...         accelerator.backward(loss_fn(model(inputs), targets))
        ...         optimizer.step()
        ...         optimizer.zero_grad()
        ...         local_sgd.step()  # averages the replicas every 8th call
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module, local_sgd_steps: int, enabled: bool = True) -> None:
        kind = accelerator.distributed_type
        if kind not in _REPLICATED_TYPES:
            raise NotImplementedError(
                f"LocalSGD averages whole model replicas, but distributed_type={kind.value} does not keep one on "
                "each process; prepare the model with plain DDP (no fsdp_plugin, no sharding or tensor-parallel "
                "parallelism_config) or drop LocalSGD."
            )
        if isinstance(local_sgd_steps, bool) or not isinstance(local_sgd_steps, int) or local_sgd_steps < 1:
            raise ValueError(f"LocalSGD got local_sgd_steps={local_sgd_steps!r}; pass a positive integer.")
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.enabled = enabled and kind is not DistributedType.NO
        self.num_steps = 0
        self._no_sync = contextlib.ExitStack()

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if not self.enabled:
            return
        try:
            # After an error the other ranks may be anywhere (in a forward, or gone): a collective here could
            # pair with one of theirs or wait forever, so only a clean exit averages.
            if kind is None:
                self._average_parameters()
        finally:
            self._no_sync.__exit__(kind, error, trace)

    def step(self) -> None:
        """Count one step, and average the parameters across processes on every ``local_sgd_steps``-th.

        Every process must call it equally often: the average is a collective.
        """
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._average_parameters()

    def _average_parameters(self) -> None:
        # Accelerate's sequence, so every rank issues the same collectives: a barrier, then one all-reduce per
        # parameter (one at a time, so a copy of one parameter is the most it allocates). Written in place: the
        # optimizer and DDP's reducer keep pointing at the same storage.
        self.accelerator.wait_for_everyone()
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.copy_(self.accelerator.reduce(parameter.detach(), reduction="mean"))
