"""``merge_fsdp_weights``: one sharded (DCP) folder of an FSDP checkpoint, consolidated into a single file.

The folder is data from whoever wrote it, read as :mod:`runner.engine.checkpoint.sharded_state` reads it: DCP's own
loader, with a reader that unpickles only DCP's metadata classes and a planner that reads values with
``torch.load(weights_only=True)``; the metadata may point only at the folder's own files, and none of them may be a
link. Only the main process reads and writes (the merge holds every tensor whole in its memory); the others wait for
its verdict, so a bad folder raises the same error on every rank instead of leaving them waiting.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runner.engine.checkpoint.model_weights import check_not_linked
from runner.engine.checkpoint.serialization import save_safetensors
from runner.engine.checkpoint.sharded_state import load_whole_dcp_state
from runner.engine.checkpoint.torch_files import torch_save
from runner.engine.constants import DCP_METADATA_NAME, MODEL_NAME, OPTIMIZER_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME
from runner.engine.ops import broadcast_object_list
from runner.files import write_atomically

logger = logging.getLogger("runner")


def merge_fsdp_weights(
    checkpoint_dir: str | os.PathLike,
    output_path: str | os.PathLike,
    safe_serialization: bool = True,
    remove_checkpoint_dir: bool = False,
) -> Path:
    """Merge the shards of an FSDP checkpoint's model (or optimizer) folder into one file in ``output_path``.

    For a checkpoint ``save_state`` wrote with the FSDP plugin's ``SHARDED_STATE_DICT`` (the default): pass its
    ``model/`` folder (``model_1/`` for the second model; ``optimizer/`` with ``safe_serialization=False``). The
    result loads into a plain, unsharded model. The merge runs on the CPU of the main process, which holds every
    tensor whole; when a process group exists every process must call it, and all return when it is done.

    Args:
        checkpoint_dir: The DCP folder of the sharded state (it holds ``.metadata`` and ``*.distcp`` files).
        output_path: The folder to write ``model.safetensors`` (or ``pytorch_model.bin``) into; made if missing.
        safe_serialization: Write safetensors (tensors only); False writes ``torch.save``'s ``pytorch_model.bin``.
        remove_checkpoint_dir: Delete ``checkpoint_dir`` once the merged file is written.

    Returns:
        The merged file's path (on every process).

    Raises:
        ValueError: ``checkpoint_dir`` is missing or not a DCP folder (one sentence naming it), its files are damaged
            or links, it holds more than tensors under ``safe_serialization``, or ``output_path`` is a file or lies
            inside the folder to be removed.

    Example:
        >>> merge_fsdp_weights("outputs/run/checkpoints/checkpoint_3/model", "outputs/run/merged")
        >>> model.load_state_dict(safetensors.torch.load_file("outputs/run/merged/model.safetensors"))
    """
    arguments = (Path(checkpoint_dir), Path(output_path), safe_serialization, remove_checkpoint_dir)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _merge(*arguments)
    # [merged file, the main process's error message, whether that error is a ValueError]
    verdict: list[Any] = [None, None, False]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            verdict[0] = _merge(*arguments)
        except Exception as error:
            failure = error
            is_value_error = isinstance(error, ValueError)  # a bad folder: the same sentence on every process
            verdict[1:] = [str(error) if is_value_error else f"{type(error).__name__}: {error}", is_value_error]
    # The other processes wait here while the main process merges (Accelerate's wait_for_everyone after it), and
    # learn its outcome: had it raised before this broadcast, they would wait until the group's timeout.
    broadcast_object_list(verdict)
    if failure is not None:
        raise failure
    merged, message, is_value_error = verdict
    if message is None:
        return merged
    if is_value_error:
        raise ValueError(message)
    raise RuntimeError(f"The main process failed to merge {checkpoint_dir} ({message}).")


def _merge(checkpoint_dir: Path, output_path: Path, safe_serialization: bool, remove_checkpoint_dir: bool) -> Path:
    folder = checkpoint_dir.expanduser().absolute()
    listed = _dcp_files(folder)
    output = output_path.expanduser().absolute()
    if remove_checkpoint_dir and output.resolve().is_relative_to(folder.resolve()):
        raise ValueError(
            f"merge_fsdp_weights would write into {output} and then remove {folder}, which holds it; pass an "
            "output_path outside the checkpoint folder."
        )
    if output.exists() and not output.is_dir():
        raise ValueError(f"merge_fsdp_weights writes into a folder, but {output} is a file; pass a folder path.")
    logger.info("Merging the sharded state in %s", folder)
    state = load_whole_dcp_state(folder, listed)
    if len(state) == 1:  # save_state's {"model": {...}} or {"optimizer": {...}}
        state = next(iter(state.values()))
    if safe_serialization and not all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ValueError(
            f"{folder} holds more than tensors (an optimizer's state), which safetensors cannot store; merge it with "
            "safe_serialization=False."
        )
    output.mkdir(parents=True, exist_ok=True)
    merged = output / (SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME)
    write_atomically(merged, lambda partial: (save_safetensors if safe_serialization else torch_save)(state, partial))
    logger.info("Merged %s into %s", folder, merged)
    if remove_checkpoint_dir:
        logger.info("Removing %s", folder)
        shutil.rmtree(folder)
    return merged


def _dcp_files(folder: Path) -> list[str]:
    """The names of the files of the DCP folder ``folder``, each its own (not a link).

    Raises:
        ValueError: ``folder`` is missing, a file, or holds no DCP metadata (then, if it is a whole checkpoint, which
            folder in it to pass); a file in it is a link.
    """
    if not folder.is_dir():
        state = "is a file" if folder.exists() else "does not exist"
        raise ValueError(
            f"merge_fsdp_weights: {folder} {state}; pass the sharded model folder of an FSDP checkpoint "
            f"(checkpoints/checkpoint_N/{MODEL_NAME})."
        )
    if not (folder / DCP_METADATA_NAME).is_file():
        inside = [name for name in (MODEL_NAME, OPTIMIZER_NAME) if (folder / name / DCP_METADATA_NAME).is_file()]
        fix = f"pass {folder / inside[0]} instead" if inside else "pass the model folder of a sharded FSDP checkpoint"
        raise ValueError(
            f"{folder} is not a torch.distributed.checkpoint folder (it has no {DCP_METADATA_NAME} file); {fix}."
        )
    names = []
    for path in sorted(folder.iterdir()):
        check_not_linked(path)
        if path.is_file() and path.name != DCP_METADATA_NAME:
            names.append(path.name)
    return names
