"""Training state on disk: save_state/load_state folders, their naming, rotation and atomic commit.

A checkpoint exists only when complete. Every rank writes into ``<name>.incomplete``; once all have
finished, rank 0 writes ``manifest.json`` last and renames the folder to its final name. A folder
without a manifest is never loaded or counted, and rotation deletes only committed checkpoints, only
after the new one is committed, and never the one this run was loaded from.

A checkpoint folder is data: its manifest records the format the run's strategy wrote
(``state_format``) and what it holds, and loading follows that record, never the files it finds
(see runner.engine.manifest). A ``checkpoint_N`` that is a symbolic link is never loaded, counted or
deleted through.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from runner.engine import manifest as manifests
from runner.engine import sharded_state
from runner.engine.constants import (
    CHECKPOINT_PREFIX,
    CHECKPOINTS_DIR,
    DCP_METADATA_NAME,
    INCOMPLETE_SUFFIX,
    MANIFEST_NAME,
    MODEL_NAME,
    OPTIMIZER_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    custom_state_name,
    gradients_name,
    indexed_name,
    rng_state_name,
)
from runner.engine.manifest import CheckpointError, CheckpointNotFoundError, read_manifest
from runner.engine.ops import broadcast_object_list, gather_object
from runner.engine.rng import get_rng_state, set_rng_state, set_seed
from runner.engine.serialization import load_safetensors, save_safetensors, torch_save
from runner.files import fsync_path, sync_tree, write_atomically

_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


@dataclass
class ProjectConfiguration:
    """Where a project writes, and how it names and rotates checkpoints (Accelerate's names).

    Args:
        project_dir: The folder for checkpoints (``project_dir/checkpoints``) and logs.
        logging_dir: Where trackers write; defaults to ``project_dir``.
        automatic_checkpoint_naming: ``save_state()`` writes ``checkpoints/checkpoint_{iteration}``.
        total_limit: Keep at most this many checkpoints (the newest) under automatic naming.
        iteration: The number the next automatically named checkpoint gets.
    """

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0

    def __post_init__(self) -> None:
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        if self.total_limit is not None and self.total_limit < 1:
            raise ValueError(f"total_limit={self.total_limit} must be at least 1 (or None to keep all).")

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set ``project_dir`` (and ``logging_dir`` if it was unset)."""
        self.project_dir = None if project_dir is None else str(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


def checkpoint_number(path: str | os.PathLike) -> int | None:
    """N for a folder named ``checkpoint_N``, else None."""
    match = _CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_committed(path: str | os.PathLike) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def committed_checkpoints(checkpoints_dir: str | os.PathLike) -> list[Path]:
    """The committed ``checkpoint_N`` folders in ``checkpoints_dir``, oldest first; anything else is ignored.

    A ``checkpoint_N`` that is a symbolic link is ignored too, with a warning: resuming or rotating
    through it would read or delete a folder outside the run.
    """
    directory = Path(checkpoints_dir)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        number = checkpoint_number(path)
        if number is not None and path.is_symlink():
            warnings.warn(f"Ignoring {path}: it is a symbolic link, not a checkpoint of this run.", stacklevel=2)
        elif number is not None and path.is_dir() and is_committed(path):
            found.append((number, path))
    return [path for _, path in sorted(found)]


def newest_checkpoint_number(checkpoints_dir: str | os.PathLike) -> int | None:
    """The largest N of any ``checkpoint_N`` folder (committed or not) in ``checkpoints_dir``."""
    directory = Path(checkpoints_dir)
    numbers = [checkpoint_number(p) for p in directory.iterdir()] if directory.is_dir() else []
    return max((n for n in numbers if n is not None), default=None)


def newest_intact_checkpoint(directory: Path) -> tuple[Path | None, list[tuple[Path, CheckpointError]]]:
    """The newest committed checkpoint in ``directory`` whose files match its manifest, and the newer
    damaged ones skipped on the way (each with its error)."""
    skipped = []
    for checkpoint in reversed(committed_checkpoints(directory)):
        try:
            read_manifest(checkpoint)
        except CheckpointError as error:
            skipped.append((checkpoint, error))
            continue
        return checkpoint, skipped
    return None, skipped


def next_automatic_checkpoint(config: ProjectConfiguration) -> Path:
    """``project_dir/checkpoints/checkpoint_{iteration}``, or past the newest folder if that one is taken.

    A taken number is never overwritten, and the save never fails over it (that would lose the
    training since the last checkpoint): the numbering continues after the newest folder, with a
    warning.
    """
    if config.project_dir is None:
        raise ValueError("automatic_checkpoint_naming needs a project_dir; pass project_dir= to the Accelerator.")
    directory = checkpoints_dir(config.project_dir)
    number = config.iteration
    newest = newest_checkpoint_number(directory)
    if newest is not None and number <= newest:
        warnings.warn(
            f"{directory / f'{CHECKPOINT_PREFIX}{number}'} is taken (the newest is {CHECKPOINT_PREFIX}{newest}); "
            f"saving as {CHECKPOINT_PREFIX}{newest + 1} so nothing is overwritten.",
            stacklevel=5,  # the caller of Accelerator.save_state
        )
        number = newest + 1
    return directory / f"{CHECKPOINT_PREFIX}{number}"


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` can be checkpointed: it has ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def checkpoints_dir(project_dir: str | os.PathLike) -> Path:
    return Path(project_dir) / CHECKPOINTS_DIR


def _torch_save_atomically(obj: Any, path: Path) -> None:
    write_atomically(path, lambda partial: torch_save(obj, partial))


def _torch_load(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass
class TrainingState:
    """What one Accelerator saves: the prepared objects, in the order they were prepared."""

    models: Sequence[torch.nn.Module]  # unwrapped modules
    optimizers: Sequence[Any]
    schedulers: Sequence[Any]
    scaler: torch.amp.GradScaler | None
    custom_objects: Sequence[Any]
    # What to save of each model; save_state pre-hooks may edit it. Defaults to the models' state dicts.
    weights: Sequence[dict[str, torch.Tensor]] | None = None
    # Saved (per rank) when the checkpoint falls in the middle of a gradient accumulation cycle.
    save_gradients: bool = False
    # Under FSDP: "sharded" (every rank writes its shards through DCP) or "full" (gathered to rank 0).
    fsdp: str | None = None


def staging_dir(target: Path) -> Path:
    return target.with_name(target.name + INCOMPLETE_SUFFIX)


def save_training_state(
    target: Path,
    state: TrainingState,
    *,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    first_failure: Callable[[str | None], str | None] = lambda failure: failure,
    iteration: int | None = None,
    metadata: dict[str, Any] | None = None,
    before_write: Callable[[Path], None] | None = None,
    after_commit: Callable[[], None] | None = None,
    committer: Executor | None = None,
) -> Future | None:
    """Write ``state`` as the checkpoint folder ``target``, committing it atomically.

    Every rank calls this with the same arguments; the order of barriers is the same on all of them.

    Args:
        metadata: Small JSON-able facts (data position, ...) stored in the manifest.
        before_write: Called on every rank with the staging folder before anything is written;
            files it writes there become part of the checkpoint.
        after_commit: Called on rank 0 once the checkpoint is committed (rotation, say).
        committer: Hash, write the manifest and commit on this executor (rank 0), and return as soon
            as every rank's files are written. The folder still appears only once complete.

    Returns:
        Rank 0's pending commit when ``committer`` is given, else None.
    """
    if state.fsdp and state.save_gradients:
        raise CheckpointError(
            "save_state under FSDP needs a gradient accumulation cycle boundary (sharded gradients pending "
            "between syncs are not saved); save when accelerator.sync_gradients is True."
        )
    metadata = metadata or {}
    manifests.check_metadata(metadata)
    staging = staging_dir(target)
    if rank == 0:
        _remove_folder(staging)  # left by a save that crashed; never a committed checkpoint
        staging.mkdir(parents=True)
    barrier()  # the staging folder exists before anyone writes into it
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        if before_write is not None:
            before_write(staging)
        _write_files(staging, state, rank)
        failure = None
    except (OSError, CheckpointException) as error:  # a full disk, a lost mount, a failed DCP write
        failure = f"rank {rank}: {_reason(error)}"
    # Every rank learns of any rank's failure (so none waits forever), and all files are on disk
    # before the manifest lists them.
    _raise_if_failed(first_failure(failure), staging, target, rank)

    def commit() -> None:
        manifests.write_manifest(
            staging,
            world_size=world_size,
            iteration=iteration,
            state_format="dcp" if state.fsdp == "sharded" else "safetensors",
            contents=_contents(state, metadata),
            metadata=metadata,
        )
        sync_tree(staging)  # every file and folder on disk before the rename that makes the checkpoint exist
        _commit(staging, target)
        if after_commit is not None:
            after_commit()

    if committer is not None:
        return committer.submit(commit) if rank == 0 else None
    failure = None
    if rank == 0:
        try:
            commit()
        except (OSError, CheckpointError) as error:  # hashing, the manifest, a link a hook left, or the rename
            failure = f"rank 0: {_reason(error)}"
    _raise_if_failed(first_failure(failure), staging, target, rank)  # nobody moves on before the commit
    return None


def _contents(state: TrainingState, metadata: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint holds, for its manifest: loading checks the listed files against it."""
    saved_weights = state.fsdp != "sharded" and state.weights is not None  # hooks may have removed some
    return {
        "models": len(state.weights) if saved_weights else len(state.models),
        "optimizers": len(state.optimizers),
        "schedulers": len(state.schedulers),
        "custom_objects": len(state.custom_objects),
        "dataloaders": len(metadata.get("dataloaders", [])),
        "scaler": state.scaler is not None,
        "gradients": state.save_gradients,
    }


def _remove_folder(path: Path) -> None:
    """Remove a folder of ours; a symbolic link in its place is removed itself, never followed."""
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _raise_if_failed(failure: str | None, staging: Path, target: Path, rank: int) -> None:
    if failure is None:
        return
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # free what the partial save took
    raise CheckpointError(
        f"Saving {target.name} failed ({failure}); the checkpoints saved before it are intact, so free the space "
        "(or fix the folder) and resume from the newest of them."
    )


def _write_files(staging: Path, state: TrainingState, rank: int) -> None:
    """This rank's share of the checkpoint: shards under FSDP, the main state on rank 0, RNG, gradients."""
    optimizer_states = None
    if state.fsdp == "sharded":
        sharded_state.save_sharded(staging, state.models, state.optimizers, indexed_name)
    elif state.fsdp == "full":  # a collective: every rank sends its shards to rank 0
        state.weights, optimizer_states = sharded_state.gather_full(state.models, state.optimizers)
    if rank == 0:
        _write_main_state(staging, state, optimizer_states)
    _torch_save_atomically(get_rng_state(), staging / rng_state_name(rank))
    if state.save_gradients:
        save_safetensors(_gradients(state.models), staging / gradients_name(rank))


def _reason(error: BaseException) -> str:
    """What went wrong, in a few words: the OS error (of the first failed rank, for DCP's exception)."""
    if isinstance(error, OSError):
        return f"{error.strerror or error}" + (f": {error.filename}" if error.filename else "")
    first = next(iter((getattr(error, "failures", None) or {}).values()), None)
    if isinstance(first, tuple) and isinstance(first[0], OSError):
        return _reason(first[0])
    return str(error).splitlines()[0].rstrip(".")  # inside our sentence, in parentheses


def _write_main_state(staging: Path, state: TrainingState, optimizer_states: list | None = None) -> None:
    if state.fsdp != "sharded":  # sharded models and optimizers are already written by every rank
        weights = state.weights if state.weights is not None else [model.state_dict() for model in state.models]
        for i, state_dict in enumerate(weights):
            save_safetensors(state_dict, staging / indexed_name(MODEL_NAME, i, ".safetensors"))
        optimizer_states = optimizer_states or [optimizer.state_dict() for optimizer in state.optimizers]
        for i, optimizer_state in enumerate(optimizer_states):
            _torch_save_atomically(optimizer_state, staging / indexed_name(OPTIMIZER_NAME, i, ".bin"))
    for i, scheduler in enumerate(state.schedulers):
        _torch_save_atomically(scheduler.state_dict(), staging / indexed_name(SCHEDULER_NAME, i, ".bin"))
    if state.scaler is not None:
        _torch_save_atomically(state.scaler.state_dict(), staging / SCALER_NAME)
    for i, obj in enumerate(state.custom_objects):
        _torch_save_atomically(obj.state_dict(), staging / custom_state_name(i))


def _gradients(models: Sequence[torch.nn.Module]) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": parameter.grad.detach()
        for i, model in enumerate(models)
        for name, parameter in model.named_parameters()
        if parameter.grad is not None
    }


def check_writable_target(target: Path) -> None:
    """Refuse an ``output_dir`` that holds anything but a checkpoint: saving replaces the folder whole."""
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not is_committed(target))):
        raise CheckpointError(
            f"{target} exists and is not a checkpoint; save_state replaces its output_dir whole, so pass a new "
            "or empty folder (or a previous checkpoint's)."
        )


def _commit(staging: Path, target: Path) -> None:
    if not target.exists() or (target.is_dir() and not any(target.iterdir())):
        os.replace(staging, target)  # onto an empty directory, rename replaces it atomically
        fsync_path(target.parent)
        return
    # An explicit output_dir that already holds a checkpoint: swap, then delete the old one, so a
    # crash at any moment leaves either the old or the new checkpoint intact.
    previous = target.with_name(target.name + ".previous")
    _remove_folder(previous)
    os.replace(target, previous)
    os.replace(staging, target)
    fsync_path(target.parent)
    _remove_folder(previous)


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


def restore_engine_metadata(
    manifest: dict[str, Any], checkpoint: Path, loaders: Sequence[Any], optimizers: Sequence[Any], gradient_state: Any
) -> None:
    """Put back what :func:`engine_metadata` recorded."""
    positions = manifest.get("dataloaders", [])
    if len(positions) != len(loaders):
        raise CheckpointError(
            f"{checkpoint} records {len(positions)} dataloader(s) but {len(loaders)} were prepared; "
            "prepare the same dataloaders as the run that saved it."
        )
    for loader, position in zip(loaders, positions, strict=True):
        loader.load_state_dict(position)
    for optimizer, steps in zip(optimizers, manifest.get("optimizer_steps", []), strict=False):
        optimizer.steps = steps
    gradient_state.step = manifest.get("accumulation_step", 0)


def rotate_checkpoints(directory: Path, *, total_limit: int, protect: Path | None = None) -> list[Path]:
    """Delete intact checkpoints older than the newest ``total_limit`` intact ones, except ``protect``.

    Only intact checkpoints count, so a damaged one never takes the place of one that loads; damaged
    ones are left as they are (with a warning), for a person to look at. Rotation runs after every
    commit, so "intact" is the cheap check, ``read_manifest(verify_checksums=False)``: the manifest's
    fields and digest, its files against what it records, no symbolic links, and every size; not
    the sha256 of every file of every kept checkpoint on each save. Symbolic links named
    ``checkpoint_N`` are neither counted nor followed (see :func:`committed_checkpoints`), and a
    folder that cannot be deleted is warned about: the new checkpoint is committed either way.

    Returns:
        The folders deleted.
    """
    intact = [path for path in committed_checkpoints(directory) if _is_intact_by_size(path)]
    keep = {path.resolve() for path in intact[-total_limit:]}
    if protect is not None:
        keep.add(protect.resolve())
    deleted = []
    for path in intact:
        if path.resolve() in keep:
            continue
        try:
            shutil.rmtree(path)  # refuses a symbolic link swapped in since the listing
        except OSError as error:
            warnings.warn(f"Rotation could not delete {path} ({_reason(error)}); delete it by hand.", stacklevel=2)
        else:
            deleted.append(path)
    return deleted


def _is_intact_by_size(checkpoint: Path) -> bool:
    try:
        read_manifest(checkpoint, verify_checksums=False)
    except CheckpointError as error:
        warnings.warn(f"Rotation keeps {checkpoint.name} without counting it: {error}", stacklevel=3)
        return False
    return True


def load_training_state(
    checkpoint: Path,
    state: TrainingState,
    *,
    rank: int,
    world_size: int,
    accumulation_steps: int,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Restore ``state`` in place from a committed checkpoint folder.

    On the world size it was saved with, every rank gets its own RNG streams back. On another, the
    streams are re-derived from the checkpoint (deterministically, one per rank), and a checkpoint
    saved in the middle of a gradient accumulation cycle is refused: its pending gradients belong
    to the ranks that computed them.

    Returns:
        The checkpoint's manifest.

    Raises:
        CheckpointError: The folder is incomplete or damaged, or holds a different set of objects.
    """
    manifest = read_manifest(checkpoint, verify_checksums=verify_checksums)
    if manifest["state_format"] == "dcp" and state.fsdp is None:
        raise CheckpointError(
            f"{checkpoint} holds FSDP's sharded model and optimizer state, but the prepared models are not sharded; "
            "prepare them with an FSDP plugin (on any number of processes) to load it."
        )
    files, contents = manifest["files"], manifest["contents"]
    saved_world = manifest["world_size"]
    mid_cycle = manifest.get("accumulation_step", 0) % manifest.get("accumulation_steps", 1) != 0
    if mid_cycle and (saved_world != world_size or manifest.get("accumulation_steps") != accumulation_steps):
        raise CheckpointError(
            f"{checkpoint} was saved in the middle of a gradient accumulation cycle by {saved_world} process(es) "
            f"with gradient_accumulation_steps={manifest.get('accumulation_steps')}; resume it with the same "
            "settings, or save at a cycle boundary to change them."
        )
    if contents["models"] != len(state.models):
        raise CheckpointError(
            f"{checkpoint} holds {contents['models']} model(s) but {len(state.models)} were prepared; prepare "
            "the same models as the run that saved it."
        )
    dcp = manifest["state_format"] == "dcp"
    for i, model in enumerate(state.models):
        _load_model_state(checkpoint, i, model, files, dcp=dcp, sharded_model=state.fsdp is not None)
    for i, optimizer in enumerate(state.optimizers):
        _load_optimizer_state(checkpoint, i, optimizer, state, files, dcp=dcp)
    _load_each(checkpoint, state.schedulers, SCHEDULER_NAME, ".bin", files)
    if state.scaler is not None and contents["scaler"]:
        state.scaler.load_state_dict(_torch_load(checkpoint / SCALER_NAME))
    for i, obj in enumerate(state.custom_objects):
        name = custom_state_name(i)
        if name not in files:
            raise CheckpointError(f"{checkpoint} has no {name} for registered object {i}; register the same objects.")
        obj.load_state_dict(_torch_load(checkpoint / name))
    if saved_world == world_size:
        set_rng_state(_torch_load(checkpoint / rng_state_name(rank)))
    else:
        derive_rng_state(_torch_load(checkpoint / rng_state_name(0)), rank)
    if mid_cycle:
        _load_gradients(checkpoint / gradients_name(rank), state.models)
    return manifest


def derive_rng_state(saved: dict[str, Any], rank: int) -> None:
    """Seed every generator of this rank from a saved state and the rank: reproducible, distinct per rank."""
    digest = hashlib.sha256(saved["torch"].numpy().tobytes() + rank.to_bytes(4, "little")).digest()
    set_seed(int.from_bytes(digest[:8], "little") % 2**63)


def _load_gradients(path: Path, models: Sequence[torch.nn.Module]) -> None:
    gradients = load_safetensors(path)
    for i, model in enumerate(models):
        for name, parameter in model.named_parameters():
            saved = gradients.get(f"{i}.{name}")
            parameter.grad = None if saved is None else saved.to(parameter.device, parameter.dtype)


def _listed_in(files: dict, folder: str) -> set[str]:
    """The names of the files the manifest lists in a DCP ``folder`` (its ``.metadata`` aside)."""
    return {name[len(folder) + 1 :] for name in files if name.startswith(f"{folder}/")} - {DCP_METADATA_NAME}


def _load_model_state(
    checkpoint: Path, i: int, model: torch.nn.Module, files: dict, *, dcp: bool, sharded_model: bool
) -> None:
    """Model ``i`` from DCP shards (saved under sharded FSDP) or safetensors, into a sharded or plain model."""
    folder = indexed_name(MODEL_NAME, i, "")
    try:
        if dcp:
            sharded_state.load_model(checkpoint / folder, model, listed=_listed_in(files, folder))
            return
        path = checkpoint / indexed_name(MODEL_NAME, i, ".safetensors")
        if sharded_model:
            sharded_state.load_model(load_safetensors(path), model)
            return
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError) as error:
        detail = str(error).strip().splitlines()[-1].strip() if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"{checkpoint / folder} does not fit the prepared model ({detail}); load a checkpoint of the same model."
        ) from None
    _load_model(path, model)


def _load_optimizer_state(
    checkpoint: Path, i: int, optimizer: Any, state: TrainingState, files: dict, *, dcp: bool
) -> None:
    folder = indexed_name(OPTIMIZER_NAME, i, "")
    name = f"{folder}/{DCP_METADATA_NAME}" if dcp else indexed_name(OPTIMIZER_NAME, i, ".bin")
    if name not in files:
        raise CheckpointError(f"{checkpoint} has no {name}; prepare the same objects as the run that saved it.")
    if dcp:
        sharded_state.load_optimizer(checkpoint / folder, optimizer, state.models, listed=_listed_in(files, folder))
        return
    saved = _torch_load(checkpoint / name)
    if state.fsdp is not None:  # a full optimizer state, keyed by parameter name
        sharded_state.load_optimizer(saved, optimizer, state.models)
    else:
        optimizer.load_state_dict(saved)


def _load_model(path: Path, model: torch.nn.Module) -> None:
    state_dict = load_safetensors(path)
    try:
        result = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as error:  # shape mismatches raise even when not strict
        detail = str(error).strip().splitlines()[-1].strip()
        raise CheckpointError(
            f"{path} does not fit the prepared model ({detail}); load a checkpoint of the same model."
        ) from None
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{path} does not fit the prepared model (missing keys: {result.missing_keys[:5]}, unexpected "
            f"keys: {result.unexpected_keys[:5]}); load a checkpoint of the same model."
        )


def _load_each(checkpoint: Path, objects: Sequence[Any], stem: str, suffix: str, files: dict) -> None:
    for i, obj in enumerate(objects):
        name = indexed_name(stem, i, suffix)
        if name not in files:
            raise CheckpointError(f"{checkpoint} has no {name}; prepare the same objects as the run that saved it.")
        obj.load_state_dict(_torch_load(checkpoint / name))


class Checkpointer:
    """``save_state``/``load_state`` of one Accelerator: its hooks, naming, commits (also in the
    background), rotation, and the checkpoint it loaded. The Accelerator's verbs delegate here."""

    def __init__(self) -> None:
        # OrderedDict, not dict: torch's RemovableHandle keeps a weak reference to it.
        self.save_hooks: OrderedDict[int, Callable] = OrderedDict()
        self.load_hooks: OrderedDict[int, Callable] = OrderedDict()
        self.loaded: Path | None = None
        self._committer: ThreadPoolExecutor | None = None  # rank 0's background commits
        self._pending: Future | None = None  # on rank 0 only
        self._in_flight = False  # known on every rank

    @staticmethod
    def register(hooks: OrderedDict, hook: Callable) -> RemovableHandle:
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def _state(self, accelerator, models: list, weights: list | None = None) -> TrainingState:
        return TrainingState(
            models=models,
            optimizers=accelerator._optimizers,
            schedulers=accelerator._schedulers,
            scaler=accelerator.scaler,
            custom_objects=accelerator._custom_objects,
            weights=weights,
            fsdp=getattr(accelerator._strategy, "checkpoint_format", None),
        )

    def _target(self, accelerator, output_dir: str | os.PathLike | None) -> Path:
        config = accelerator.project_configuration
        if config.automatic_checkpoint_naming:
            if output_dir is not None:
                warnings.warn("save_state(output_dir) is ignored under automatic_checkpoint_naming.", stacklevel=4)
            # Rank 0 picks the number and everyone writes there: the ranks can never disagree on it.
            chosen = next_automatic_checkpoint(config) if accelerator.is_main_process else None
            target = Path(broadcast_object_list([chosen])[0])
            config.iteration = checkpoint_number(target)
            return target
        if output_dir is None:
            raise ValueError(
                "save_state() needs an output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)."
            )
        target = Path(output_dir)
        check_writable_target(target)  # every rank sees the same folder, so every rank raises alike
        return target

    def save(self, accelerator, output_dir, *, metadata: dict[str, Any] | None, async_commit: bool) -> Path:
        self.wait(accelerator)
        config = accelerator.project_configuration
        target = self._target(accelerator, output_dir)
        models = [accelerator.unwrap_model(model) for model in accelerator._models]
        # Under FSDP the weights are shards, saved through DCP or gathered during the save: hooks get none.
        sharded = getattr(accelerator._strategy, "checkpoint_format", None) is not None
        weights = [] if sharded else [model.state_dict() for model in models]

        def run_hooks(staging: Path) -> None:
            for hook in self.save_hooks.values():
                hook(models, weights, str(staging))

        state = self._state(accelerator, models, weights)
        gradient_state = accelerator.gradient_state
        # Between syncs each rank holds gradients it has not shared yet; they are part of the state.
        state.save_gradients = gradient_state.step % gradient_state.num_steps != 0
        rotate = None
        if config.automatic_checkpoint_naming and config.total_limit is not None:
            rotate = partial(rotate_checkpoints, target.parent, total_limit=config.total_limit, protect=self.loaded)
        if async_commit and self._committer is None:
            self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        facts = engine_metadata(accelerator._dataloaders, accelerator._optimizers, gradient_state)
        self._pending = save_training_state(
            target,
            state,
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            barrier=accelerator.wait_for_everyone,
            first_failure=lambda failure: next(filter(None, gather_object([failure])), None),
            iteration=config.iteration if config.automatic_checkpoint_naming else None,
            metadata={**facts, **(metadata or {})},
            before_write=run_hooks,
            after_commit=rotate,
            committer=self._committer if async_commit else None,
        )
        self._in_flight = async_commit
        if config.automatic_checkpoint_naming:
            config.iteration += 1
        return target

    def wait(self, accelerator) -> None:
        """Rank 0 waits for its background commit, then every rank learns how it went and raises alike."""
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

    def load(self, accelerator, input_dir, *, verify_checksums: bool) -> None:
        self.wait(accelerator)
        accelerator.wait_for_everyone()  # a checkpoint rank 0 was still committing is now visible to all
        config = accelerator.project_configuration
        if input_dir is None:
            if not (config.automatic_checkpoint_naming and config.project_dir):
                raise ValueError("load_state() needs an input_dir unless automatic_checkpoint_naming is on.")
            found = committed_checkpoints(checkpoints_dir(config.project_dir))
            if not found:
                raise CheckpointNotFoundError(
                    f"No complete checkpoint in {checkpoints_dir(config.project_dir)} to load."
                )
            input_dir = found[-1]
        checkpoint = Path(input_dir)
        models = [accelerator.unwrap_model(model) for model in accelerator._models]
        for hook in self.load_hooks.values():
            hook(models, str(checkpoint))
        manifest = load_training_state(
            checkpoint,
            self._state(accelerator, models),
            rank=accelerator.process_index,
            world_size=accelerator.num_processes,
            accumulation_steps=accelerator.gradient_state.num_steps,
            verify_checksums=verify_checksums,
        )
        restore_engine_metadata(
            manifest, checkpoint, accelerator._dataloaders, accelerator._optimizers, accelerator.gradient_state
        )
        if manifest["world_size"] != accelerator.num_processes:
            warnings.warn(
                f"{checkpoint.name} was saved by {manifest['world_size']} process(es) and is loaded by "
                f"{accelerator.num_processes}: the data continues exactly, random streams are re-derived per rank.",
                stacklevel=3,  # the caller of Accelerator.load_state
            )
        self.loaded = checkpoint
        number = checkpoint_number(checkpoint)
        if config.automatic_checkpoint_naming and number is not None:
            config.iteration = number + 1
