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
the same data in the same order carry the same one.

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
import socket
import subprocess
import sys
import types
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from runner.files import write_text_atomically

logger = logging.getLogger("runner")

PROVENANCE_DIR = "provenance"
RECORD_FORMAT = 1
COMMAND_ENV = "RUNNER_COMMAND"  # the command line the launching process read (JSON), for its workers' record
DIGEST_BATCHES_ENV = "RUNNER_DATA_DIGEST_BATCHES"  # how many of an attempt's first batches are digested (default 4)
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
_GIT_TIMEOUT_S = 20


def attempt_files(run_dir: str | os.PathLike) -> list[Path]:
    """The run's records, first launch first (none for a run written before records were kept)."""
    folder = Path(run_dir) / PROVENANCE_DIR
    found = []
    for path in folder.glob("attempt_*.json") if folder.is_dir() and not folder.is_symlink() else ():
        number = path.stem.removeprefix("attempt_")
        if number.isdigit() and not path.is_symlink():
            found.append((int(number), path))
    return [path for _, path in sorted(found)]


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


_written: Path | None = None  # this process's record, once written (rank 0 of the launch)
_pending: CodeVersions | None = None  # the git queries for its code versions, under way
_own_generators: list[dict[str, str]] = []  # see note_generators


def data_order(*, first_batch: int) -> DataOrder | None:
    """Where this launch's first batches are digested: None where this process wrote no record."""
    return DataOrder(_written, first_batch=first_batch) if _written is not None else None


def remember_command(argv: list[str]) -> None:
    """In the launching process: the command line, for the record its rank 0 writes (a worker may be another
    process, started by torch's launcher)."""
    os.environ[COMMAND_ENV] = json.dumps(list(argv))


def write(
    run_dir: Path,
    *,
    config: dict[str, Any],
    overrides: Iterable[str],
    resume: str | None,
    launch: dict[str, Any],
    hosts: list[str],
) -> Path:
    """Write the record of this launch as the run's next ``attempt_<n>.json``; returns its path.

    The git state of the code is asked of ``git`` processes that run while the run builds its model and data (no
    thread: the run forks helper processes meanwhile); :func:`wait` adds it to the record (the data-order digest
    does, before it writes).
    """
    global _written, _pending
    folder = run_dir / PROVENANCE_DIR
    folder.mkdir(exist_ok=True)
    number = len(attempt_files(run_dir)) + 1
    record = {
        "format": RECORD_FORMAT,
        "attempt": number,
        "started_at": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": _command(),
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
    }
    path = folder / f"attempt_{number}.json"
    write_text_atomically(path, json.dumps(record, indent=1) + "\n")
    _written, _pending = path, CodeVersions(config)
    return path


def wait() -> None:
    """Add the code's versions to this process's record, once its ``git`` processes are done (see :func:`write`)."""
    global _pending
    pending, _pending = _pending, None
    if pending is None or _written is None:
        return
    try:
        update(_written, code=pending.result())
    except (OSError, ValueError) as error:  # the record is a help, never a reason to stop training
        logger.warning("The launch record %s lacks its code versions (%s)", _written, error)


def update(path: Path, **fields: Any) -> None:
    """Set ``fields`` in the record at ``path``, rewritten whole (atomically)."""
    record = json.loads(path.read_text())
    record.update(fields)
    write_text_atomically(path, json.dumps(record, indent=1) + "\n")


def config_digest(config: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _command() -> list[str]:
    try:
        argv = json.loads(os.environ.get(COMMAND_ENV, "null"))
    except ValueError:
        argv = None
    argv = argv if isinstance(argv, list) else list(sys.argv)
    if argv and Path(str(argv[0])).name == "__main__.py":  # python -m runner
        return ["python", "-m", Path(str(argv[0])).parent.name, *argv[1:]]
    return [Path(str(argv[0])).name, *argv[1:]] if argv else argv


# ------------------------------------------------------------------------------------------------------ code
class CodeVersions:
    """The runner's version and git state, and each repository the config's code comes from (its ``_target_``s
    and recipe): its commit and a digest of what differs from it. The ``git`` processes start here;
    :meth:`result` collects them."""

    def __init__(self, config: dict[str, Any]) -> None:
        import runner

        self.version = runner.__version__
        runner_dir = Path(runner.__file__).resolve().parent
        self.runner = GitState(runner_dir)
        self.packages: dict[str, GitState] = {}
        for package in sorted(code_packages(config)):
            folder = _package_folder(package)
            if folder is not None and not folder.is_relative_to(runner_dir) and not _installed(folder):
                self.packages[package] = GitState(folder)  # else built in, the runner's, or an installed package

    def result(self) -> dict[str, Any]:
        repositories: dict[str, dict[str, Any]] = {}
        for package, query in self.packages.items():
            state = query.result()
            key = state.get("root") or state["path"]
            repositories.setdefault(key, {**state, "packages": []})["packages"].append(package)
        return {"runner": {"version": self.version, **self.runner.result()}, "repositories": repositories}


def code_packages(config: dict[str, Any]) -> set[str]:
    """The top-level packages the config's ``_target_``s, getter paths and recipe name (builtins left out)."""
    from runner.config import RECIPES
    from runner.folders.provenance import object_paths_in, targets_in

    names = [target for _, target in targets_in(config)] + [path for _, path in object_paths_in(config)]
    recipe = config.get("recipe")
    if isinstance(recipe, str) and recipe not in RECIPES:
        names.append(recipe)
    return {name.split(".")[0] for name in names if name and "." in name} - {"builtins"}


def _package_folder(package: str) -> Path | None:
    """Where a top-level package or module lives, found without importing it; None for a built-in one."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve().parent if spec.origin and os.path.isabs(spec.origin) else None


def _installed(folder: Path) -> bool:
    """Whether ``folder`` is inside an environment's installed packages (not a work tree installed editable)."""
    return any(part in ("site-packages", "dist-packages") for part in folder.parts)


class GitState:
    """``{"root", "commit", "dirty", "diff_sha256"}`` of the git work tree holding ``folder``, else ``{"path"}``:
    the digest covers the diff against the commit and the names of untracked files. Asked of three ``git``
    processes at once, started here."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        queries = (("rev-parse", "--show-toplevel", "HEAD"), ("diff", "HEAD", "--binary", "--no-ext-diff"),
                   ("ls-files", "--others", "--exclude-standard"))  # fmt: skip
        self.processes = []
        for args in queries:
            try:
                process = subprocess.Popen(["git", "-C", str(folder), *args], stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)  # fmt: skip
            except OSError:  # no git here
                process = None
            self.processes.append(process)

    def result(self) -> dict[str, Any]:
        outputs = []
        for process in self.processes:
            try:
                out, _ = process.communicate(timeout=_GIT_TIMEOUT_S) if process is not None else (None, None)
            except subprocess.TimeoutExpired:
                process.kill()
                out = None
            ok = process is not None and process.returncode == 0 and out is not None
            outputs.append(out.decode(errors="replace") if ok else None)
        head, diff, untracked = outputs
        lines = (head or "").split()
        if len(lines) != 2:
            return {"path": str(self.folder)}
        dirty = bool(diff or untracked)
        digest = hashlib.sha256(f"{diff}\0{untracked}".encode()).hexdigest() if dirty else None
        return {"root": lines[0], "commit": lines[1], "dirty": dirty, "diff_sha256": digest}


def installed_packages() -> dict[str, str]:
    """Every installed distribution's version, by name: read from the names of the ``*.dist-info`` and
    ``*.egg-info`` folders on ``sys.path`` (``torch-2.13.0.dist-info``), as ``importlib.metadata`` finds them, first
    one on the path winning, without reading each one's metadata."""
    versions: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            stem, dot, kind = name.rpartition(".")
            if dot and kind in ("dist-info", "egg-info"):
                project, _, version = stem.partition("-")
                if project and version:
                    versions.setdefault(project.lower().replace("_", "-"), version.partition("-")[0])
    return dict(sorted(versions.items()))


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


def this_host() -> str:
    return socket.gethostname()


# ------------------------------------------------------------------------------------------------ data order
class DataOrder:
    """Digests of the first training batches this process reads (rank 0's share of each step), added to the
    launch's record once they are read: each batch's tensors (dtype, shape and bytes) and other values, in order.

    How many: :data:`DIGEST_BATCHES`, or ``RUNNER_DATA_DIGEST_BATCHES`` (a count, or ``all``: ``runner check-resume``
    digests every batch of its runs, to find the first one that a resumed run reads differently).
    """

    def __init__(self, record: Path, *, first_batch: int) -> None:
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
        """Write what was digested into the record (the run may end before the wanted batches are read)."""
        wait()
        if not self.digests:
            return
        whole = hashlib.sha256("".join(self.digests).encode()).hexdigest()
        order = {"first_batch": self.first_batch, "digest": whole, "batches": self.digests}
        try:
            update(self.record, data_order=order, own_generators=list(_own_generators))
        except (OSError, ValueError) as error:  # the record is a help, never a reason to stop training
            logger.warning("The data-order digest was not written into %s (%s)", self.record, error)


def _digest_batches() -> float:
    value = os.environ.get(DIGEST_BATCHES_ENV, "")
    return math.inf if value == "all" else int(value) if value.isdigit() else DIGEST_BATCHES


def _feed(hasher, value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    elif isinstance(value, dict) or (hasattr(value, "keys") and hasattr(value, "__getitem__")):
        for key in value.keys():
            hasher.update(f"K{key}".encode())
            _feed(hasher, value[key])
    elif isinstance(value, (list, tuple)):
        hasher.update(f"L{len(value)}".encode())
        for item in value:
            _feed(hasher, item)
    else:
        hasher.update(f"V{value!r}".encode())


# ------------------------------------------------------------------------------------------ unsaved state
def note_generators(key: str, built: Any) -> None:
    """Remember each random-number generator of its own that the object built for config key ``key`` holds (in
    its attributes, its modules' or those of the objects they hold, two levels down). No checkpoint saves such a
    generator, so a resumed run draws from it afresh: the record lists them (``own_generators``), and ``runner
    check-resume`` names them when a resumed run reads or computes differently."""
    found = _generators_in(built, depth=2)
    if found:
        cls = f"{type(built).__module__}.{type(built).__qualname__}"
        _own_generators.extend({"key": key, "class": cls, "attribute": name, "type": kind} for name, kind in found)


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
