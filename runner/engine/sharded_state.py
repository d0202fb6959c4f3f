"""Model and optimizer state through torch.distributed.checkpoint (DCP): FSDP's checkpoints.

Under FSDP every rank writes its own shards of each model (``model/``, ``model_1/``, ...) and
optimizer (``optimizer/``, ...) into the checkpoint's staging folder; DCP records in each folder's
``.metadata`` how the shards tile the full tensors, so loading reshards onto any number of
processes, and also into a plain (unsharded) model on one process. With ``FULL_STATE_DICT`` the
states are gathered to rank 0 on the CPU instead and written as without FSDP.

Every function here is a collective when a process group exists: every rank calls it, in the same
order.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.engine.constants import MODEL_NAME, OPTIMIZER_NAME


def _save(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.save(state, checkpoint_id=folder, no_dist=not _distributed())


def _load(state: dict, folder: Path) -> None:
    """DCP's load, with its failure (a BaseException carrying each rank's error) as one CheckpointError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from runner.engine.manifest import CheckpointError

    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=folder, no_dist=not _distributed())
    except CheckpointException as error:
        failure = next(iter(error.failures.values()))
        exception = failure[0] if isinstance(failure, tuple) else failure
        detail = str(exception).strip().splitlines()[0] if str(exception).strip() else type(exception).__name__
        raise CheckpointError(
            f"{folder} does not fit the prepared model or optimizer ({detail}); load a checkpoint of the same model."
        ) from None


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a case we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _options(full: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def owner_of(optimizer: torch.optim.Optimizer, models: Sequence[nn.Module]) -> nn.Module:
    """The model whose parameters ``optimizer`` updates (DCP names optimizer state by parameter name)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ValueError("An optimizer updates none of the prepared models' parameters; prepare its model too.")


def save_sharded(staging: Path, models: Sequence[nn.Module], optimizers: Sequence[Any], names) -> None:
    """Every rank writes its shards of each model and optimizer under ``staging``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for i, model in enumerate(models):
        _save({"model": get_model_state_dict(model, options=_options(False))}, staging / names(MODEL_NAME, i, ""))
    for i, optimizer in enumerate(optimizers):
        inner = optimizer.optimizer
        state = {"optimizer": get_optimizer_state_dict(owner_of(inner, models), inner, options=_options(False))}
        _save(state, staging / names(OPTIMIZER_NAME, i, ""))


def gather_full(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> tuple[list[dict], list[dict]]:
    """The full model and optimizer states, gathered to rank 0's CPU (the other ranks get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = [get_model_state_dict(model, options=_options(True)) for model in models]
    states = [
        get_optimizer_state_dict(owner_of(opt.optimizer, models), opt.optimizer, options=_options(True))
        for opt in optimizers
    ]
    return weights, states


def load_model(source: Path | dict[str, torch.Tensor], model: nn.Module) -> None:
    """Load a DCP folder, or a full state dict, into ``model`` (sharded or not)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if isinstance(source, dict):
        set_model_state_dict(model, source, options=_options(True))
        return
    state = {"model": get_model_state_dict(model, options=_options(False))}
    _load(state, source)
    set_model_state_dict(model, state["model"], options=_options(False))


def load_optimizer(source: Path | dict[str, Any], optimizer: Any, models: Sequence[nn.Module]) -> None:
    """Load a DCP folder, or a full optimizer state dict, into a prepared optimizer."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = optimizer.optimizer
    model = owner_of(inner, models)
    if isinstance(source, dict):
        set_optimizer_state_dict(model, inner, source, options=_options(True))
    else:
        state = {"optimizer": get_optimizer_state_dict(model, inner, options=_options(False))}
        _load(state, source)
        set_optimizer_state_dict(model, inner, state["optimizer"], options=_options(False))
    for group in inner.param_groups:  # torch's loader hands tuples (Adam's betas) back as lists
        for key, default in inner.defaults.items():
            if isinstance(default, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])
