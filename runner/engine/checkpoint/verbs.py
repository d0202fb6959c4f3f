"""The Accelerator's checkpoint verbs: ``save_state``, ``load_state`` and what they save, and a model's weights.

:class:`CheckpointVerbs` is mixed into :class:`~runner.engine.accelerator.Accelerator`. ``save_state``,
``load_state`` and ``wait_for_checkpoint`` hand the prepared objects to the :class:`Checkpointer`;
``skip_first_batches`` starts a prepared loader's next pass further on (a resume within an epoch);
``save_model`` and ``get_state_dict`` gather a model's full weights through the parallel strategy and write them
with :mod:`~runner.engine.checkpoint.serialization`. It reads the attributes its class body declares, which the
Accelerator sets; besides what the room may import, it imports the prepared objects and the prepared loader's
class (:mod:`runner.engine.loaders`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from runner.engine.checkpoint.async_saves import AsyncSave
from runner.engine.checkpoint.checkpointer import Checkpointer, is_stateful
from runner.engine.checkpoint.folders import ProjectConfiguration
from runner.engine.checkpoint.serialization import save_model_files, save_safetensors
from runner.engine.loaders import PreparedDataLoader
from runner.engine.prepared import PreparedObjects
from runner.files import write_atomically

if TYPE_CHECKING:
    from runner.engine.checkpoint.manifest import VerifiedCheckpoint
    from runner.engine.distributed import AcceleratorState
    from runner.engine.optimizer import AcceleratedOptimizer, AcceleratedScheduler, GradientState
    from runner.engine.parallel.base import ParallelStrategy


class CheckpointVerbs:
    """Save and restore the prepared objects; write a model's weights (a mixin of the Accelerator)."""

    state: AcceleratorState
    is_main_process: bool
    project_configuration: ProjectConfiguration
    gradient_state: GradientState
    scaler: torch.amp.GradScaler | None
    _strategy: ParallelStrategy
    _checkpointer: Checkpointer
    _models: list[nn.Module]
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[PreparedDataLoader]
    _custom_objects: list[Any]

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """Save ``obj`` to ``f`` on the main process only, atomically: a crash leaves the previous file.

        With ``safe_serialization`` ``obj`` must be a dict of tensors, written as safetensors.
        """
        if not self.is_main_process:
            return
        write_atomically(
            f, lambda partial: save_safetensors(obj, partial) if safe_serialization else torch.save(obj, partial)
        )

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's full state dict, with the wrappers' prefixes removed.

        Under FSDP it is gathered from every rank to the main process's CPU (the others get an empty
        dict, as in Accelerate), so every process must call it.
        """
        return self._strategy.full_state_dict(model) if unwrap else model.state_dict()

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """Write the model's full weights: ``model.safetensors``, or shards and an index (main process writes;
        under FSDP every process must call it, to gather the shards).

        Example:
            >>> accelerator.save_model(model, "out/model", max_shard_size="1GB")
        """
        state_dict = self.get_state_dict(model)
        if self.is_main_process:
            save_model_files(
                state_dict,
                save_directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
            )

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Save and restore ``objects`` (each with ``state_dict``/``load_state_dict``) with the state."""
        invalid = [type(obj).__name__ for obj in objects if not is_stateful(obj)]
        if invalid:
            raise ValueError(
                f"register_for_checkpointing needs objects with state_dict and load_state_dict; got {invalid}."
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """Call ``hook(models, weights, output_dir)`` on every process before ``save_state`` writes.

        ``output_dir`` is the checkpoint folder being written (still under its temporary name):
        files the hook writes there become part of the checkpoint. Removing an entry from
        ``weights`` leaves that model out. Returns a handle whose ``remove()`` unregisters it.
        """
        return self._checkpointer.register(self._checkpointer.save_hooks, hook)

    def register_save_state_commit_hook(self, hook: Callable) -> RemovableHandle:
        """Call ``hook(output_dir)`` where ``save_state`` commits a checkpoint, once its manifest is written.

        It runs on the process that writes the manifest (the main process; under ``save_on_each_node``
        each node's local main process), before the folder is renamed into place: what it writes
        there is committed with the checkpoint but is not listed in the manifest, so it may read the
        manifest (a signature of it, say). Returns a handle whose ``remove()`` unregisters it.
        """
        return self._checkpointer.register(self._checkpointer.commit_hooks, hook)

    def register_load_state_pre_hook(self, hook: Callable) -> RemovableHandle:
        """Call ``hook(models, input_dir)`` on every process before ``load_state`` reads.

        Removing an entry from ``models`` skips loading that model. Returns a removable handle.
        """
        return self._checkpointer.register(self._checkpointer.load_hooks, hook)

    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """Make the next pass of a prepared loader start after its first ``num_batches`` batches.

        The skipped batches are never loaded. Returns the same loader, for Accelerate's idiom
        ``for batch in accelerator.skip_first_batches(loader, n)``.
        """
        if not isinstance(dataloader, PreparedDataLoader):
            raise ValueError("skip_first_batches needs a loader returned by prepare(); prepare it first.")
        dataloader.skip_first_batches(num_batches)
        return dataloader

    def save_state(
        self,
        output_dir: str | os.PathLike | None = None,
        *,
        metadata: dict[str, Any] | None = None,
        async_save: AsyncSave | str | bool = False,
    ) -> str:
        """Save models, optimizers, schedulers, scaler, RNG states, data position and registered objects.

        With ``automatic_checkpoint_naming`` the folder is ``project_dir/checkpoints/checkpoint_{i}``
        and ``i`` advances after each save (past any folder already there, with a warning: nothing
        is overwritten); ``total_limit`` then keeps the newest checkpoints. The folder appears only
        once complete. Every process must call this. With ``ProjectConfiguration(save_on_each_node=True)``
        each node keeps its own copy, on its own disk (see :mod:`runner.engine.checkpoint.node_local`).

        Args:
            output_dir: The folder to write (ignored under automatic naming). A folder that holds
                anything but a checkpoint is refused, since saving replaces it whole.
            metadata: JSON-able facts to record in the manifest besides the engine's own (step,
                epoch, data position, accumulation, world size, files with sizes and digests).
            async_save: What to leave to the background (:class:`~runner.engine.checkpoint.async_saves.AsyncSave`).
                ``"writes"`` (or ``True``): return once the state is copied to host memory (pinned under
                CUDA); every rank writes and hashes its files, and rank 0 writes the manifest, syncs and
                commits, in background threads while training goes on (FSDP's shards through
                ``torch.distributed.checkpoint.async_save``). ``"commit"``: return once every rank's files
                are written and hashed; rank 0 writes the manifest and commits in a background thread.
                Either way the folder still appears only once complete, and the next ``save_state``,
                ``load_state``, ``wait_for_checkpoint`` or ``end_training`` waits for it (and raises its
                error on every process). ``"none"`` (or ``False``, the default): return once committed.

        Returns:
            The checkpoint folder.

        Raises:
            ValueError: No folder was given and naming is not automatic, or ``async_save`` names no mode.
            CheckpointError: ``output_dir`` holds something other than a checkpoint.
        """
        target = self._checkpointer.save(
            self._prepared_objects(),
            output_dir,
            project=self.project_configuration,
            metadata=metadata,
            mode=AsyncSave.of(async_save),
        )
        return str(target)

    def wait_for_checkpoint(self) -> None:
        """Block until a checkpoint saved in the background (``async_save``) is committed; raise its error if it
        failed.

        Every process must call this (``save_state``, ``load_state`` and ``end_training`` do). After
        ``async_save="writes"`` each process waits for its own background save, and all of them end with the
        same outcome; after ``"commit"`` rank 0 waits for its commit, then tells every rank how it went.
        Either way all of them raise alike.
        """
        self._checkpointer.wait()

    def mark_verified(self, verified: VerifiedCheckpoint) -> None:
        """Let the next :meth:`load_state` take the save ``verified`` names without hashing its files again.

        For the process that starts this one, having verified the checkpoint it hands over (``runner resume=``
        does), or for ranks that found it together
        (:func:`~runner.engine.checkpoint.loading.newest_verified_checkpoint`). The mark holds for the next load
        only, and only for that very save: one written in place since has another manifest digest.
        """
        self._checkpointer.verified = verified

    def load_state(self, input_dir: str | os.PathLike | None = None, *, verify_checksums: bool = True) -> None:
        """Restore what :meth:`save_state` saved; every process must call this after ``prepare``.

        Without ``input_dir`` (and with automatic naming) the newest committed checkpoint of
        ``project_dir`` is loaded. After loading ``checkpoint_K`` the next automatic save is
        ``checkpoint_{K+1}``. Every file is checked against the manifest first: its size, and with
        ``verify_checksums`` (the default) the digest of every slice, each hashed once, by one process
        (the processes split the files they all read), before anything is loaded.
        Prepared loaders continue from the saved data position on their next pass.

        Raises:
            CheckpointError: One sentence naming the file that is missing, truncated or corrupted,
                or the keys of a model that does not fit.
        """
        self._checkpointer.load(
            self._prepared_objects(), input_dir, project=self.project_configuration, verify_checksums=verify_checksums
        )

    def _prepared_objects(self) -> PreparedObjects:
        return PreparedObjects(
            env=self.state,
            strategy=self._strategy,
            gradient_state=self.gradient_state,
            models=tuple(self._models),
            optimizers=tuple(self._optimizers),
            schedulers=tuple(self._schedulers),
            dataloaders=tuple(self._dataloaders),
            custom_objects=tuple(self._custom_objects),
            scaler=self.scaler,
        )
