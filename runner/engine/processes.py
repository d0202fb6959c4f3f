"""The Accelerator's verbs about its processes: which one this is, what each runs, and what they exchange.

:class:`ProcessVerbs` is mixed into :class:`~runner.engine.accelerator.Accelerator`: where this process runs
(the mesh and the data-parallel ranks, beyond :class:`~runner.engine.placement.ProcessPlacement`'s rank and
device), the collectives over the data-parallel ranks (``gather``, ``gather_for_metrics``, ``reduce``, the
trigger) and ``join_uneven_inputs``. Each verb delegates to :mod:`runner.engine.ops` (the collectives),
:mod:`runner.engine.distributed` (the processes) or the parallel strategy. It reads the attributes its class
body declares, which the Accelerator sets; it may import those modules and torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms import Join

from runner.engine import ops
from runner.engine.distributed import AcceleratorState, DistributedType
from runner.engine.loaders.dispatch import DispatchedDataLoader
from runner.engine.placement import ProcessPlacement

if TYPE_CHECKING:
    from runner.engine.loaders import PreparedDataLoader
    from runner.engine.optimizer import GradientState
    from runner.engine.parallel import ParallelismConfig
    from runner.engine.parallel.base import ParallelStrategy


class ProcessVerbs(ProcessPlacement):
    """Rank, device and mesh; collectives; running on some processes only (a mixin of the Accelerator)."""

    state: AcceleratorState
    parallelism_config: ParallelismConfig | None
    gradient_state: GradientState
    _strategy: ParallelStrategy
    _dataloaders: list[PreparedDataLoader]
    _trigger_set: bool

    @property
    def torch_device_mesh(self):
        """The ``DeviceMesh`` models are sharded or split on (FSDP2, tensor parallelism), else None.

        With a :class:`ParallelismConfig` its dimensions are ``("dp_replicate", "dp_shard", "tp")``, with the
        flattened ``"dp"`` (every data-parallel rank) among its submeshes; under plain FSDP, ``("dp_shard",)``.
        """
        return getattr(self._strategy, "device_mesh", None)

    @property
    def _data_parallel_size(self) -> int:
        """Processes that read different batches (all of them, unless tensor parallelism groups them)."""
        config = self.parallelism_config
        return self.num_processes if config is None else config.data_parallel_size

    @property
    def _data_parallel_rank(self) -> int:
        config = self.parallelism_config
        return self.process_index if config is None else config.data_parallel_rank(self.process_index)

    @property
    def _data_parallel_group(self):
        """The process group of the data-parallel ranks, where tensor parallelism groups processes; else None."""
        return getattr(self._strategy, "data_parallel_group", None)

    def gather(self, tensor: Any) -> Any:
        """Concatenate ``tensor`` (or a nest of them) from all processes along dim 0, detached from autograd.

        Example:
            >>> losses = accelerator.gather(loss)  # works on a loss that requires grad; the result does not
        """
        return ops.gather(tensor, group=self._data_parallel_group)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: like ``gather``, without the samples that padded the last batch.

        Over a full pass of a prepared loader, the results concatenate to exactly one entry per
        sample of the dataset. Non-tensor data (or ``use_gather_object=True``) is gathered as a
        list of picklable objects.
        """
        is_tensors = ops.is_tensor_nest(input_data)
        group = self._data_parallel_group
        if is_tensors and not use_gather_object:
            data = ops.gather(input_data, group=group)
        else:
            data = ops.gather_object(input_data, group=group)
        remainder = self.gradient_state.remainder
        if self.gradient_state.end_of_dataloader and remainder > 0:
            data = ops.truncate(data, remainder) if is_tensors and not use_gather_object else data[:remainder]
        return data

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        return ops.pad_across_processes(
            tensor, dim=dim, pad_index=pad_index, pad_first=pad_first, group=self._data_parallel_group
        )

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Reduce ``tensor`` (or a nest of them) over all processes; see :func:`runner.engine.ops.reduce`.

        Args:
            reduction: ``"sum"`` by default here (as ``Accelerator.reduce``; ``utils.reduce`` defaults to
                ``"mean"``), or ``"mean"``, ``"max"``, ``"min"``, ``"none"``.
            scale: A factor applied to the result.

        Raises:
            ValueError: ``reduction`` is not one of those names.
        """
        return ops.reduce(tensor, reduction=reduction, scale=scale, group=self._data_parallel_group)

    def set_trigger(self) -> None:
        """Raise this process's flag; the next :meth:`check_trigger` then returns True on every process.

        No collective: one rank may call it alone (say, on a NaN loss it alone sees).
        """
        self._trigger_set = True

    def check_trigger(self) -> bool:
        """Whether any process called :meth:`set_trigger` since the last check; resets every flag if so.

        A collective (a sum over processes): every process must call it at the same point, and all
        get the same answer, so they can leave a loop together.

        Example:
            >>> if not torch.isfinite(loss):
            ...     accelerator.set_trigger()
            >>> if accelerator.check_trigger():
            ...     break
        """
        flag = torch.tensor(int(self._trigger_set), device=self.device)
        if ops.reduce(flag, reduction="sum").item() == 0:
            return False
        self._trigger_set = False
        return True

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list, even_batches: bool | None = None) -> Iterator[None]:
        """Let processes with fewer batches finish early without hanging the others (torch's ``Join``).

        A process that runs out of batches shadows the collectives of the DDP models in ``joinables``
        until every process has; then the last process to finish sends its weights to the others.
        Under DDP ``Join`` is always on, as in Accelerate (loaders it did not prepare may be uneven
        too). Without DDP (one process, FSDP) it does nothing and warns.

        Args:
            joinables: The prepared DDP models (any ``torch.distributed.algorithms.Joinable``).
            even_batches: Overrides the ``even_batches`` of the prepared loaders each process reads itself
                inside the block, as in Accelerate (loaders rank 0 dispatches, and sharded streams, keep
                theirs, with a warning); None keeps every loader's.

        Example:
            >>> accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(even_batches=False))
            >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            >>> with accelerator.join_uneven_inputs([model]):
            ...     for inputs, targets in loader:  # some ranks get one batch fewer
            ...         accelerator.backward(loss_fn(model(inputs), targets))
            ...         optimizer.step()
            ...         optimizer.zero_grad()
        """
        if self._strategy.name != "ddp":
            where = "FSDP" if self.distributed_type == DistributedType.FSDP else "a single process"
            warnings.warn(
                f"join_uneven_inputs does nothing on {where}: it joins DistributedDataParallel models only.",
                stacklevel=3,
            )
            yield
            return
        # Always on under DDP, as in Accelerate: a loader this Accelerator did not prepare may be uneven too.
        with _even_batches(self._dataloaders, even_batches), Join(joinables, throw_on_early_termination=False):
            yield


@contextlib.contextmanager
def _even_batches(loaders: list[PreparedDataLoader], even_batches: bool | None) -> Iterator[None]:
    """``join_uneven_inputs``' override of the loaders' ``even_batches`` (None: none), put back on leaving."""
    overridden, kept = [], []
    for loader in loaders if even_batches is not None else ():
        batches = getattr(loader, "batches", loader.batch_sampler)  # whose passes the setting shapes
        if isinstance(loader, DispatchedDataLoader) or not hasattr(batches, "even_batches"):
            kept.append(type(loader.dataset).__name__)
            continue
        overridden.append((loader, batches, loader.sharding))
        batches.even_batches = even_batches
        loader.sharding = dataclasses.replace(loader.sharding, even_batches=even_batches)
    if kept:
        warnings.warn(
            f"join_uneven_inputs(even_batches={even_batches}): overriding even_batches is only supported for map-style "
            f"datasets each process reads itself; the loaders over {', '.join(kept)} (dispatched by rank 0, or "
            "streamed) keep theirs.",
            stacklevel=4,
        )
    try:
        yield
    finally:
        for loader, batches, sharding in overridden:
            batches.even_batches = sharding.even_batches
            loader.sharding = sharding
