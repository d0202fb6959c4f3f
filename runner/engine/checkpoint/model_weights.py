"""A model's whole weights from a folder, whatever wrote them, read on one process: what ``runner export`` writes
out and ``runner.models.from_run`` loads.

- :func:`find_checkpoint`: a checkpoint folder, or a run folder's newest intact checkpoint, its files hashed.
- :func:`checkpoint_model_state`: one model's whole state dict from a checkpoint of any strategy (one
  process, DDP: a safetensors file; FSDP and tensor parallelism: DCP shards, gathered here without a
  process group).
- :func:`read_model_weights`: from a run folder (its final ``model/``, else its newest checkpoint), a
  checkpoint, or a weights folder (``save_model``'s, ``runner export``'s, a Hugging Face model's
  safetensors).

Only data is read: safetensors, DCP metadata through :func:`runner.engine.checkpoint.sharded_state.read_dcp_metadata`.
Every error is one :class:`~runner.engine.checkpoint.manifest.CheckpointError` sentence naming the folder.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from runner.engine.checkpoint.manifest import CheckpointError
from runner.engine.constants import (
    CHECKPOINTS_DIR,
    MANIFEST_NAME,
    MODEL_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    indexed_name,
)

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


def checkpoint_model_state(checkpoint: Path, manifest: dict[str, Any], index: int = 0) -> dict[str, torch.Tensor]:
    """Model ``index``'s whole state dict from a checkpoint whose ``manifest`` was read (and its files checked).

    Raises:
        CheckpointError: There is no model ``index``, or its files are not what the manifest says.
    """
    from runner.engine.checkpoint.loading import ListedCheckpoint
    from runner.engine.checkpoint.serialization import load_safetensors
    from runner.engine.checkpoint.sharded_state import load_full_model_state

    models = manifest["contents"]["models"]
    if not 0 <= index < models:
        choices = "0" if models == 1 else f"0 to {models - 1}"
        raise CheckpointError(
            f"{checkpoint} holds {models} model{'s' if models != 1 else ''}, so there is no model {index}; give "
            f"{choices}."
        )
    listed = ListedCheckpoint(checkpoint, manifest["state_format"], manifest["files"])
    if manifest["state_format"] == "dcp":
        folder = indexed_name(MODEL_NAME, index, "")
        return load_full_model_state(checkpoint / folder, listed.listed_in(folder))
    return load_safetensors(listed.require(indexed_name(MODEL_NAME, index, ".safetensors")))


def read_model_weights(source: str | Path, *, final_folder: str = "model") -> tuple[dict[str, torch.Tensor], Path]:
    """The whole weights ``source`` holds, and the folder they were read from.

    ``source`` is a weights folder (``model.safetensors``, or its index and shards), a run folder (its
    ``final_folder`` when the run finished, else its newest intact checkpoint), or a checkpoint folder.

    Raises:
        CheckpointError: Nothing there holds weights, or what does is damaged.
    """
    folder = Path(source).expanduser().absolute()
    for weights in (folder, folder / final_folder):
        if (weights / SAFE_WEIGHTS_NAME).is_file() or (weights / SAFE_WEIGHTS_INDEX_NAME).is_file():
            try:
                return _read_weights_folder(weights), weights
            except (OSError, ValueError, SafetensorError) as error:
                raise CheckpointError(
                    f"{weights} holds weights that cannot be read ({type(error).__name__}: {error}); they are damaged, "
                    "so write them again or point at a checkpoint."
                ) from None
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
    return checkpoint_model_state(checkpoint, manifest), checkpoint


def _read_weights_folder(folder: Path) -> dict[str, torch.Tensor]:
    """``model.safetensors``, or the shards its index names: only plain ``*.safetensors`` names inside ``folder``,
    never a pickle and never a path that leads elsewhere (the index is data from wherever the folder came from)."""
    from runner.engine.checkpoint.serialization import load_safetensors

    if (folder / SAFE_WEIGHTS_NAME).is_file():
        return load_safetensors(_plain_file(folder / SAFE_WEIGHTS_NAME))
    index = json.loads(_plain_file(folder / SAFE_WEIGHTS_INDEX_NAME).read_text())
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{SAFE_WEIGHTS_INDEX_NAME} has no weight_map")
    state_dict: dict[str, torch.Tensor] = {}
    for shard in dict.fromkeys(weight_map.values()):
        if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
            raise ValueError(f"{SAFE_WEIGHTS_INDEX_NAME} names {shard!r}, not a .safetensors file in this folder")
        state_dict.update(load_safetensors(_plain_file(folder / shard)))
    missing = set(weight_map) - set(state_dict)
    if missing:
        raise ValueError(f"{SAFE_WEIGHTS_INDEX_NAME} lists {sorted(missing)[0]!r}, which no shard holds")
    return state_dict


def _plain_file(path: Path) -> Path:
    """``path``, if it is a regular file (or a link to one, as in Hugging Face's cache): not a pipe or a device,
    which reading would wait on."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError(f"{path.name} is not a regular file (a pipe or a device, which reading would wait on)")
    return path
