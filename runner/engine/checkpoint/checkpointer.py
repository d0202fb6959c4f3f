"""Training state on disk: the Checkpointer behind save_state/load_state, and the save path.

A checkpoint exists only when complete. Every rank writes its share into ``<name>.incomplete``: the
parallel strategy writes the models' and optimizers' state (whole, from rank 0, or every rank's
shards) in its own format, rank 0 the schedulers, loss scaler and registered objects, and every
rank its RNG states (and, in the middle of an accumulation cycle, its pending gradients). Once all
have finished, rank 0 writes ``manifest.json`` last, recording the strategy's format
(``state_format``) and what the checkpoint holds, and renames the folder to its final name.

The folders (naming, listing, commit, rotation) are :mod:`runner.engine.checkpoint.folders`; the
load path is :mod:`runner.engine.checkpoint.loading`, what each rank writes :mod:`runner.engine.checkpoint.staging`,
and a copy on each node's own disk (``save_on_each_node``) :mod:`runner.engine.checkpoint.node_local`; their names
are imported from there.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.engine.checkpoint import manifest as manifests
from runner.engine.checkpoint import node_local
from runner.engine.checkpoint.async_saves import AsyncSave, BackgroundSaves, Snapshot, write_in_background
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.folders import (
    ProjectConfiguration,
    check_writable_target,
    checkpoint_number,
    checkpoint_to_load,
    failure_reason,
    next_automatic_checkpoint,
    remove_folder,
    rotate_checkpoints,
    staging_dir,
)
from runner.engine.checkpoint.folders import commit as commit_folder
from runner.engine.checkpoint.loading import (
    load_training_state,
    restore_engine_metadata,
)
from runner.engine.checkpoint.staging import (
    StagingFolder,
    begin_save,
    first_failure,
    manifest_record,
    raise_if_failed,
    share_outcome,
    write_files,
)
from runner.engine.distributed import DistributedEnvironment, barrier
from runner.engine.ops import broadcast_object_list, gather_object
from runner.engine.parallel.base import unwrap_module
from runner.engine.prepared import PreparedObjects
from runner.files import sync_tree

__all__ = ["Checkpointer", "engine_metadata", "is_stateful", "save_training_state"]


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` can be checkpointed: it has ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


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
    committer: Executor | None = None,
    checksum: str = manifests.DEFAULT_CHECKSUM,
    background: BackgroundSaves | None = None,
) -> Future | None:
    """Write the prepared objects' state as the checkpoint folder ``target``, committing it atomically.

    Every rank calls this with the same arguments; the order of barriers is the same on all of them.

    Args:
        models: The prepared models, unwrapped.
        weights: What the strategy's ``checkpoint_weights`` returned (after the save hooks edited it).
        metadata: Small JSON-able facts (data position, ...) stored in the manifest.
        before_write: Called on every rank with the staging folder before anything is written;
            files it writes there become part of the checkpoint.
        after_manifest: Called on rank 0 with the staging folder once the manifest is written, before the
            commit; files it writes there are committed too, unlisted (a signature of the manifest, say).
        after_commit: Called on rank 0 once the checkpoint is committed (rotation, say).
        committer: Write the manifest and commit on this executor (rank 0), and return as soon as
            every rank's files are written and hashed. The folder still appears only once complete.
        checksum: The digest the manifest records of each file's slices (``manifest_schema.CHECKSUMS``).
        background: Copy the state to host memory and return; every rank writes, hashes and commits in
            these background saves (see :mod:`runner.engine.checkpoint.async_saves`).

    Returns:
        With ``background``, this rank's pending save (its result: None, or the failure sentence every
        rank gets alike); with ``committer``, rank 0's pending commit; else None.
    """
    mid_cycle, metadata = begin_save(prepared, metadata)
    rank = prepared.env.rank
    staging, writer = StagingFolder(staging_dir(target)), None
    if background is not None:
        writer = background.snapshot(staging.path, prepared)
    entries = _write_staging(
        staging, target, prepared, writer=writer, models=models, weights=weights, mid_cycle=mid_cycle,
        before_write=before_write, checksum=checksum,
    )  # fmt: skip
    record = manifest_record(
        prepared, models=models, weights=weights, metadata=metadata, mid_cycle=mid_cycle, iteration=iteration,
        checksum=checksum, after_manifest=after_manifest,
    )  # fmt: skip
    record["entries"] = entries
    if background is not None:
        if rank == 0:
            background.report()
        saving = partial(write_in_background, writer, staging, target, rank=rank, group=background.group(0))
        return background.submit(partial(saving, record=record, after_commit=after_commit))
    commit = partial(_commit, staging.path, target, record=record, after_commit=after_commit)
    if committer is not None:
        return committer.submit(commit) if rank == 0 else None
    failure = None
    if rank == 0:
        try:
            commit()
        except (OSError, CheckpointError) as error:  # hashing, the manifest, a link a hook left, or the rename
            failure = f"rank 0: {failure_reason(error)}"
    raise_if_failed(first_failure(failure), staging.path, target, rank)  # nobody moves on before the commit
    return None


def _commit(staging: Path, target: Path, *, record: dict[str, Any], after_commit: Callable[[], None] | None) -> None:
    """On rank 0: the manifest, written last, then the rename that makes the checkpoint exist."""
    manifests.write_manifest(staging, **record)
    sync_tree(staging)  # every file and folder on disk before the rename that makes the checkpoint exist
    commit_folder(staging, target)
    if after_commit is not None:
        after_commit()


def _write_staging(
    staging: StagingFolder,
    target: Path,
    prepared: PreparedObjects,
    *,
    writer: Snapshot | None,
    models: Sequence[nn.Module],
    weights: Sequence[dict[str, torch.Tensor]] | None,
    mid_cycle: bool,
    before_write: Callable[[Path], None] | None,
    checksum: str,
) -> dict[str, dict[str, Any]]:
    """Every rank writes its files into the staging folder of ``target`` and hashes them (or, with a ``writer``
    snapshot, copies them to host memory); raises on all ranks if any failed. Returns every rank's entries for
    the manifest."""
    rank = prepared.env.rank
    if rank == 0:
        remove_folder(staging.path)  # left by a save that crashed; never a committed checkpoint
        staging.path.mkdir(parents=True)
    barrier(prepared.env)  # the staging folder exists before anyone writes into it
    from torch.distributed.checkpoint.api import CheckpointException

    entries, failure, bug = {}, None, None
    try:
        if before_write is not None:
            before_write(staging.path)
        write_files(writer or staging, prepared, models=models, weights=weights, mid_cycle=mid_cycle)
        if writer is not None:
            writer.copier.finish()
        else:
            entries = staging.entries(checksum)
    except (OSError, CheckpointException) as error:  # a full disk, a lost mount, a failed DCP write
        failure = f"rank {rank}: {failure_reason(error)}"
    except Exception as error:  # a hook's, or a state the snapshot cannot copy: this rank raises it below
        failure, bug = f"rank {rank}: {type(error).__name__}: {error}", error
    # Every rank learns of any rank's failure (so none waits forever), and all files are on disk
    # before the manifest lists them.
    failure, entries = share_outcome(failure, entries)
    if bug is not None:
        raise_if_failed(failure, staging.path, target, rank, cause=bug)
    raise_if_failed(failure, staging.path, target, rank)
    return entries


def engine_metadata(loaders: Sequence[Any], optimizers: Sequence[Any], gradient_state: Any) -> dict[str, Any]:
    """What a manifest records so a run continues exactly: steps, epoch, accumulation, data position."""
    positions = [loader.state_dict() for loader in loaders]
    return {
        "step": optimizers[0].steps if optimizers else None,
        "epoch": positions[0]["epoch"] if positions else None,
        "optimizer_steps": [optimizer.steps for optimizer in optimizers],
        "accumulation_step": gradient_state.step,
        "accumulation_steps": gradient_state.num_steps,
        "dataloaders": positions,
    }


class Checkpointer:
    """``save_state``/``load_state`` of one Accelerator: its hooks, naming, commits (also in the
    background), rotation, and the checkpoint it loaded. The Accelerator's verbs delegate here, each
    with a :class:`PreparedObjects` view of what it prepared and its ``ProjectConfiguration``.

    Example:
        >>> checkpointer = Checkpointer()
        >>> checkpointer.save(prepared, "out/ck", project=ProjectConfiguration(), metadata=None)
        >>> checkpointer.load(prepared, "out/ck", project=ProjectConfiguration(), verify_checksums=True)
    """

    def __init__(self) -> None:
        # OrderedDict, not dict: torch's RemovableHandle keeps a weak reference to it.
        self.save_hooks: OrderedDict[int, Callable] = OrderedDict()
        self.load_hooks: OrderedDict[int, Callable] = OrderedDict()
        self.commit_hooks: OrderedDict[int, Callable] = OrderedDict()
        self.loaded: Path | None = None
        self.verified: manifests.VerifiedCheckpoint | None = None  # for the next load only (Accelerator.mark_verified)
        self._committer: ThreadPoolExecutor | None = None  # rank 0's background commits
        self._pending: Future | None = None  # on rank 0 only
        self._in_flight = False  # known on every rank
        self._background = BackgroundSaves()
        self._saving: Future | None = None  # every rank's async_save

    @staticmethod
    def register(hooks: OrderedDict, hook: Callable) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    @staticmethod
    def _target(env: DistributedEnvironment, config: ProjectConfiguration, output_dir) -> Path:
        if config.automatic_checkpoint_naming:
            if output_dir is not None:
                warnings.warn("save_state(output_dir) is ignored under automatic_checkpoint_naming.", stacklevel=4)
            # Rank 0 picks the number and everyone writes there: the ranks can never disagree on it.
            chosen = next_automatic_checkpoint(config) if env.is_main_process else None
            target = Path(broadcast_object_list([chosen])[0])
            config.iteration = checkpoint_number(target)
            return target
        if output_dir is None:
            raise ValueError(
                "save_state() needs an output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)."
            )
        target = Path(output_dir)
        if env.world_size > 1:  # every rank writes its part into one folder: a folder of its own would be lost
            folders = gather_object([os.path.abspath(target)])
            if len(set(folders)) > 1:
                named = ", ".join(f"rank {rank}: {folder!r}" for rank, folder in enumerate(folders))
                raise ValueError(
                    f"save_state got a different output_dir on each process ({named}); every process writes its "
                    "part of one checkpoint into the same folder, so pass the same output_dir on every rank (a "
                    "folder all nodes see, or ProjectConfiguration(save_on_each_node=True) for each node's disk)."
                )
        check_writable_target(target)  # every rank sees the same folder, so every rank raises alike
        return target

    def save(
        self,
        prepared: PreparedObjects,
        output_dir: str | os.PathLike | None,
        *,
        project: ProjectConfiguration,
        metadata: dict[str, Any] | None,
        mode: AsyncSave = AsyncSave.NONE,
    ) -> Path:
        """Save ``prepared`` (see ``Accelerator.save_state``); every rank calls it. Returns the checkpoint folder."""
        self.wait()
        if project.save_on_each_node:
            node_local.check_save(prepared, mode=mode)
            target = node_local.target(project, output_dir)
        else:
            target = self._target(prepared.env, project, output_dir)
        models = [unwrap_module(model) for model in prepared.models]
        weights = prepared.strategy.checkpoint_weights(models)
        hook_weights = weights if weights is not None else []  # sharded weights: the hooks get none

        def run_hooks(staging: Path) -> None:
            for hook in self.save_hooks.values():
                hook(models, hook_weights, str(staging))

        def run_commit_hooks(staging: Path) -> None:
            for hook in self.commit_hooks.values():
                hook(str(staging))

        rotate = None
        if project.automatic_checkpoint_naming and project.total_limit is not None:
            rotate = partial(rotate_checkpoints, target.parent, total_limit=project.total_limit, protect=self.loaded)
        if mode is AsyncSave.COMMIT and self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        facts = engine_metadata(prepared.dataloaders, prepared.optimizers, prepared.gradient_state)
        saving = dict(
            models=models,
            weights=weights,
            iteration=project.iteration if project.automatic_checkpoint_naming else None,
            metadata={**facts, **(metadata or {})},
            before_write=run_hooks,
            after_manifest=run_commit_hooks if self.commit_hooks else None,
            after_commit=rotate,
            checksum=project.checksum,
        )
        if project.save_on_each_node:
            node_local.save_training_state(target, prepared, **saving)
        elif mode is AsyncSave.WRITES:
            self._saving = save_training_state(target, prepared, **saving, background=self._background)
        else:
            committer = self._committer if mode is AsyncSave.COMMIT else None
            self._pending = save_training_state(target, prepared, **saving, committer=committer)
        self._in_flight = mode is AsyncSave.COMMIT
        if project.automatic_checkpoint_naming:
            project.iteration += 1
        return target

    def release(self) -> None:
        """Wait for the last save, then free the host memory asynchronous saves keep for their copies."""
        self.wait()
        self._background.release()

    def wait(self) -> None:
        """Wait for the last save's background work; raise its failure on every rank alike.

        After ``async_save="writes"`` every rank waits for its own background save (they end together, with the
        same outcome); after ``"commit"`` rank 0 waits for its commit, then tells every rank how it went.
        """
        saving, self._saving = self._saving, None
        if saving is not None:
            failure = saving.result()
            if failure is not None:
                raise CheckpointError(failure)
        if not self._in_flight:
            return
        self._in_flight = False
        pending, self._pending = self._pending, None
        error = None
        if pending is not None:
            try:
                pending.result()
            except Exception as failure:  # reported to every rank below, then raised
                error = f"Committing the last checkpoint failed: {type(failure).__name__}: {failure}"
        error = broadcast_object_list([error])[0]
        if error is not None:
            raise CheckpointError(error)

    def load(
        self,
        prepared: PreparedObjects,
        input_dir: str | os.PathLike | None,
        *,
        project: ProjectConfiguration,
        verify_checksums: bool,
    ) -> None:
        """Restore ``prepared`` (see ``Accelerator.load_state``); every rank calls it."""
        verified, self.verified = self.verified, None
        self.wait()
        if project.save_on_each_node:
            node_local.check_load(prepared)  # every rank alike, before the barrier
        barrier(prepared.env)  # a checkpoint rank 0 was still committing is now visible to all
        if project.save_on_each_node:
            checkpoint = node_local.checkpoint_to_load(project, input_dir)
        else:
            checkpoint = checkpoint_to_load(project, input_dir)
        models = [unwrap_module(model) for model in prepared.models]

        def run_hooks() -> None:
            for hook in self.load_hooks.values():
                hook(models, str(checkpoint))

        if project.save_on_each_node:  # the hooks run inside its gather: one raising there fails every rank
            manifest = node_local.load_training_state(
                checkpoint, prepared, models=models, verify_checksums=verify_checksums, verified=verified,
                before_load=run_hooks,
            )  # fmt: skip
        else:
            run_hooks()
            manifest = load_training_state(
                checkpoint, prepared, models=models, verify_checksums=verify_checksums, verified=verified
            )
            restore_engine_metadata(
                manifest, checkpoint, prepared.dataloaders, prepared.optimizers, prepared.gradient_state
            )
        if manifest["world_size"] != prepared.env.world_size:
            warnings.warn(
                f"{checkpoint.name} was saved by {manifest['world_size']} process(es) and is loaded by "
                f"{prepared.env.world_size}: the data continues exactly, random streams are re-derived per rank.",
                stacklevel=3,  # the caller of Accelerator.load_state
            )
        self.loaded = checkpoint
        number = checkpoint_number(checkpoint)
        if project.automatic_checkpoint_naming and number is not None:
            project.iteration = number + 1
