"""The Accelerator's verbs about its processes: which one this is, what each runs, and what they exchange.

:class:`ProcessVerbs` is mixed into :class:`~runner.engine.accelerator.Accelerator`: where this process runs
(rank, device, mesh, the data-parallel ranks), the collectives over the data-parallel ranks (``gather``,
``gather_for_metrics``, ``reduce``, the trigger), running a block or a function on some processes only, and
``join_uneven_inputs``. Each verb delegates to :mod:`runner.engine.ops` (the collectives),
:mod:`runner.engine.distributed` (the processes) or the parallel strategy. It reads the attributes its class
body declares, which the Accelerator sets; it may import those modules and torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.algorithms import Join

from runner.engine import ops
from runner.engine.data.dispatch import DispatchedDataLoader
from runner.engine.distributed import AcceleratorState, DistributedType, barrier

if TYPE_CHECKING:
    from runner.engine.data import PreparedDataLoader
    from runner.engine.optimizer import GradientState
    from runner.engine.parallel import ParallelismConfig
    from runner.engine.parallel.base import ParallelStrategy


class ProcessVerbs:
    """Rank, device and mesh; collectives; running on some processes only (a mixin of the Accelerator)."""

    state: AcceleratorState
    parallelism_config: ParallelismConfig | None
    gradient_state: GradientState
    _strategy: ParallelStrategy
    _dataloaders: list[PreparedDataLoader]
    _trigger_set: bool

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def process_index(self) -> int:
        return self.state.rank

    @property
    def local_process_index(self) -> int:
        return self.state.local_rank

    @property
    def num_processes(self) -> int:
        return self.state.world_size

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

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

    @property
    def use_distributed(self) -> bool:
        return self.state.is_distributed

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

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        barrier(self.state)

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
        overridden, kept = [], []
        for loader in self._dataloaders if even_batches is not None else ():
            batches = getattr(loader, "batches", loader.batch_sampler)  # whose passes the setting shapes
            if isinstance(loader, DispatchedDataLoader) or not hasattr(batches, "even_batches"):
                kept.append(type(loader.dataset).__name__)
                continue
            overridden.append((loader, batches, loader.sharding))
            batches.even_batches = even_batches
            loader.sharding = dataclasses.replace(loader.sharding, even_batches=even_batches)
        if kept:
            warnings.warn(
                f"join_uneven_inputs(even_batches={even_batches}) overrides the loaders each process reads itself; "
                f"the loaders over {', '.join(kept)} (dispatched by rank 0, or streamed) keep their even_batches.",
                stacklevel=3,
            )
        try:
            # Always on under DDP, as in Accelerate: a loader this Accelerator did not prepare may be uneven too.
            with Join(joinables, enable=True, throw_on_early_termination=False):
                yield
        finally:
            for loader, batches, sharding in overridden:
                batches.even_batches = sharding.even_batches
                loader.sharding = sharding

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process first (to download or cache), then on the others."""
        with self._first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Run the block on each node's main process first, then on the node's other processes."""
        with self._first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _first(self, is_first: bool) -> Iterator[None]:
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Give each process its contiguous share of ``inputs`` (list, tuple, tensor, or dict of them).

        Example:
            >>> with accelerator.split_between_processes(prompts) as mine:
            ...     outputs = [generate(prompt) for prompt in mine]
        """
        yield ops.split_between_processes(
            inputs,
            num_processes=self._data_parallel_size,
            process_index=self._data_parallel_rank,
            apply_padding=apply_padding,
        )

    def on_main_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on the main process only (elsewhere it returns None)."""
        return _only_when(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on each node's main process only."""
        return _only_when(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        """Decorate ``function`` to run on the last process only (the only one, without distribution)."""
        return _only_when(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        """Decorate ``function`` to run on process ``process_index`` only."""
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return _only_when(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        """Decorate ``function`` to run on local process ``local_process_index`` of each node only."""
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return _only_when(function, lambda: self.local_process_index == local_process_index)

    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)


def _only_when(function: Callable, condition: Callable[[], bool]) -> Callable:
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs) if condition() else None

    return wrapper
