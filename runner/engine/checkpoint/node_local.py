"""save_state/load_state with ``ProjectConfiguration(save_on_each_node=True)``: a copy on each node's own disk.

Accelerate allows ``project_dir`` (or ``output_dir``) to be a folder on each node's local disk,
under the same path on every node. Then each node's local main process (``LOCAL_RANK`` 0) owns its
node's copy of the checkpoint: it creates the staging folder the ranks of its node write into,
writes the files rank 0 writes on a shared filesystem (the replicated model and optimizer state,
schedulers, scaler, registered objects: every replica holds the same), and commits the copy. Every
rank writes its own RNG states (and pending gradients) into its node's copy; the manifest lists
the ranks whose files the copy holds (``node_local_ranks``). Only replicated strategies can do
this: FSDP's state is written by rank 0 alone, so it is refused.

The commit is two-phase, so that a failure on one node commits nothing on any node and deletes
nothing: (a) every owner writes its node's manifest and syncs the folder to disk; any failure and
every owner removes its staging folder. (b) every owner renames its staging folder into place,
keeping the checkpoint it replaces (an explicit ``output_dir`` saved before) aside; any failure and
the owners that renamed put the old state back. (c) only once every node holds the new checkpoint
do the owners delete what it replaced and rotate (``total_limit``) their node's folders. Each
phase ends in a gather every rank takes part in, so every rank raises the same sentence and none
waits forever; a background save (``async_save``) is refused, since the phases need every rank.

On load, every rank reads its own node's copy: every rank learns of any rank's failure, and the
ranks must agree on the checkpoint's name, step and iteration (each node's newest may differ, or
each node may have been given another folder), or every rank refuses. A copy resumes on the same
world size and node layout that saved it: each rank needs its own RNG file from its node's copy.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.engine.checkpoint import manifest as manifests
from runner.engine.checkpoint.async_saves import AsyncSave
from runner.engine.checkpoint.errors import CheckpointError, CheckpointNotFoundError
from runner.engine.checkpoint.folders import (
    ProjectConfiguration,
    check_writable_target,
    checkpoint_number,
    failure_reason,
    next_automatic_checkpoint,
    remove_folder,
    rename_into_place,
    staging_dir,
)
from runner.engine.checkpoint.folders import checkpoint_to_load as find_checkpoint
from runner.engine.checkpoint.loading import load_training_state as load_whole_state
from runner.engine.checkpoint.loading import restore_engine_metadata, verify_together
from runner.engine.checkpoint.manifest import VerifiedCheckpoint, read_manifest
from runner.engine.checkpoint.staging import (
    StagingFolder,
    begin_save,
    first_failure,
    manifest_record,
    raise_if_failed,
    write_files,
)
from runner.engine.constants import CHECKPOINT_PREFIX
from runner.engine.distributed import DistributedEnvironment
from runner.engine.ops import gather_object
from runner.engine.parallel.base import ReplicatedModelStrategy
from runner.engine.prepared import PreparedObjects
from runner.files import fsync_path, sync_tree


@dataclass(frozen=True)
class Node:
    """The ranks that share this rank's node (and its disk), and the one among them that owns the copy.

    Attributes:
        owner: The node's local main process (``LOCAL_RANK`` 0): it commits the node's copy.
        ranks: Every rank of the node, ascending (launchers number a node's ranks consecutively).
    """

    owner: int
    ranks: tuple[int, ...]


def node_of(env: DistributedEnvironment) -> Node:
    """This rank's node, from every rank's ``rank - LOCAL_RANK`` (a collective).

    Raises:
        ValueError: The launcher's LOCAL_RANKs do not number each node's ranks from 0 (on every rank).
    """
    owners = gather_object([env.rank - env.local_rank])
    wrong = next((rank for rank, owner in enumerate(owners) if owner < 0 or owners[owner] != owner), None)
    if wrong is not None:
        raise ValueError(
            f"save_on_each_node needs each node's ranks numbered consecutively from its LOCAL_RANK 0, but rank {wrong} "
            f"has LOCAL_RANK {wrong - owners[wrong]}; start the workers with torchrun (or runner launch)."
        )
    owner = owners[env.rank]
    return Node(owner, tuple(rank for rank, theirs in enumerate(owners) if theirs == owner))


def check_save(prepared: PreparedObjects, *, mode: AsyncSave) -> None:
    """Refuse what a node-local save cannot do; every rank decides alike, before any collective."""
    _check_replicated(prepared, verb="save_state")
    if mode is not AsyncSave.NONE:
        raise ValueError(
            f"save_state(async_save={mode.value!r}) cannot be used with ProjectConfiguration(save_on_each_node=True): "
            "each node commits only once every node has written and renamed its copy, which needs every rank; pass "
            "async_save=False."
        )


def check_load(prepared: PreparedObjects) -> None:
    """Refuse what a node-local load cannot do; every rank decides alike, before any collective."""
    _check_replicated(prepared, verb="load_state")


def _check_replicated(prepared: PreparedObjects, *, verb: str) -> None:
    if not isinstance(prepared.strategy, ReplicatedModelStrategy):
        raise ValueError(
            f"{verb} under FSDP cannot use ProjectConfiguration(save_on_each_node=True): rank 0 alone writes the "
            "sharded state's metadata (or the gathered state), so the other nodes' copies would lack it; put "
            "project_dir on a filesystem every node sees and leave save_on_each_node off."
        )


def alike_on_every_rank(action: Callable[[], Any], *, doing: str) -> Any:
    """``action()`` on every rank, or an error on every rank if it failed on any (a collective).

    The failed rank raises its own exception; the others a CheckpointError naming it (a
    CheckpointNotFoundError when that is what it raised), so no rank waits in a later collective.
    """
    try:
        result, failure = action(), None
    except Exception as error:  # any kind: a rank that raised alone would leave the others waiting
        result, failure = error, (type(error).__name__, str(error))
    reports = gather_object([failure])
    if failure is not None:
        raise result
    failed = next((rank for rank, report in enumerate(reports) if report is not None), None)
    if failed is not None:
        kind, message = reports[failed]
        error_type = CheckpointNotFoundError if kind == CheckpointNotFoundError.__name__ else CheckpointError
        raise error_type(f"Rank {failed} could not {doing} ({kind}: {message})")
    return result


def target(config: ProjectConfiguration, output_dir: str | os.PathLike | None) -> Path:
    """The checkpoint folder, the same path on every rank (a collective).

    Under automatic naming each node's copy of ``project_dir`` may hold other numbers: every rank
    takes the largest number any of them chose, so no node overwrites a folder and all agree. As on
    a shared folder, ``config.iteration`` becomes that number (the manifest records it).
    """
    if config.automatic_checkpoint_naming:
        if output_dir is not None:
            warnings.warn("save_state(output_dir) is ignored under automatic_checkpoint_naming.", stacklevel=4)
        own = alike_on_every_rank(lambda: next_automatic_checkpoint(config), doing="name the checkpoint")
        number = max(gather_object([checkpoint_number(own)]))
        config.iteration = number
        return own.with_name(f"{CHECKPOINT_PREFIX}{number}")
    if output_dir is None:
        raise ValueError(
            "save_state() needs an output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)."
        )
    chosen = Path(output_dir)
    alike_on_every_rank(lambda: check_writable_target(chosen), doing=f"save to {chosen}")  # each node's copy differs
    return chosen


def save_training_state(
    target: Path,
    prepared: PreparedObjects,
    *,
    models: Sequence[nn.Module],
    weights: Sequence[dict[str, torch.Tensor]] | None = None,
    iteration: int | None = None,
    metadata: dict[str, Any] | None = None,
    before_write: Callable[[Path], None] | None = None,
    after_manifest: Callable[[Path], None] | None = None,
    after_commit: Callable[[], None] | None = None,
    checksum: str = manifests.DEFAULT_CHECKSUM,
) -> None:
    """Write and commit this node's copy of ``target``, in the phases of the module docstring.

    Every rank calls this with the same arguments, after :func:`check_save`. The arguments are
    :func:`runner.engine.checkpoint.checkpointer.save_training_state`'s; ``before_write`` runs on every rank,
    ``after_manifest`` on each node's owner once its manifest is written, and ``after_commit`` on each node's owner
    once every node has committed.

    Raises:
        CheckpointError: A rank failed to write, or an owner to commit (every rank raises the same
            sentence; no node holds the new checkpoint, and nothing older was deleted).
    """
    mid_cycle, metadata = begin_save(prepared, metadata)
    node = node_of(prepared.env)
    rank, owns = prepared.env.rank, prepared.env.rank == node.owner
    staging = StagingFolder(staging_dir(target))
    fail = _Failure(staging.path, target, rank=rank, owns=owns)

    # Each owner's staging folder exists before any write, and is its node's alone (or every rank refuses).
    fail.if_any(_attempt(lambda: _remove_leftover(staging.path)) if owns else None)  # left by a crashed save
    marker = staging.path / f"{_OWNER_MARKER}{rank}"
    fail.if_any(_attempt(lambda: _mark(marker)) if owns else None)
    sharing: list[str | None] = []
    fail.if_any(_attempt(lambda: sharing.append(_other_owners(marker, rank))) if owns else None)
    shared = first_failure(sharing[0] if owns else None)
    if shared is not None:
        if owns:
            shutil.rmtree(staging.path, ignore_errors=True)
        raise ValueError(
            f"save_on_each_node=True, but {shared}: that folder is on a filesystem several nodes share; leave "
            "ProjectConfiguration(save_on_each_node=False) there (the checkpoints saved before are intact)."
        )

    def write() -> None:
        if before_write is not None:
            before_write(staging.path)
        write_files(staging, prepared, models=models, weights=weights, mid_cycle=mid_cycle, writes_shared=owns)
        staging.synced()

    fail.if_any(_attempt(write))  # every rank's files are on disk after it

    record = manifest_record(
        prepared, models=models, weights=weights, metadata=metadata, mid_cycle=mid_cycle, iteration=iteration,
        checksum=checksum, after_manifest=after_manifest,
    )  # fmt: skip
    record["node_local_ranks"] = list(node.ranks)
    # (a) Every node's manifest is on disk before any node renames.
    fail.if_any(_attempt(lambda: _write_manifest(staging.path, record)) if owns else None)

    # (b) Every node renames; the checkpoint an explicit output_dir held waits aside until all have.
    renamed: list[Path | None] = []  # on an owner that renamed: what it replaced (or None)

    def rename() -> None:
        renamed.append(rename_into_place(staging.path, target))
        fsync_path(target.parent)  # after recording the rename: a failed fsync still puts it back below

    error = _attempt(rename) if owns else None
    failure = first_failure(_report(rank, error))
    if failure is not None and renamed:
        _put_back(target, renamed[0])
    fail.raise_if(failure, error)

    # (c) Every node holds the new checkpoint: only now is anything older deleted.
    def finish() -> None:
        if renamed[0] is not None:
            remove_folder(renamed[0])
        if after_commit is not None:
            after_commit()

    failure = first_failure(_report(rank, _attempt(finish) if owns else None))
    if failure is not None:
        raise CheckpointError(
            f"{target.name} was committed on every node, but cleaning up after it failed ({failure}); delete "
            f"{target.name}.previous or the checkpoints past total_limit by hand."
        )


@dataclass(frozen=True)
class _Failure:
    """The end of each phase: every rank learns of the first failure, the owners clean up, all raise alike.

    A rank whose own failure is not the disk's (a hook's or our bug) raises its own exception, with
    its traceback; the others, and every rank for a disk's failure, raise the CheckpointError sentence.
    """

    staging: Path
    target: Path
    rank: int
    owns: bool

    def if_any(self, error: Exception | None) -> None:
        self.raise_if(first_failure(_report(self.rank, error)), error)

    def raise_if(self, failure: str | None, error: Exception | None) -> None:
        """``failure``: the first failed rank's, told to every rank; ``error``: this rank's own, if any."""
        if failure is None:
            return
        if self.owns:
            shutil.rmtree(self.staging, ignore_errors=True)  # free what the partial save took, on every node
        if error is not None and not _is_disks(error):
            raise error
        raise_if_failed(failure, self.staging, self.target, self.rank)


def _attempt(action: Callable[[], Any]) -> Exception | None:
    """What ``action`` raised, if anything: reported to every rank by the phase's gather, never raised alone."""
    try:
        action()
    except Exception as error:  # any kind: a rank that raised alone would leave the others waiting in the gather
        return error
    return None


def _is_disks(error: Exception) -> bool:
    """A failure of the disk (or of writing to it), not a hook's or ours."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(error, OSError | CheckpointException | CheckpointError)


def _report(rank: int, error: Exception | None) -> str | None:
    """``"rank R: reason"``, for the gather; an error other than the disk's is named by its type."""
    if error is None:
        return None
    kind = "" if _is_disks(error) else f"{type(error).__name__}: "
    return f"rank {rank}: {kind}{failure_reason(error)}"


# Each node's owner marks its staging folder, so that owners that share one (a shared filesystem) see it.
_OWNER_MARKER = ".owner-"


def _mark(marker: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def _remove_leftover(staging: Path) -> None:
    """Remove a staging folder a crashed save left; on a shared disk another owner may be removing it too."""
    try:
        remove_folder(staging)
    except FileNotFoundError:  # that owner removed it (or part of it) first: _other_owners refuses the folder
        pass


def _other_owners(marker: Path, rank: int) -> str | None:
    """Which owners write into this owner's folder too (a shared filesystem); removes its marker if none."""
    owners = sorted(int(path.name[len(_OWNER_MARKER) :]) for path in marker.parent.glob(f"{_OWNER_MARKER}*"))
    if owners == [rank]:
        marker.unlink()
        return None
    return f"the node owners {owners} all write into {marker.parent}"


def _write_manifest(staging: Path, record: dict[str, Any]) -> None:
    manifests.write_manifest(staging, **record)
    sync_tree(staging)  # every file and folder on disk before any node renames


def _put_back(target: Path, previous: Path | None) -> None:
    """Undo :func:`~runner.engine.checkpoint.folders.rename_into_place` on a node whose rename succeeded while
    another node's failed."""
    remove_folder(target)
    if previous is not None:
        os.replace(previous, target)
    fsync_path(target.parent)


def checkpoint_to_load(config: ProjectConfiguration, input_dir: str | os.PathLike | None) -> Path:
    """This node's copy of the checkpoint to load, once every rank found one and all agree it is the same save.

    Raises:
        CheckpointError: Some rank found none, or a damaged one (every rank raises), or the ranks found
            checkpoints of different names, steps or iterations.
    """
    checkpoint = alike_on_every_rank(lambda: find_checkpoint(config, input_dir), doing="find the checkpoint")
    manifest = alike_on_every_rank(lambda: read_manifest(checkpoint, verify_checksums=False), doing="read it")
    found = gather_object([(checkpoint.name, manifest.get("step"), manifest.get("iteration"))])
    if len(set(found)) > 1:
        listing = ", ".join(f"rank {rank}: {name} at step {step}" for rank, (name, step, _) in enumerate(found))
        raise CheckpointError(
            f"The nodes would resume from different checkpoints ({listing}); give every node a copy of the same "
            "save (load_state(input_dir) with the same checkpoint on each node)."
        )
    return checkpoint


def load_training_state(
    checkpoint: Path,
    prepared: PreparedObjects,
    *,
    models: Sequence[nn.Module],
    verify_checksums: bool,
    verified: VerifiedCheckpoint | None = None,
    before_load: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Restore ``prepared`` from this node's copy (see :func:`runner.engine.checkpoint.loading.load_training_state`).

    Args:
        verified: A save already verified (see :func:`runner.engine.checkpoint.loading.verify_together`).
        before_load: Runs on every rank (load_state's pre-hooks) once the copy is verified, before anything
            is read: inside the same gather, so a hook that raises on one rank makes every rank raise rather
            than wait.

    Returns:
        The copy's manifest.

    Raises:
        CheckpointError: On every rank, when any rank's copy cannot be loaded: this rank's own files are
            in another node's copy, or it is damaged, or of other objects (the failed rank raises its own).
    """

    if verify_checksums:  # the ranks of each node split its copy's files: a collective, outside the gather below
        manifest = alike_on_every_rank(lambda: read_manifest(checkpoint, verify_checksums=False), doing="read it")
        verify_together(checkpoint, manifest, prepared.env, node_ranks=node_of(prepared.env).ranks, verified=verified)

    def load() -> dict[str, Any]:
        if before_load is not None:
            before_load()
        manifest = load_whole_state(checkpoint, prepared, models=models, verify_checksums=False)
        restore_engine_metadata(
            manifest, checkpoint, prepared.dataloaders, prepared.optimizers, prepared.gradient_state
        )
        return manifest

    return alike_on_every_rank(load, doing="load the checkpoint")


__all__ = [
    "Node",
    "alike_on_every_rank",
    "check_load",
    "check_save",
    "checkpoint_to_load",
    "load_training_state",
    "node_of",
    "save_training_state",
    "target",
]
