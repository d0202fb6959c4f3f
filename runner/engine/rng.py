"""Seeding and the capture/restore of every random number generator a training loop touches."""

from __future__ import annotations

import os
import random
from typing import Any

import torch

from runner.engine.distributed import DistributedEnvironment, read_environment

try:  # numpy is optional: torch does not need it, but many data pipelines draw from it.
    import numpy as np
except ImportError:  # pragma: no cover - numpy is present wherever tensorboard is
    np = None


def set_seed(
    seed: int,
    device_specific: bool = False,
    deterministic: bool = False,
    *,
    env: DistributedEnvironment | None = None,
) -> None:
    """Seed ``random``, ``numpy`` and ``torch`` (all devices).

    Args:
        seed: The seed.
        device_specific: Add this process's index (its rank), so each rank draws a different stream.
        deterministic: Also ask torch for deterministic algorithms (slower on GPU; errors where
            an operation has no deterministic implementation).
        env: Where this process runs (``accelerator.state``); by default read from the environment
            as an Accelerator reads it (see :func:`runner.engine.distributed.read_environment`).

    Example:
        >>> set_seed(42, device_specific=True)  # rank r seeds with 42 + r
    """
    if device_specific:
        # Only the rank is needed (cpu=True: LOCAL_RANK is not checked against the visible GPUs).
        seed += (env if env is not None else read_environment(cpu=True)).rank
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


def get_rng_state() -> dict[str, Any]:
    """This process's generator states, as plain values and tensors (loadable with weights_only)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


ALL_RNG_TYPES = ("python", "numpy", "torch", "cuda")


def set_rng_state(state: dict[str, Any], kinds: tuple[str, ...] | list[str] = ALL_RNG_TYPES) -> None:
    """Restore the ``kinds`` of generator that :func:`get_rng_state` captured."""
    if "python" in kinds:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in kinds:
        torch.set_rng_state(state["torch"])
    if "numpy" in kinds and np is not None and "numpy" in state:
        saved = state["numpy"]
        keys = saved["keys"].numpy().astype(np.uint32)
        np.random.set_state((saved["kind"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))
    if "cuda" in kinds and "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def synchronize_rng_states(rng_types: list[str], generator: torch.Generator | None = None) -> None:
    """Give every rank rank 0's state of the listed generators (a collective; every rank calls it).

    Args:
        rng_types: Any of ``"torch"``, ``"cuda"``, ``"python"``, ``"numpy"``, ``"generator"``.
        generator: The ``torch.Generator`` that ``"generator"`` synchronizes, as in Accelerate. Without
            ``"generator"`` in ``rng_types`` it is left alone; ``"generator"`` without one needs nothing
            (prepared loaders shuffle from a seed shared by all ranks).

    Raises:
        ValueError: For an entry of ``rng_types`` that names no generator.

    Example:
        >>> synchronize_rng_states(["torch", "generator"], generator=loader_generator)
    """
    import torch.distributed as dist

    unknown = set(rng_types) - {*ALL_RNG_TYPES, "generator"}
    if unknown:
        raise ValueError(f"rng_types has unknown entries {sorted(unknown)}; use {', '.join(ALL_RNG_TYPES)}, generator.")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    state = get_rng_state()
    syncs_generator = "generator" in rng_types and generator is not None
    if syncs_generator:
        state["generator"] = generator.get_state()
    # One broadcast for every kind. Whether it carries the generator is decided per rank, but every
    # rank calls this once either way, so the collectives still pair up.
    received = [state]
    dist.broadcast_object_list(received, src=0)
    set_rng_state(received[0], kinds=rng_types)
    if syncs_generator and "generator" in received[0]:
        generator.set_state(received[0]["generator"])
