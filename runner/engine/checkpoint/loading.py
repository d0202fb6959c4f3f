"""``load_state``'s path: a committed checkpoint, checked against the prepared objects, put back in place.

A checkpoint folder is data. Its manifest is checked first (see :mod:`runner.engine.checkpoint.manifest`), and
loading follows what it records, never the files it finds: the strategy that saved the models and
optimizers (``state_format``), how many objects of each kind, the world size. The prepared
strategy loads the model and optimizer state (see :mod:`runner.engine.parallel.base`); the rest is
the same under every strategy and is loaded here, reading tensors with safetensors and everything
else with ``torch.load(weights_only=True)`` (see :func:`runner.engine.checkpoint.torch_files.torch_load`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from runner.engine.checkpoint.manifest import (
    CheckpointError,
    VerifiedCheckpoint,
    first_mismatch,
    manifest_slices,
    read_manifest,
    share_of,
)
from runner.engine.checkpoint.serialization import load_safetensors
from runner.engine.checkpoint.staging import first_failure
from runner.engine.checkpoint.torch_files import torch_load
from runner.engine.constants import (
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    custom_state_name,
    gradients_name,
    indexed_name,
    rng_state_name,
)
from runner.engine.distributed import DistributedEnvironment
from runner.engine.prepared import PreparedObjects
from runner.engine.rng import set_rng_state, set_seed


@dataclass(frozen=True)
class ListedCheckpoint:
    """A committed checkpoint being loaded, as its manifest lists it (the strategies' ``CheckpointReader``)."""

    path: Path
    state_format: str
    files: Mapping[str, Any]  # the manifest's listing: name -> size and digests

    def require(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"{self.path} has no {name}; prepare the same objects as the run that saved it.")
        return self.path / name

    def listed_in(self, folder: str) -> set[str]:
        return {name[len(folder) + 1 :] for name in self.files if name.startswith(f"{folder}/")} - {DCP_METADATA_NAME}

    def load_tensors(self, name: str) -> dict[str, torch.Tensor]:
        try:
            return load_safetensors(self.path / name)
        except SafetensorError as error:  # its digest matches the manifest, so whoever wrote the manifest wrote it so
            raise CheckpointError(
                f"{self.path / name} is not a safetensors file ({error}); the checkpoint is damaged, so load a "
                "different checkpoint."
            ) from None

    def load_object(self, name: str, *, mapped: bool = False) -> Any:
        return torch_load(self.path / name, mapped=mapped)


def load_training_state(
    checkpoint: Path,
    prepared: PreparedObjects,
    *,
    models: Sequence[nn.Module],
    verify_checksums: bool = True,
    verified: VerifiedCheckpoint | None = None,
) -> dict[str, Any]:
    """Restore the prepared objects in place from a committed checkpoint folder.

    On the world size it was saved with, every rank gets its own RNG streams back. On another, the
    streams are re-derived from the checkpoint (deterministically, one per rank), and a checkpoint
    saved in the middle of a gradient accumulation cycle is refused: its pending gradients belong
    to the ranks that computed them.

    Args:
        models: The prepared models to load into, unwrapped (load_state's pre-hooks may have left some out).
        verified: A save already verified (see :func:`verify_together`).

    Returns:
        The checkpoint's manifest.

    Raises:
        CheckpointError: The folder is incomplete or damaged, or holds a different set of objects, or is
            one node's copy (``save_on_each_node``) without this rank's files.
    """
    manifest = read_manifest(checkpoint, verify_checksums=False)
    try:
        check_own_files(checkpoint, manifest, prepared.env)
    except CheckpointError:
        if verify_checksums:  # a collective: this rank still hashes its share for the others, then raises its own
            verify_together(checkpoint, manifest, prepared.env, verified=verified)
        raise
    if verify_checksums:
        verify_together(checkpoint, manifest, prepared.env, verified=verified)
    saved = ListedCheckpoint(checkpoint, manifest["state_format"], manifest["files"])
    prepared.strategy.check_load(saved)
    mid_cycle = _check_fits(checkpoint, manifest, prepared, models)
    prepared.strategy.load_model_state(saved, models, prepared.optimizers)
    for i, scheduler in enumerate(prepared.schedulers):
        name = indexed_name(SCHEDULER_NAME, i, ".bin")
        saved.require(name)
        scheduler.load_state_dict(saved.load_object(name))
    if prepared.scaler is not None and manifest["contents"]["scaler"]:
        prepared.scaler.load_state_dict(saved.load_object(SCALER_NAME))
    for i, obj in enumerate(prepared.custom_objects):
        name = custom_state_name(i)
        if name not in saved.files:
            raise CheckpointError(f"{checkpoint} has no {name} for registered object {i}; register the same objects.")
        obj.load_state_dict(saved.load_object(name))
    rank = prepared.env.rank
    if manifest["world_size"] == prepared.env.world_size:
        set_rng_state(saved.load_object(rng_state_name(rank)))
    else:
        derive_rng_state(saved.load_object(rng_state_name(0)), rank)
    if mid_cycle:
        _load_gradients(saved.load_tensors(gradients_name(rank)), models)
    return manifest


def verify_together(
    checkpoint: Path,
    manifest: dict[str, Any],
    env: DistributedEnvironment,
    *,
    node_ranks: Sequence[int] | None = None,
    verified: VerifiedCheckpoint | None = None,
) -> None:
    """Every file's digests checked once in all: each rank hashes its own files and an equal share of the
    ones every rank reads, then all learn every rank's verdict (a collective).

    Args:
        node_ranks: The ranks that share this node's copy (``save_on_each_node``): they split it among them.
        verified: A save already verified (by the launching process, or by these ranks after a restart): when it
            is this very one, nothing is hashed again.

    Raises:
        CheckpointError: On every rank, naming the first damaged file and its byte range.
    """
    ranks = list(range(env.world_size)) if node_ranks is None else list(node_ranks)
    owners = {rng_state_name(rank): i for i, rank in enumerate(ranks)}
    owners |= {gradients_name(rank): i for i, rank in enumerate(ranks)}
    failure, bug = None, None
    if verified is None or not verified.covers(checkpoint, manifest):
        mine = share_of(manifest_slices(manifest), rank=ranks.index(env.rank), ranks=len(ranks), owners=owners)
        try:
            failure = first_mismatch(checkpoint, manifest, mine)
        except Exception as error:  # every rank must still meet the others below; this one raises its own after
            failure, bug = f"rank {env.rank}: {type(error).__name__}: {error}", error
    failure = first_failure(failure)
    if bug is not None:
        raise bug
    if failure is not None:
        raise CheckpointError(failure)


def newest_verified_checkpoint(
    directory: Path, env: DistributedEnvironment
) -> tuple[VerifiedCheckpoint | None, list[tuple[Path, CheckpointError]]]:
    """The newest committed checkpoint in ``directory`` whose files match its manifest, verified by every rank
    together (each slice once, see :func:`verify_together`; a collective), and the newer damaged ones skipped.
    Loading the one found with it (``Accelerator.mark_verified``) does not hash it again."""
    from runner.engine.checkpoint.folders import committed_checkpoints

    skipped = []
    for checkpoint in reversed(committed_checkpoints(directory)):
        try:
            manifest = read_manifest(checkpoint, verify_checksums=False)
            verify_together(checkpoint, manifest, env)
        except CheckpointError as error:  # alike on every rank: they all skip it
            skipped.append((checkpoint, error))
            continue
        return VerifiedCheckpoint.of(checkpoint, manifest), skipped
    return None, skipped


def check_own_files(checkpoint: Path, manifest: dict[str, Any], env: DistributedEnvironment) -> None:
    """A node's copy (``save_on_each_node``) holds the RNG states (and pending gradients) of its own ranks only."""
    ranks = manifest.get("node_local_ranks")
    if ranks is None:
        return  # every rank's files: a checkpoint of a shared folder
    if manifest["world_size"] != env.world_size or rng_state_name(env.rank) not in manifest["files"]:
        raise CheckpointError(
            f"{checkpoint} is one node's copy of a checkpoint of {manifest['world_size']} process(es), holding the "
            f"files of ranks {ranks}, and rank {env.rank} of {env.world_size} needs its own; resume every node "
            "from its own copy, with the same world size and node layout."
        )


def _check_fits(checkpoint: Path, manifest: dict[str, Any], prepared: PreparedObjects, models: Sequence) -> bool:
    """Refuse a checkpoint of other models, or one whose pending gradients this run cannot take; return whether
    it was saved in the middle of an accumulation cycle."""
    saved_world, saved_steps = manifest["world_size"], manifest.get("accumulation_steps")
    mid_cycle = manifest.get("accumulation_step", 0) % manifest.get("accumulation_steps", 1) != 0
    if mid_cycle and (saved_world != prepared.env.world_size or saved_steps != prepared.gradient_state.num_steps):
        raise CheckpointError(
            f"{checkpoint} was saved in the middle of a gradient accumulation cycle by {saved_world} process(es) "
            f"with gradient_accumulation_steps={saved_steps}; resume it with the same settings, or save at a cycle "
            "boundary to change them."
        )
    if manifest["contents"]["models"] != len(models):
        raise CheckpointError(
            f"{checkpoint} holds {manifest['contents']['models']} model(s) but {len(models)} were prepared; prepare "
            "the same models as the run that saved it."
        )
    return mid_cycle


def derive_rng_state(saved: dict[str, Any], rank: int) -> None:
    """Seed every generator of this rank from a saved state and the rank: reproducible, distinct per rank."""
    digest = hashlib.sha256(saved["torch"].numpy().tobytes() + rank.to_bytes(4, "little")).digest()
    set_seed(int.from_bytes(digest[:8], "little") % 2**63)


def _load_gradients(gradients: dict[str, torch.Tensor], models: Sequence[nn.Module]) -> None:
    for i, model in enumerate(models):
        for name, parameter in model.named_parameters():
            saved = gradients.get(f"{i}.{name}")
            parameter.grad = None if saved is None else saved.to(parameter.device, parameter.dtype)


def restore_engine_metadata(
    manifest: dict[str, Any], checkpoint: Path, loaders: Sequence[Any], optimizers: Sequence[Any], gradient_state: Any
) -> None:
    """Put back what :func:`runner.engine.checkpoint.checkpointer.engine_metadata` recorded."""
    positions = manifest.get("dataloaders", [])
    if len(positions) != len(loaders):
        raise CheckpointError(
            f"{checkpoint} records {len(positions)} dataloader(s) but {len(loaders)} were prepared; "
            "prepare the same dataloaders as the run that saved it."
        )
    for index, (loader, position) in enumerate(zip(loaders, positions, strict=True)):
        try:
            loader.load_state_dict(position)
        except CheckpointError as error:  # a stream state no data can have: name the file it came from
            raise CheckpointError(f"{checkpoint / MANIFEST_NAME} dataloaders[{index}].{error}") from None
    for optimizer, steps in zip(optimizers, manifest.get("optimizer_steps", []), strict=False):
        optimizer.steps = steps
    gradient_state.step = manifest.get("accumulation_step", 0)
