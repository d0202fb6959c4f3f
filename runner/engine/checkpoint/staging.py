"""What each rank writes into a checkpoint's staging folder, and how a failure while saving reaches every rank.

Shared by the save on one folder every rank sees (:mod:`runner.engine.checkpoint.checkpointer`) and the save of
a copy on each node's own disk (:mod:`runner.engine.checkpoint.node_local`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.manifest import file_entries
from runner.engine.checkpoint.manifest_schema import check_metadata
from runner.engine.checkpoint.serialization import save_safetensors
from runner.engine.checkpoint.torch_files import torch_save
from runner.engine.constants import (
    SCALER_NAME,
    SCHEDULER_NAME,
    custom_state_name,
    gradients_name,
    indexed_name,
    rng_state_name,
)
from runner.engine.ops import gather_object
from runner.engine.prepared import PreparedObjects
from runner.engine.rng import get_rng_state
from runner.files import fsync_path


def _save_object(obj: Any, path: Path) -> None:
    torch_save(obj, path, crc32=False)  # no CRC32: the manifest has its digest


@dataclass(frozen=True)
class StagingFolder:
    """The folder a checkpoint is written into before its commit: the ``CheckpointWriter`` the strategies
    write their state with. The engine's files and the strategies' go in through its methods (which
    record what this rank wrote, for it to hash); the save hooks write under :attr:`path` directly.

    The files are written in place: the folder is the unit that appears whole or not at all (its
    commit fsyncs all of it, then renames it), so a file in it needs no rename of its own. Each file
    is fsynced on a thread of this folder's as soon as it is written, so the disk writes one file
    while the next is written and the written ones are hashed; :meth:`synced` waits for them.
    """

    path: Path
    written: list[str] = field(default_factory=list)
    _syncing: list[Future] = field(default_factory=list, repr=False, compare=False)
    _syncer: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="runner-fsync"), repr=False, compare=False
    )

    def save_tensors(self, tensors: Mapping[str, torch.Tensor], name: str) -> None:
        save_safetensors(tensors, self.path / name)
        self._wrote(name)

    def save_object(self, obj: Any, name: str) -> None:
        _save_object(obj, self.path / name)
        self._wrote(name)

    def save_sharded(self, state: dict[str, Any], name: str) -> None:
        from runner.engine.checkpoint.sharded_state import save_dcp

        save_dcp(state, self.path / name)
        self.written.extend(own_shards(self.path / name, self.path))

    def entries(self, checksum: str) -> dict[str, dict[str, Any]]:
        """The manifest's entries (sizes and slice digests) of the files this rank wrote, once they are on disk:
        each rank hashes its own, while they are in its page cache, and rank 0 lists them (and hashes only what
        else is there)."""
        entries = file_entries(self.path, self.written, checksum)
        self.synced()
        return entries

    def synced(self) -> None:
        """Wait until every file written through this folder's methods is on disk.

        Raises:
            OSError: An fsync failed (the first such error; a disk that could not take the data, say).
        """
        pending, self._syncing[:] = list(self._syncing), []
        wait(pending)
        for future in pending:
            future.result()

    def _wrote(self, name: str) -> None:
        self.written.append(name)
        self._syncing.append(self._syncer.submit(fsync_path, self.path / name))


def own_shards(folder: Path, staging: Path) -> list[str]:
    """The files this rank's DCP writer wrote in ``folder`` (DCP names them ``__{rank}_{n}.distcp``)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return sorted(path.relative_to(staging).as_posix() for path in folder.glob(f"__{rank}_*.distcp"))


def write_files(
    staging: StagingFolder,
    prepared: PreparedObjects,
    *,
    models: Sequence[nn.Module],
    weights: Sequence[dict[str, torch.Tensor]] | None,
    mid_cycle: bool,
    writes_shared: bool | None = None,
) -> None:
    """This rank's share: the strategy's model and optimizer state, the rest on rank 0, RNG, gradients.

    ``writes_shared``: this rank writes what rank 0 writes (each node's local main process, see
    :mod:`runner.engine.checkpoint.node_local`); None: whether it is rank 0.
    """
    rank = prepared.env.rank
    writes_shared = rank == 0 if writes_shared is None else writes_shared
    # A collective under sharded strategies: every rank writes (or sends rank 0) its shards here.
    strategy_rank = 0 if writes_shared else rank
    prepared.strategy.save_model_state(staging, models, prepared.optimizers, weights=weights, rank=strategy_rank)
    if writes_shared:
        for i, scheduler in enumerate(prepared.schedulers):
            staging.save_object(scheduler.state_dict(), indexed_name(SCHEDULER_NAME, i, ".bin"))
        if prepared.scaler is not None:
            staging.save_object(prepared.scaler.state_dict(), SCALER_NAME)
        for i, obj in enumerate(prepared.custom_objects):
            staging.save_object(obj.state_dict(), custom_state_name(i))
    staging.save_object(get_rng_state(), rng_state_name(rank))
    if mid_cycle:
        staging.save_tensors(_gradients(models), gradients_name(rank))


def begin_save(prepared: PreparedObjects, metadata: dict[str, Any] | None) -> tuple[bool, dict[str, Any]]:
    """What every save does first on every rank: the strategy's checks, and the metadata checked and copied (the
    caller may change theirs once ``save_state`` returns). Returns whether the save falls between syncs, and the
    copy."""
    # Between syncs each rank holds gradients it has not shared yet: they are part of the state.
    mid_cycle = prepared.gradient_state.step % prepared.gradient_state.num_steps != 0
    prepared.strategy.check_save(mid_cycle=mid_cycle)
    metadata = metadata or {}
    check_metadata(metadata)
    return mid_cycle, json.loads(json.dumps(metadata))


def manifest_record(
    prepared: PreparedObjects,
    *,
    models: Sequence[nn.Module],
    weights: Sequence[dict[str, torch.Tensor]] | None,
    metadata: dict[str, Any],
    mid_cycle: bool,
    iteration: int | None,
    checksum: str,
    after_manifest: Callable[[Path], None] | None,
) -> dict[str, Any]:
    """The keywords of :func:`~runner.engine.checkpoint.manifest.write_manifest` every save shares, taken once the
    save hooks have run."""
    return {
        "world_size": prepared.env.world_size,
        "iteration": iteration,
        "state_format": prepared.strategy.checkpoint_format,
        "contents": contents(prepared, models=models, weights=weights, metadata=metadata, mid_cycle=mid_cycle),
        "metadata": metadata,
        "checksum": checksum,
        "after_manifest": after_manifest,
    }


def contents(
    prepared: PreparedObjects,
    *,
    models: Sequence[nn.Module],
    weights: Sequence[dict[str, torch.Tensor]] | None,
    metadata: dict[str, Any],
    mid_cycle: bool,
) -> dict[str, Any]:
    """What the checkpoint holds, for its manifest: loading checks the listed files against it."""
    return {
        "models": len(weights) if weights is not None else len(models),  # save hooks may have removed some
        "optimizers": len(prepared.optimizers),
        "schedulers": len(prepared.schedulers),
        "custom_objects": len(prepared.custom_objects),
        "dataloaders": len(metadata.get("dataloaders", [])),
        "scaler": prepared.scaler is not None,
        "gradients": mid_cycle,
    }


def share_outcome(failure: str | None, entries: dict[str, dict[str, Any]]) -> tuple[str | None, dict[str, dict]]:
    """The first failed rank's failure and every rank's file entries, told to every rank (a collective)."""
    gathered = gather_object([(failure, entries)])
    first = next((failed for failed, _ in gathered if failed), None)
    return first, {name: entry for _, listed in gathered for name, entry in listed.items()}


def first_failure(failure: str | None) -> str | None:
    """The first failed rank's failure, told to every rank (a collective when distributed)."""
    return next(filter(None, gather_object([failure])), None)


def raise_if_failed(
    failure: str | None, staging: Path, target: Path, rank: int, *, cause: Exception | None = None
) -> None:
    """Raise the one sentence for a failed save on every rank (rank 0 removes the staging folder); a rank whose own
    failure is not the disk's (``cause``: a hook's, or our bug) raises that exception instead, with its traceback."""
    if failure is None:
        return
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # free what the partial save took
    if cause is not None:
        raise cause
    raise CheckpointError(
        f"Saving {target.name} failed ({failure}); the checkpoints saved before it are intact, so free the space "
        "(or fix the folder) and resume from the newest of them."
    )


def _gradients(models: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": parameter.grad.detach()
        for i, model in enumerate(models)
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }


__all__ = ["StagingFolder", "contents", "first_failure", "raise_if_failed", "share_outcome", "write_files"]
