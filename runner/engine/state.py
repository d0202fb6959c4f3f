"""Accelerate's ``accelerate.state`` names: the process's place in the job, without an Accelerator's settings.

:class:`PartialState` is what a script that only runs code on some processes, or splits inputs between
them (batched inference, data preparation), builds instead of an ``Accelerator``. As in Accelerate every
instance shares one state: the first joins the process group the launcher described (torchrun,
``runner launch``, ``debug_launcher``), the others read it. An ``Accelerator`` reads the same environment
and joins the same group, so the two agree on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from runner.engine import ops
from runner.engine.distributed import (
    AcceleratorState,
    DistributedEnvironment,
    InitProcessGroupKwargs,
    join_process_group,
)
from runner.engine.optimizer import GradientState
from runner.engine.placement import ProcessPlacement

__all__ = ["AcceleratorState", "GradientState", "PartialState"]


class PartialState(ProcessPlacement):
    """This process's rank, device and group, shared by every instance (Accelerate's ``PartialState``).

    Args:
        cpu: Run on the CPU (and gloo) even where CUDA devices are visible.
        **kwargs: ``init_method`` and ``timeout`` (a ``datetime.timedelta``) for the process group, as
            :class:`~runner.engine.InitProcessGroupKwargs` takes them, and ``backend``; used by the first
            instance only.

    Attributes:
        debug: Whether collectives first check their tensors' shapes across processes and raise
            ``DistributedOperationException`` where they differ: ``ACCELERATE_DEBUG_MODE`` (or
            ``RUNNER_DEBUG_MODE``) unless assigned; assigning it switches the check for every collective
            of the process, as in Accelerate.

    Example:
        >>> state = PartialState()
        >>> with state.split_between_processes(prompts) as mine:
        ...     outputs = [generate(prompt) for prompt in mine]
        >>> state.wait_for_everyone()
    """

    _shared: dict[str, Any] = {}

    def __init__(self, cpu: bool = False, **kwargs: Any) -> None:
        self.__dict__ = self._shared
        if self._shared:
            return
        unknown = set(kwargs) - {"backend", "init_method", "timeout"}
        if unknown:
            raise ValueError(
                f"PartialState got unknown arguments {sorted(unknown)}; it takes cpu, backend, init_method and timeout."
            )
        self._env = join_process_group(cpu=cpu, options=InitProcessGroupKwargs(**kwargs))

    @classmethod
    def _reset_state(cls) -> None:
        """Forget the shared state (Accelerate's name): the next instance reads the environment again, and debug
        mode follows the environment again."""
        cls._shared.clear()
        ops.set_debug_mode(None)

    @property
    def initialized(self) -> bool:
        return bool(self._shared)

    @property
    def state(self) -> DistributedEnvironment:
        return self._env

    @property
    def backend(self) -> str | None:
        return self._env.backend

    @property
    def debug(self) -> bool:
        return ops.is_debug_mode()

    @debug.setter
    def debug(self, value: bool) -> None:
        ops.set_debug_mode(bool(value))

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave the process group (``group``, or the default one) if this process is in one."""
        self._env.destroy_process_group(group)

    def __repr__(self) -> str:
        return (
            f"Distributed environment: {self.distributed_type.value}  Backend: {self.backend}\n"
            f"Num processes: {self.num_processes}\nProcess index: {self.process_index}\n"
            f"Local process index: {self.local_process_index}\nDevice: {self.device}\n"
        )

    @property
    def default_device(self) -> torch.device:
        """The device this process computes on (Accelerate's name)."""
        return self._env.device
