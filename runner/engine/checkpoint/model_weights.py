"""A model's whole weights from a folder, whatever wrote them, read on one process: what ``runner export`` writes
out and ``runner.models.from_run`` loads.

- :func:`find_checkpoint`: a checkpoint folder, or a run folder's newest intact checkpoint, its files hashed.
- :func:`checkpoint_model_state`: one model's whole state dict from a checkpoint of any strategy (one
  process, DDP: a safetensors file; FSDP and tensor parallelism: DCP shards, gathered here without a
  process group).
- :func:`read_model_weights`: from a run folder (its final ``model/``, else its newest checkpoint), a
  checkpoint, or a weights folder (``save_model``'s, ``runner export``'s, a Hugging Face model's
  safetensors).
- :func:`find_model_weights`, :func:`checkpoint_model_weights`: the same weights, found and their headers read
  (each tensor's name and shape) but no tensor yet: a caller compares them with its model first, so a file whose
  header declares tensors larger than memory is refused before any is allocated.

Only data is read: safetensors, DCP metadata through :func:`runner.engine.checkpoint.sharded_state.read_dcp_metadata`.
A folder is data from whoever wrote it: a weights file that is a symbolic or hard link (its bytes those of some
other file) is refused, and so is the ``aliases`` metadata of a file when it names a tensor the file lacks.
Every error is one :class:`~runner.engine.checkpoint.errors.CheckpointError` sentence naming the folder.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.constants import (
    CHECKPOINTS_DIR,
    DCP_METADATA_NAME,
    MANIFEST_NAME,
    MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    indexed_name,
)
from runner.files import hard_link_sentence

logger = logging.getLogger("runner")

_FOLDERS = "a run folder or a checkpoint folder (checkpoints/checkpoint_N)"


def find_checkpoint(folder: str | Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint ``folder`` is, or the newest intact one of the run folder it is (newer damaged ones skipped
    with a warning), and its manifest, every listed file hashed.

    Raises:
        CheckpointError: The folder is missing, a file, neither kind, or holds no intact checkpoint.
    """
    from runner.engine.checkpoint.folders import newest_intact_checkpoint
    from runner.engine.checkpoint.manifest import read_manifest

    folder = Path(folder).expanduser().absolute()
    if folder.is_file():
        raise CheckpointError(f"{folder} is a file; pass {_FOLDERS}.")
    if not folder.is_dir():
        raise CheckpointError(f"{folder} does not exist; pass {_FOLDERS}.")
    if not (folder / MANIFEST_NAME).is_file():
        if not (folder / CHECKPOINTS_DIR).is_dir():
            raise CheckpointError(
                f"{folder} is neither a checkpoint (it has no {MANIFEST_NAME}) nor a run folder (it has no "
                f"{CHECKPOINTS_DIR}/ folder); pass one of those."
            )
        newest, skipped = newest_intact_checkpoint(folder / CHECKPOINTS_DIR)
        for damaged, error in skipped:
            logger.warning("Skipping %s: %s", damaged.name, error)
        if newest is None:
            raise CheckpointError(
                f"{folder} has no intact checkpoint in {folder / CHECKPOINTS_DIR}; point at a run or checkpoint that "
                "has one."
            )
        folder = newest
    return folder, read_manifest(folder)


@dataclass(frozen=True)
class ModelWeights:
    """A model's whole weights as found on disk, before a byte of any tensor is read: the folder, each tensor's name
    and shape as the files' headers declare them (compare them with a model first: a crafted header may declare more
    than memory holds), and :meth:`read`."""

    folder: Path
    shapes: dict[str, tuple[int, ...]]
    reader: Callable[[Collection[str] | None], dict[str, torch.Tensor]]

    def read(self, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
        """The tensors ``names`` lists (every one if None), read now.

        Raises:
            CheckpointError: The files cannot be read, or changed since their headers were read.
        """
        return self.reader(names)


def checkpoint_model_state(checkpoint: Path, manifest: dict[str, Any], index: int = 0) -> dict[str, torch.Tensor]:
    """Model ``index``'s whole state dict from a checkpoint whose ``manifest`` was read (and its files checked).

    Raises:
        CheckpointError: There is no model ``index``, or its files are not what the manifest says.
    """
    return checkpoint_model_weights(checkpoint, manifest, index).read()


def checkpoint_model_weights(checkpoint: Path, manifest: dict[str, Any], index: int = 0) -> ModelWeights:
    """Model ``index``'s weights in a checkpoint whose ``manifest`` was read (and its files checked), not yet read.

    Raises:
        CheckpointError: There is no model ``index``, its files are links or not what the manifest says.
    """
    from runner.engine.checkpoint.loading import ListedCheckpoint

    models = manifest["contents"]["models"]
    if not 0 <= index < models:
        choices = "0" if models == 1 else f"0 to {models - 1}"
        raise CheckpointError(
            f"{checkpoint} holds {models} model{'s' if models != 1 else ''}, so there is no model {index}; give "
            f"{choices}."
        )
    listed = ListedCheckpoint(checkpoint, manifest["state_format"], manifest["files"])
    if manifest["state_format"] == "dcp":
        return _dcp_weights(checkpoint / indexed_name(MODEL_NAME, index, ""), listed)
    path = listed.require(indexed_name(MODEL_NAME, index, ".safetensors"))
    check_not_linked(path)
    return _safetensors_weights(checkpoint, [path], damaged=_DAMAGED_CHECKPOINT)


def _dcp_weights(folder: Path, listed) -> ModelWeights:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from runner.engine.checkpoint.sharded_state import load_full_model_state, read_dcp_metadata

    names = listed.listed_in(folder.name)
    for name in (DCP_METADATA_NAME, *names):
        check_not_linked(folder / name)
    prefix = "model."  # save_sharded's key, as load_full_model_state's
    shapes = {
        key.removeprefix(prefix): tuple(entry.size)
        for key, entry in read_dcp_metadata(folder, names).state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata) and key.startswith(prefix)
    }
    return ModelWeights(folder.parent, shapes, lambda wanted: load_full_model_state(folder, names, names=wanted))


def read_model_weights(source: str | Path, *, final_folder: str = "model") -> tuple[dict[str, torch.Tensor], Path]:
    """The whole weights ``source`` holds, and the folder they were read from (see :func:`find_model_weights`).

    Raises:
        CheckpointError: Nothing there holds weights, or what does is damaged or a link.
    """
    weights = find_model_weights(source, final_folder=final_folder)
    return weights.read(), weights.folder


def find_model_weights(source: str | Path, *, final_folder: str = "model") -> ModelWeights:
    """The whole weights ``source`` holds, their headers read and no tensor yet.

    ``source`` is a weights folder (``model.safetensors``, or its index and shards), a run folder (its
    ``final_folder`` when the run finished, else its newest intact checkpoint), or a checkpoint folder.

    Raises:
        CheckpointError: Nothing there holds weights, or what does is damaged or a link.
    """
    folder = Path(source).expanduser().absolute()
    for weights in (folder, folder / final_folder):
        if (weights / SAFE_WEIGHTS_NAME).is_file() or (weights / SAFE_WEIGHTS_INDEX_NAME).is_file():
            return _weights_folder(weights)
    if folder.is_dir() and any(folder.glob("*.bin")) and not (folder / MANIFEST_NAME).is_file():
        raise CheckpointError(
            f"{folder} holds pickled weights (.bin), which are never unpickled here; convert them to safetensors "
            "(save_pretrained(..., safe_serialization=True)) or point at a run or checkpoint folder."
        )
    if folder.is_dir() and not (folder / MANIFEST_NAME).is_file() and not (folder / CHECKPOINTS_DIR).is_dir():
        raise CheckpointError(
            f"{folder} holds no {SAFE_WEIGHTS_NAME}, no checkpoint and no run; pass a weights folder, a run folder or "
            "a checkpoint folder (checkpoints/checkpoint_N)."
        )
    checkpoint, manifest = find_checkpoint(folder)
    return checkpoint_model_weights(checkpoint, manifest)


_DAMAGED_CHECKPOINT = "the checkpoint is damaged, so load a different one"


def _weights_folder(folder: Path) -> ModelWeights:
    """``model.safetensors``, or the shards its index names: only plain ``*.safetensors`` names inside ``folder``,
    never a pickle and never a path that leads elsewhere (the index is data from wherever the folder came from)."""
    is_checkpoint = (folder / MANIFEST_NAME).is_file()
    damaged = _DAMAGED_CHECKPOINT if is_checkpoint else "they are damaged, so write them again or point at a checkpoint"
    try:
        if (folder / SAFE_WEIGHTS_NAME).is_file():
            return _safetensors_weights(folder, [_plain_file(folder / SAFE_WEIGHTS_NAME)], damaged=damaged)
        weight_map = _weight_map(_plain_file(folder / SAFE_WEIGHTS_INDEX_NAME))
        shards = [_plain_file(folder / shard) for shard in dict.fromkeys(weight_map.values())]
        weights = _safetensors_weights(folder, shards, damaged=damaged)
    except CheckpointError:
        raise
    except (OSError, ValueError, SafetensorError) as error:
        raise _unreadable(folder, error, damaged=damaged) from None
    missing = set(weight_map) - set(weights.shapes)
    if missing:
        error = ValueError(f"{SAFE_WEIGHTS_INDEX_NAME} lists {sorted(missing)[0]!r}, which no shard holds")
        raise _unreadable(folder, error, damaged=damaged)
    return weights


def _weight_map(index_file: Path) -> dict[str, str]:
    index = json.loads(index_file.read_text())
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{SAFE_WEIGHTS_INDEX_NAME} has no weight_map")
    for shard in weight_map.values():
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise ValueError(f"{SAFE_WEIGHTS_INDEX_NAME} names {shard!r}, not a .safetensors file in this folder")
    return weight_map


def _safetensors_weights(folder: Path, files: list[Path], *, damaged: str) -> ModelWeights:
    """The weights in safetensors ``files`` (one, or a model's shards) of ``folder``, their headers read."""
    from runner.engine.checkpoint.serialization import load_safetensors, safetensors_shapes

    held: dict[Path, list[str]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            found = safetensors_shapes(path)
        except SafetensorError as error:
            raise _unreadable(folder, error, damaged=damaged) from None
        held[path] = list(found)
        shapes.update(found)

    def read(names: Collection[str] | None) -> dict[str, torch.Tensor]:
        state_dict: dict[str, torch.Tensor] = {}
        for path, stored in held.items():
            wanted = stored if names is None else [name for name in stored if name in names]
            try:
                state_dict.update(load_safetensors(path, names=wanted) if wanted else {})
            except (OSError, SafetensorError) as error:  # changed or gone since its header was read
                raise _unreadable(folder, error, damaged=damaged) from None
        return state_dict

    return ModelWeights(folder, shapes, read)


def _unreadable(folder: Path, error: Exception, *, damaged: str) -> CheckpointError:
    return CheckpointError(f"{folder} holds weights that cannot be read ({type(error).__name__}: {error}); {damaged}.")


def check_not_linked(path: Path) -> None:
    """Refuse ``path`` if it is a symbolic link, or a hard link (a file with other names, any of them perhaps outside
    the folder: reading it reads a file that is not the run's); nothing if it is not there.

    Raises:
        CheckpointError: One sentence naming the file and the fix.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}); a run folder holds no links, so copy the run with "
            "links resolved (cp -rL) and point at the copy."
        )
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
        raise CheckpointError(hard_link_sentence(path, info.st_nlink, then="point at the copy"))


def _plain_file(path: Path) -> Path:
    """``path``, if it is the folder's own regular file: not a link (see :func:`check_not_linked`), and not a pipe or
    a device, which reading would wait on."""
    check_not_linked(path)
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError(f"{path.name} is not a regular file (a pipe or a device, which reading would wait on)")
    return path
