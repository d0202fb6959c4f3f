"""What made a run: one record per launch of it (the first, and each resume), written by rank 0 into the run folder.

<run>/provenance/attempt_1.json    the first launch
<run>/provenance/attempt_2.json    the first resume, and so on (an elastic restart within a launch writes none)

Each record (:func:`write`) holds the command and its overrides, the resume it continued from, the seed and the
config's digest (the config itself is ``.hydra/config.yaml`` and each checkpoint's ``config.yaml``), the code (the
git commit and a digest of the uncommitted changes of the runner and of every repository the config's ``_target_``s
and recipe come from), every installed package's version, Python, torch, CUDA and the numerics switches, the hosts
and the launch shape, and the values of a named list of environment variables that change what a run computes
(:data:`BEHAVIOUR_ENV`); no other variable is read into it, so nothing secret is. Once the run has read its first
training batches, rank 0 adds their digest (:class:`DataOrder`): what was read, in order, so two runs that read
the same data in the same order carry the same one; and the random generators the objects built from the config
keep of their own (:func:`note_generators`), which no checkpoint saves. The code's git state
(:mod:`runner.folders.code_versions`) is added once git has answered.

``runner runs``, ``runner diff`` and ``runner check-resume`` read these records; they are data (JSON), and nothing
in one is called or contacted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import re
import socket
import sys
import types
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from runner.files import write_text_atomically
from runner.folders.code_versions import CodeVersions, installed_packages

logger = logging.getLogger("runner")

PROVENANCE_DIR = "provenance"
RECORD_FORMAT = 1
DIGEST_BATCHES_ENV = "RUNNER_DATA_DIGEST_BATCHES"  # how many of a launch's first batches are digested (default 4)
DIGEST_BATCHES = 4

# The environment variables a record keeps: ones that change what a run computes or which code it imports. Any
# other (a token, a password, a tracker's key) is never read into it.
BEHAVIOUR_ENV = (
    "CUBLAS_WORKSPACE_CONFIG",
    "CUDA_LAUNCH_BLOCKING",
    "CUDA_VISIBLE_DEVICES",
    "HF_DATASETS_OFFLINE",
    "HF_HUB_OFFLINE",
    "MKL_DYNAMIC",
    "MKL_NUM_THREADS",
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NVIDIA_TF32_OVERRIDE",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
    "PYTHONPATH",
    "PYTORCH_CUDA_ALLOC_CONF",
    "RUNNER_DATA_DIGEST_BATCHES",
    "RUNNER_STOP_AT_STEP",
    "TOKENIZERS_PARALLELISM",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCH_DISTRIBUTED_DEBUG",
)


def attempt_files(run_dir: str | os.PathLike) -> list[Path]:
    """The run's records, first launch first (none for a run written before records were kept); links are not
    records."""
    return [path for _, path in _numbered(Path(run_dir) / PROVENANCE_DIR)]


def _numbered(folder: Path) -> list[tuple[int, Path]]:
    found = []
    for path in folder.glob("attempt_*.json") if folder.is_dir() and not folder.is_symlink() else ():
        number = path.stem.removeprefix("attempt_")
        if number.isdigit() and not path.is_symlink():
            found.append((int(number), path))
    return sorted(found)


def read_attempts(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of the run that reads as one (a JSON object), first launch first."""
    records = []
    for path in attempt_files(run_dir):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class LaunchRecord:
    """The record this launch is writing (rank 0's): its file, the code versions still being asked of git, and the
    random generators the built objects hold of their own."""

    def __init__(self, path: Path, code: CodeVersions) -> None:
        self.path, self.code = path, code
        self.own_generators: list[dict[str, str]] = []

    def complete(self, *, wait: bool = True) -> None:
        """Add the code's versions and the generators noted so far. The versions wait for git's answer (see
        :class:`~runner.folders.code_versions.CodeVersions`), or, with ``wait=False``, come only if it has answered
        already (the training loop must not wait on git: :func:`close` adds them at the launch's end)."""
        fields: dict[str, Any] = {"own_generators": self.own_generators}
        if self.code is not None and (wait or self.code.answered()):
            code, self.code = self.code, None
            fields["code"] = code.result()
        self.update(**fields)

    def update(self, **fields: Any) -> None:
        """Set ``fields`` in the record, rewritten whole (atomically); a failure is a warning, never a stop."""
        try:
            record = json.loads(self.path.read_text())
            record.update(fields)
            write_text_atomically(self.path, json.dumps(record, indent=1, default=str) + "\n")
        except (OSError, ValueError) as error:
            logger.warning("The launch record %s was not completed (%s)", self.path, error)


_current: LaunchRecord | None = None  # this process's launch, while it runs (rank 0 of the launch)


def write(
    run_dir: Path,
    *,
    config: dict[str, Any],
    overrides: Iterable[str],
    command: Iterable[str],
    resume: str | None,
    launch: dict[str, Any],
    hosts: list[str],
) -> LaunchRecord:
    """Write the record of this launch as the run's next ``attempt_<n>.json``: this process's launch from now on,
    until :func:`close`.

    The git state of the code is asked of ``git`` processes that run while the run builds its model and data (no
    thread: the run forks helper processes meanwhile); the data-order digest, or :func:`close`, adds it.
    """
    global _current
    _current = None
    folder = run_dir / PROVENANCE_DIR
    folder.mkdir(exist_ok=True)
    numbered = _numbered(folder)
    number = numbered[-1][0] + 1 if numbered else 1  # after the highest: a gap never makes it overwrite one
    record = {
        "format": RECORD_FORMAT,
        "attempt": number,
        "started_at": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": list(command),
        "cwd": os.getcwd(),
        "overrides": list(overrides),
        "resume": resume,
        "seed": config.get("seed"),
        "config_sha256": config_digest(config),
        "code": None,
        "packages": installed_packages(),
        "platform": platform_facts(),
        "launch": {**launch, "hosts": hosts},
        "environment": {name: os.environ[name] for name in BEHAVIOUR_ENV if name in os.environ},
        "data_order": None,
        "own_generators": [],
    }
    path = folder / f"attempt_{number}.json"
    write_text_atomically(path, json.dumps(record, indent=1, default=str) + "\n")
    _current = LaunchRecord(path, CodeVersions(config))
    return _current


def close() -> None:
    """This launch has ended: its record is completed, and nothing more is noted into it."""
    global _current
    current, _current = _current, None
    if current is not None:
        current.complete()


def data_order(*, first_batch: int) -> DataOrder | None:
    """Where this launch's first batches are digested: None where this process writes no record."""
    return DataOrder(_current, first_batch=first_batch) if _current is not None else None


def this_host() -> str:
    return socket.gethostname()


def config_digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------ platform
def platform_facts() -> dict[str, Any]:
    """Python, torch, CUDA and cuDNN, the accelerators, and the switches that change torch's numerics."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "system": platform.platform(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cpu_threads": torch.get_num_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


# ------------------------------------------------------------------------------------------------ data order
class DataOrder:
    """Digests of the first training batches this process reads (rank 0's share of each step), added to the
    launch's record once they are read: each batch's tensors and arrays (dtype, shape and bytes) and other values,
    in order.

    How many: :data:`DIGEST_BATCHES`, or ``RUNNER_DATA_DIGEST_BATCHES`` (a count, or ``all``: ``runner check-resume``
    digests every batch of its runs, to find the first one that a resumed run reads differently).
    """

    def __init__(self, record: LaunchRecord, *, first_batch: int) -> None:
        self.record, self.first_batch = record, first_batch
        self.wanted = _digest_batches()
        self.digests: list[str] = []

    @property
    def done(self) -> bool:
        return len(self.digests) >= self.wanted

    def add(self, batch: Any) -> None:
        """Digest one batch; write the record once the last wanted one is read."""
        import xxhash

        hasher = xxhash.xxh3_128()
        _feed(hasher, batch)
        self.digests.append(hasher.hexdigest())
        if self.done:
            self.flush()

    def flush(self) -> None:
        """Write what was digested into the record, with what else is known by now (the run may end before the
        wanted batches are read)."""
        self.record.complete(wait=False)
        if self.digests:
            whole = hashlib.sha256("".join(self.digests).encode()).hexdigest()
            self.record.update(data_order={"first_batch": self.first_batch, "digest": whole, "batches": self.digests})


def _digest_batches() -> float:
    value = os.environ.get(DIGEST_BATCHES_ENV, "")
    return math.inf if value == "all" else int(value) if value.isdigit() else DIGEST_BATCHES


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address, which differs from one run to the next


def _feed(hasher, value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, (str, bytes, int, float, bool, type(None))):
        hasher.update(f"V{value!r}".encode())
    elif isinstance(value, dict) or (hasattr(value, "keys") and hasattr(value, "__getitem__")):
        for key in value.keys():
            hasher.update(f"K{key}".encode())
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"L{len(value)}".encode())
        for item in value:
            _feed(hasher, item)
    elif hasattr(value, "__array__"):  # a numpy array, a PIL image: its values, not its repr
        import numpy

        array = numpy.ascontiguousarray(numpy.asarray(value))
        hasher.update(f"A{array.dtype}{array.shape}".encode())
        hasher.update(array.tobytes() if array.dtype != object else repr(array.tolist()).encode())
    else:
        hasher.update(f"V{_ADDRESS.sub('', repr(value))}".encode())


# ------------------------------------------------------------------------------------------ unsaved state
def note_generators(key: str, built: Any) -> None:
    """Remember each random-number generator of its own that the object built for config key ``key`` holds (in
    its attributes, its modules' or those of the objects they hold, two levels down). No checkpoint saves such a
    generator, so a resumed run draws from it afresh: the record lists them (``own_generators``), and ``runner
    check-resume`` names them when a resumed run reads or computes differently."""
    if _current is None:  # this process writes no record
        return
    found = _generators_in(built, depth=2)
    if found:
        cls = f"{type(built).__module__}.{type(built).__qualname__}"
        entries = ({"key": key, "class": cls, "attribute": name, "type": kind} for name, kind in found)
        _current.own_generators.extend(entries)


def _generator_type(value: Any) -> str | None:
    import random

    import torch

    if isinstance(value, random.Random):
        return "random.Random"
    if isinstance(value, torch.Generator):
        return "torch.Generator"
    numpy = sys.modules.get("numpy")  # a numpy generator exists only where numpy was imported
    if numpy is not None and isinstance(value, (numpy.random.Generator, numpy.random.RandomState)):
        return f"numpy.random.{type(value).__name__}"
    return None


_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial)


def _generators_in(obj: Any, *, depth: int, prefix: str = "") -> list[tuple[str, str]]:
    import torch

    found: list[tuple[str, str]] = []
    holders = [(prefix, obj)]
    if isinstance(obj, torch.nn.Module):
        holders = [(".".join(filter(None, (prefix, name))), module) for name, module in obj.named_modules()]
    for where, holder in holders:
        try:
            attributes = vars(holder)
        except TypeError:  # no __dict__: slots or a built-in
            continue
        for name, value in attributes.items():
            if name in ("_modules", "_parameters", "_buffers") or isinstance(value, (torch.Tensor, str, bytes)):
                continue
            shown = f"{where}.{name}" if where else name
            kind = _generator_type(value)
            if kind is not None:
                found.append((shown, kind))
            elif depth > 1 and hasattr(value, "__dict__") and not isinstance(value, _NOT_WALKED):
                found.extend(_generators_in(value, depth=depth - 1, prefix=shown))
    return found
