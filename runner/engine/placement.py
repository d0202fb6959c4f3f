"""Where this process runs and what runs on it: the verbs an Accelerator and a ``PartialState`` share.

:class:`ProcessPlacement` reads ``self.state`` (a :class:`~runner.engine.distributed.DistributedEnvironment`):
rank, device and kind of job, waiting for the other processes, running a block or a function on some processes
only, and splitting inputs between them. It may import torch, :mod:`runner.engine.ops` and
:mod:`runner.engine.distributed`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from runner.engine import ops
from runner.engine.distributed import DistributedEnvironment, DistributedType, barrier


class ProcessPlacement:
    """This process's place in the job, and running code on some processes only (a mixin)."""

    state: DistributedEnvironment

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
    def _data_parallel_size(self) -> int:
        """Processes that read different inputs (all of them here; an Accelerator's tensor parallelism groups some)."""
        return self.num_processes

    @property
    def _data_parallel_rank(self) -> int:
        return self.process_index

    @property
    def use_distributed(self) -> bool:
        return self.state.is_distributed

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this point."""
        barrier(self.state)

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
