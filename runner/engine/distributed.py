"""Where this process stands: rank, world size, device and backend, read from the environment.

torchrun, torch's elastic agent and our own launcher all describe a worker with the same variables
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). We read them once into
an immutable value that is passed around; there is no process-wide state object besides the torch
process group itself.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import enum
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from runner.engine.constants import USE_CPU_ENV
from runner.engine.launch_environment import LaunchEnvironment


class DistributedType(str, enum.Enum):
    """How the work is spread over processes (Accelerate's names and values).

    The engine selects ``NO``, ``MULTI_CPU``, ``MULTI_GPU`` or ``FSDP``. The other members exist so a
    ported script's comparisons (``if accelerator.distributed_type == DistributedType.XLA``) keep
    working; they are never selected here.
    """

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


@dataclass(frozen=True)
class InitProcessGroupKwargs:
    """How the Accelerator joins the default process group (Accelerate's handler of the same name).

    Args:
        backend: ``"gloo"``, ``"nccl"``, ...; None takes the environment's (nccl on CUDA, gloo on CPU).
        init_method: Where the processes meet (``"tcp://host:port"``, ``"file://..."``); None reads
            MASTER_ADDR and MASTER_PORT, as torchrun and the elastic agent set them.
        timeout: How long a collective waits for the other ranks before it fails; None keeps torch's
            default (30 minutes for gloo, 10 for nccl).
    """

    backend: str | None = None
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass(frozen=True)
class DistributedEnvironment:
    """One process's place in the job. Build it with :func:`read_environment`."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # Accelerate's names for the same facts, so ``accelerator.state.process_index`` reads as it does there.
    @property
    def num_processes(self) -> int:
        return self.world_size

    @property
    def process_index(self) -> int:
        return self.rank

    @property
    def local_process_index(self) -> int:
        return self.local_rank

    @property
    def use_distributed(self) -> bool:
        return self.is_distributed

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def distributed_type(self) -> DistributedType:
        if not self.is_distributed:
            return DistributedType.NO
        return DistributedType.MULTI_GPU if self.device.type == "cuda" else DistributedType.MULTI_CPU

    def destroy_process_group(self, group: Any = None) -> None:
        """Leave the process group (``group``, or the default one) if this process is in one (Accelerate's verb)."""
        if self.is_distributed and dist.is_initialized():
            dist.destroy_process_group(group)


@dataclass(frozen=True)
class AcceleratorState(DistributedEnvironment):
    """``accelerator.state``: the environment, and how this Accelerator trains in it (Accelerate's attributes).

    Unlike Accelerate's ``AcceleratorState`` it is not shared: each Accelerator builds its own, so two
    Accelerators with different settings in one process report their own.

    Args:
        fsdp: The Accelerator shards models with FSDP (``distributed_type`` is then ``FSDP``).
        mixed_precision: ``"no"``, ``"fp16"``, ``"bf16"`` or ``"fp8"``.
        debug: Debug mode was on when it was built (``ACCELERATE_DEBUG_MODE=1``): collectives check
            their tensors' shapes across processes first (see :mod:`runner.engine.ops`).

    Example:
        >>> state = AcceleratorState.of(read_environment(), fsdp=False, mixed_precision="bf16")
        >>> state.process_index, state.num_processes, state.mixed_precision
        (0, 1, 'bf16')
    """

    fsdp: bool = False
    mixed_precision: str = "no"
    debug: bool = False

    def __new__(cls, *args: Any, **kwargs: Any) -> AcceleratorState:
        if not args and not kwargs:  # Accelerate's singleton idiom, which would read as a process of its own here
            raise ValueError(
                "AcceleratorState() is not the live state here: each Accelerator holds its own; read "
                "accelerator.state, or PartialState() for this process's rank, device and group."
            )
        return super().__new__(cls)

    def __reduce__(self) -> tuple:
        return _state_from, ({field.name: getattr(self, field.name) for field in fields(self)},)

    @classmethod
    def of(
        cls, env: DistributedEnvironment, *, fsdp: bool, mixed_precision: str, debug: bool = False
    ) -> AcceleratorState:
        return cls(
            **{field.name: getattr(env, field.name) for field in fields(DistributedEnvironment)},
            fsdp=fsdp,
            mixed_precision=mixed_precision,
            debug=debug,
        )

    @property
    def distributed_type(self) -> DistributedType:
        return DistributedType.FSDP if self.fsdp else super().distributed_type


def _state_from(values: dict[str, Any]) -> AcceleratorState:
    """An :class:`AcceleratorState` from its fields (what unpickling and copying build it from)."""
    return AcceleratorState(**values)


def read_environment(*, cpu: bool = False, launched: LaunchEnvironment | None = None) -> DistributedEnvironment:
    """This process's rank, world size and device, from what torchrun or the elastic agent set.

    Args:
        cpu: Use the CPU (and gloo) even when CUDA devices are visible; also when the environment
            sets ``RUNNER_USE_CPU=1`` (as ``debug_launcher`` does).
        launched: What the launcher said, as :meth:`LaunchEnvironment.read` read it; read here when not given.

    Returns:
        The environment of this process. Without WORLD_SIZE (a plain ``python script.py``) it is a
        single process on ``cuda:0`` when CUDA is available, else on the CPU.

    Raises:
        ValueError: A count (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) is not one, or
            the rank is outside the world.
    """
    launched = LaunchEnvironment.read() if launched is None else launched
    if launched.malformed:
        raise ValueError(
            f"Environment variable {launched.malformed[0]} is not a count (a whole number from 0); unset it or fix it."
        )
    world_size = 1 if launched.world_size is None else launched.world_size
    rank = launched.global_rank
    local_rank = launched.local_rank or 0
    local_world_size = world_size if launched.local_world_size is None else launched.local_world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}; the launcher set them inconsistently.")
    cpu = cpu or os.environ.get(USE_CPU_ENV, "").lower() in ("1", "true", "yes")
    use_cuda = torch.cuda.is_available() and not cpu
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} needs GPU {local_rank}, but only {torch.cuda.device_count()} are "
                "visible; start at most one process per GPU or pass cpu=True."
            )
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = None
    if world_size > 1:
        backend = "nccl" if use_cuda else "gloo"
    return DistributedEnvironment(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=device,
        backend=backend,
    )


def barrier(env: DistributedEnvironment) -> None:
    """Block until every process of ``env``'s job reaches this point (a single process has nobody to wait for)."""
    if env.is_distributed:
        dist.barrier()


def init_process_group(
    env: DistributedEnvironment, *, timeout: timedelta | None = None, init_method: str | None = None
) -> None:
    """Join the default process group described by ``env`` unless this process already has one.

    The group is shared by every Accelerator in the process; it is created once and reused.
    """
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if not env.is_distributed:
        return
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"A process group of rank {dist.get_rank()}/{dist.get_world_size()} already exists, but the "
                f"environment says rank {env.rank}/{env.world_size}; destroy it or fix RANK/WORLD_SIZE."
            )
        return
    for name in () if init_method else ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise RuntimeError(
                f"WORLD_SIZE={env.world_size} but {name} is not set; start the script with torchrun "
                "(or set MASTER_ADDR and MASTER_PORT)."
            )
    kwargs = {"backend": env.backend, "rank": env.rank, "world_size": env.world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if init_method is not None:
        kwargs["init_method"] = init_method
    if env.backend == "nccl":
        # Binding the group to the device lets NCCL create its communicator eagerly and avoids the
        # "guessing device" warning and its barrier on the wrong GPU.
        kwargs["device_id"] = env.device
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if restarted and init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        kwargs["store"] = _agent_store(env, timeout)
    dist.init_process_group(**kwargs)
    atexit.register(_destroy_process_group)
    record_uncaught_errors()


def join_process_group(*, cpu: bool, options: InitProcessGroupKwargs | None = None) -> DistributedEnvironment:
    """Read this process's environment and join its process group (once per process), with ``options``'
    backend, init method and timeout; returns the environment."""
    options = options or InitProcessGroupKwargs()
    env = read_environment(cpu=cpu)
    if options.backend is not None:
        env = dataclasses.replace(env, backend=options.backend)
    init_process_group(env, timeout=options.timeout, init_method=options.init_method)
    return env


def record_uncaught_errors() -> None:
    """Under torch's elastic launcher (torchrun, ``runner launch``), write an exception that ends this process into
    the error file the launcher named, as torch's ``@record`` does for a script's ``main``.

    A rank that raises takes its peers down with it, on the broken connection, and the launcher may see a peer
    fail first. Each rank's own error in its file lets the launcher name the rank that caused it, and its error
    (:func:`runner.launch.failures.root_cause`), where the files would otherwise hold nothing. The hook chains to
    the one before it, so the traceback is printed as usual. A script that uses ``@record`` writes the same file.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or getattr(sys.excepthook, "_records_to", None) == error_file:
        return
    previous = sys.excepthook

    def hook(kind, error, trace) -> None:
        if not issubclass(kind, KeyboardInterrupt):  # torch's agent stopped it, or the user did
            record = {
                "message": {
                    "message": f"{kind.__name__}: {error}",
                    "extraInfo": {
                        "py_callstack": "".join(traceback.format_exception(kind, error, trace)),
                        "timestamp": str(int(time.time())),
                    },
                }
            }
            with contextlib.suppress(OSError), open(error_file, "w") as file:  # else the exit code is all it says
                json.dump(record, file)
        previous(kind, error, trace)

    hook._records_to = error_file
    sys.excepthook = hook


def _agent_store(env: DistributedEnvironment, timeout: timedelta | None) -> dist.Store:
    """The elastic agent's store, with keys of this restart attempt only.

    After an elastic restart the agent hands the new workers the same store; unprefixed, they would
    read the previous attempt's addresses (gloo: "connectFullMesh failed ... Connection refused").
    The first attempt has a fresh store and takes torch's own path.
    """
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=False,
        timeout=timeout or timedelta(minutes=30),
    )
    return dist.PrefixStore(f"/runner/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _destroy_process_group() -> None:
    """Tear the group down, and give gloo's threads a moment, before the interpreter finalizes.

    A gloo worker thread releases each finished collective's tensors after the caller has moved on;
    releasing a tensor that has a Python object takes the GIL, and a thread that asks for the GIL
    while the interpreter finalizes aborts the process ("terminate called without an active
    exception"). A short sleep, with the GIL released, lets a descheduled thread finish first. The
    runner's own workers leave without finalizing at all (runner.launch.worker.exit_without_finalizing).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.1)
