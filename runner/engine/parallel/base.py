"""The interface every parallel strategy implements, and what the strategies that replicate the model share.

A strategy owns its models' and optimizers' state on disk: ``save_state`` hands it the checkpoint
folder being written (a :class:`CheckpointWriter`) and ``load_state`` the committed folder being
read (a :class:`CheckpointReader`); the strategy decides how the state is gathered or sharded and
which files hold it, and reports that as its ``checkpoint_format``, which the manifest records.
Everything else in a checkpoint (schedulers, scaler, RNG states, registered objects, data position)
is the same under every strategy and stays with :mod:`runner.engine.checkpoint.checkpointer`.

The replicated format (``"safetensors"``): ``model.safetensors``, ``model_1.safetensors``, ... and
``optimizer.bin``, ``optimizer_1.bin``, ... written by rank 0. Replicated strategies write and
read it with the functions below; FSDP writes it too under ``FULL_STATE_DICT``, after gathering.
Every strategy reads the sharded format (``"dcp"``, FSDP's and pipeline stages') by parameter name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.torch_files import copied_out
from runner.engine.constants import DCP_METADATA_NAME, MODEL_NAME, OPTIMIZER_NAME, indexed_name


class CheckpointWriter(Protocol):
    """A checkpoint folder being saved (under its temporary name): every file goes in through it."""

    path: Path

    def save_tensors(self, tensors: Mapping[str, torch.Tensor], name: str) -> None:
        """Write ``tensors`` as the safetensors file ``name`` (tied tensors stored once)."""

    def save_object(self, obj: Any, name: str) -> None:
        """Write ``obj`` (plain values and tensors) with ``torch.save`` as the file ``name``, atomically."""

    def save_sharded(self, state: dict[str, Any], name: str) -> None:
        """Write every rank's shards of ``state`` with torch.distributed.checkpoint as the folder ``name`` (a
        collective)."""


class CheckpointReader(Protocol):
    """A committed checkpoint being loaded: only data, and only the files its manifest lists, are read."""

    path: Path
    state_format: str  # the checkpoint_format of the strategy that saved it

    def require(self, name: str) -> Path:
        """``path / name``; a CheckpointError when the manifest does not list it (other objects were saved)."""

    def listed_in(self, folder: str) -> set[str]:
        """The files the manifest lists in a DCP ``folder`` (its ``.metadata`` aside), relative to it."""

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The safetensors file ``name``, on the CPU."""

    def load_object(self, name: str, *, mapped: bool = False) -> Any:
        """The ``torch.save`` file ``name``, read with ``weights_only=True``, on the CPU."""


class ParallelStrategy(Protocol):
    name: str
    # How save_state writes models and optimizers, recorded in the manifest as its state_format:
    # "safetensors" (whole state dicts, written by rank 0) or "dcp" (every rank's shards).
    checkpoint_format: str

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """Return ``model`` (already on its device) ready for parallel training."""

    def preparing_models(
        self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
    ) -> contextlib.AbstractContextManager:
        """A context in which ``prepare`` wraps ``models``; after it, ``optimizers`` built from them hold
        the wrapped models' parameters (FSDP replaces every parameter; replicated strategies keep them)."""

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """A context in which backward accumulates local gradients without communicating."""

    def full_state_dict(self, model: nn.Module) -> dict:
        """The whole model's state dict, without the wrappers' prefixes (a collective when sharded)."""

    def total_norm(self, norm):
        """The gradients' total norm as clip_grad_norm_ returned it, as a plain tensor."""

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip ``parameters``' gradients by the total norm of the model's gradients; return that norm."""

    def checkpoint_weights(self, models: Sequence[nn.Module]) -> list[dict[str, torch.Tensor]] | None:
        """What save_state's pre-hooks may edit of each (unwrapped) model before the save writes it (removing an
        entry leaves that model out), or None where the weights are shards the save gathers or writes itself
        (the hooks then get an empty list, and every model is saved)."""

    def check_save(self, *, mid_cycle: bool) -> None:
        """Raise CheckpointError if this strategy cannot save now (``mid_cycle``: an accumulation cycle is open)."""

    def save_model_state(
        self,
        folder: CheckpointWriter,
        models: Sequence[nn.Module],
        optimizers: Sequence[Any],
        *,
        weights: Sequence[dict[str, torch.Tensor]] | None,
        rank: int,
    ) -> None:
        """Write the models' and (prepared) optimizers' state into ``folder``, in ``checkpoint_format``.

        Every rank calls it (a collective when the state is sharded); ``weights`` is what
        :meth:`checkpoint_weights` returned, after the hooks.
        """

    def check_load(self, checkpoint: CheckpointReader) -> None:
        """Raise CheckpointError if this strategy cannot load the checkpoint's ``state_format``."""

    def load_model_state(
        self, checkpoint: CheckpointReader, models: Sequence[nn.Module], optimizers: Sequence[Any]
    ) -> None:
        """Load the checkpoint's model and optimizer state into ``models`` and ``optimizers`` (every rank calls it).

        Raises:
            CheckpointError: A file is not listed, or does not fit the prepared model.
        """


class ReplicatedModelStrategy:
    """What strategies that keep a whole model on every rank share: its checkpoints hold whole state dicts."""

    checkpoint_format = "safetensors"

    def full_state_dict(self, model: nn.Module) -> dict:
        return unwrap_module(model).state_dict()

    @staticmethod
    def total_norm(norm):
        return norm

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.total_norm(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))

    def preparing_models(
        self, models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
    ) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # wrapping keeps every parameter: the optimizers already hold them

    def checkpoint_weights(self, models: Sequence[nn.Module]) -> list[dict[str, torch.Tensor]]:
        return [model.state_dict() for model in models]

    def check_save(self, *, mid_cycle: bool) -> None:
        pass  # pending gradients are whole on every rank, and saved per rank

    def save_model_state(
        self,
        folder: CheckpointWriter,
        models: Sequence[nn.Module],
        optimizers: Sequence[Any],
        *,
        weights: Sequence[dict[str, torch.Tensor]] | None,
        rank: int,
    ) -> None:
        if rank != 0:
            return  # every rank holds the same state: the main process writes it
        weights = weights if weights is not None else [model.state_dict() for model in models]
        save_whole_state(folder, weights, [optimizer.state_dict() for optimizer in optimizers])

    def check_load(self, checkpoint: CheckpointReader) -> None:
        pass  # whole states load as they are; sharded ones (FSDP's, pipeline stages') are read whole, by name

    def load_model_state(
        self, checkpoint: CheckpointReader, models: Sequence[nn.Module], optimizers: Sequence[Any]
    ) -> None:
        if checkpoint.state_format == "dcp":
            load_sharded_state(checkpoint, [unwrap_module(model) for model in models], optimizers)
            return
        for i, model in enumerate(models):
            _load_whole_model(checkpoint, indexed_name(MODEL_NAME, i, ".safetensors"), model)
        for i, optimizer in enumerate(optimizers):
            load_whole_optimizer(checkpoint, i, optimizer)


def load_sharded_state(
    checkpoint: CheckpointReader, models: Sequence[nn.Module], optimizers: Sequence[Any], **optimizer_options: Any
) -> None:
    """Load a DCP checkpoint's model and optimizer state into ``models`` and ``optimizers`` by parameter name,
    resharded onto however they are held (whole, sharded, cut into stages); ``optimizer_options`` go to
    :func:`runner.engine.checkpoint.sharded_state.load_optimizer`.

    Raises:
        CheckpointError: A file is not listed, or the state does not fit the prepared models.
    """
    from runner.engine.checkpoint import sharded_state

    for i, model in enumerate(models):
        folder = indexed_name(MODEL_NAME, i, "")
        with refused_unless_it_fits(checkpoint.path / folder):
            sharded_state.load_model(checkpoint.path / folder, model, listed=checkpoint.listed_in(folder))
    for i, optimizer in enumerate(optimizers):
        folder = indexed_name(OPTIMIZER_NAME, i, "")
        checkpoint.require(f"{folder}/{DCP_METADATA_NAME}")
        with refused_unless_it_fits(checkpoint.path / folder):
            sharded_state.load_optimizer(
                checkpoint.path / folder, optimizer, models, listed=checkpoint.listed_in(folder), **optimizer_options
            )


@contextlib.contextmanager
def refused_unless_it_fits(folder: Path) -> Iterator[None]:
    """Turn torch's errors for a state that does not fit the prepared model into one sentence naming ``folder``."""
    try:
        yield
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError) as error:
        raise does_not_fit(folder, error) from None


def save_whole_state(
    folder: CheckpointWriter, weights: Sequence[dict[str, torch.Tensor]], optimizer_states: Sequence[dict]
) -> None:
    """Write whole model and optimizer states in the replicated format (on the rank that holds them)."""
    for i, state_dict in enumerate(weights):
        folder.save_tensors(state_dict, indexed_name(MODEL_NAME, i, ".safetensors"))
    for i, optimizer_state in enumerate(optimizer_states):
        folder.save_object(optimizer_state, indexed_name(OPTIMIZER_NAME, i, ".bin"))


def load_optimizer_file(checkpoint: CheckpointReader, index: int, *, mapped: bool = False) -> dict:
    """Optimizer ``index``'s whole state, from a checkpoint in the replicated format (``mapped``: see
    :func:`runner.engine.checkpoint.torch_files.torch_load`)."""
    name = indexed_name(OPTIMIZER_NAME, index, ".bin")
    checkpoint.require(name)
    return checkpoint.load_object(name, mapped=mapped)


def load_whole_optimizer(checkpoint: CheckpointReader, index: int, optimizer: Any) -> None:
    """Load optimizer ``index``'s whole state into ``optimizer``, its tensors copied into the ones it holds.

    torch's ``load_state_dict`` checks the saved state against the optimizer and takes its tensors as
    they are; they are views of the file's memory map here, so they are then copied into the state
    tensors the optimizer held before (no new memory, none of the file's pages kept), or into new
    memory where it held none of that shape.
    """
    held = {(id(parameter), key): value for parameter, state in optimizer.state.items() for key, value in state.items()}
    optimizer.load_state_dict(load_optimizer_file(checkpoint, index, mapped=True))
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = copied_out(value, held.get((id(parameter), key)))


def _load_whole_model(checkpoint: CheckpointReader, name: str, model: nn.Module) -> None:
    state_dict = checkpoint.load_tensors(name)
    path = checkpoint.path / name
    try:
        result = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as error:  # shape mismatches raise even when not strict
        raise does_not_fit(path, error) from None
    if result.missing_keys or result.unexpected_keys:
        detail = f"missing keys: {result.missing_keys[:5]}, unexpected keys: {result.unexpected_keys[:5]}"
        raise does_not_fit(path, detail)


def does_not_fit(path: Path, error: BaseException | str) -> CheckpointError:
    """The one sentence for a saved state that does not fit the prepared model: the path and torch's reason."""
    if isinstance(error, BaseException):
        text = str(error).strip()
        error = text.splitlines()[-1].strip() if text else type(error).__name__
    return CheckpointError(f"{path} does not fit the prepared model ({error}); load a checkpoint of the same model.")


def unwrap_module(model: nn.Module) -> nn.Module:
    """Peel parallel wrappers (``.module``: DDP's, a pipelined model's) and torch.compile (``._orig_mod``) off
    ``model``."""
    while True:
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel) or getattr(
            type(model), "holds_stages", False
        ):
            model = model.module  # a pipelined model's: its stages' rank module, under the model's names
        else:
            return model
