"""Model weights on disk: safetensors files, shards with an index, and loading them back.

safetensors refuses tensors that share memory (tied embeddings, for one). We store each shared
tensor once and record the other names as aliases in the file's metadata, so a state dict
round-trips exactly. Nothing here unpickles arbitrary objects: ``.bin`` files are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from runner.engine.constants import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_SHARD_PATTERN,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_SHARD_PATTERN,
)

_ALIASES_KEY = "aliases"
_SIZE_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"10GB"`` (decimal) or ``"500MiB"`` (binary)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r} is not a size; write it like '10GB', '500MiB' or 1000000.")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])


def split_shared_tensors(
    state_dict: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Separate a state dict into tensors to store and aliases (name -> stored name) of tied ones.

    Tensors that only partly overlap another (views into one buffer) are stored as copies.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    by_view: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        if tensor.device.type == "meta" or tensor.numel() == 0:
            tensors[name] = tensor.contiguous()
            continue
        pointer = tensor.untyped_storage().data_ptr()
        view = (pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if view in by_view:
            aliases[name] = by_view[view]
            continue
        by_view[view] = name
        if pointer in storages:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
        storages.add(pointer)
        tensors[name] = tensor
    return tensors, aliases


def save_safetensors(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write a state dict to one safetensors file, tied tensors stored once."""
    tensors, aliases = split_shared_tensors(state_dict)
    save_file(tensors, str(path), metadata={"format": "pt", _ALIASES_KEY: json.dumps(aliases)})


def load_safetensors(path: str | os.PathLike, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`save_safetensors` (or by anyone else)."""
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        state_dict = {name: f.get_tensor(name) for name in f.keys()}
        aliases = json.loads((f.metadata() or {}).get(_ALIASES_KEY, "{}"))
    for name, target in aliases.items():
        state_dict[name] = state_dict[target]
    return state_dict


def _shard(state_dict: Mapping[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _replace_atomically(write, path: Path) -> None:
    partial = path.with_name(path.name + ".tmp")
    write(partial)
    os.replace(partial, path)


def save_model_files(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write ``state_dict`` as one weights file, or as shards plus an index json when it is larger.

    Files a previous save left in ``save_directory`` under the same naming scheme are removed once
    the new ones are written, so the folder never mixes two saves.

    Returns:
        The files written.
    """
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_model needs a directory, but {directory} is a file; pass a folder path.")
    directory.mkdir(parents=True, exist_ok=True)
    tensors, aliases = split_shared_tensors(state_dict)
    shards = _shard(tensors, parse_size(max_shard_size))
    single, index_name, pattern = (
        (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_SHARD_PATTERN)
        if safe_serialization
        else (WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_SHARD_PATTERN)
    )

    def write_shard(shard: dict[str, torch.Tensor], path: Path) -> None:
        # Each shard records only the aliases of tensors it holds, so it loads on its own.
        shard_aliases = {alias: target for alias, target in aliases.items() if target in shard}
        if safe_serialization:
            metadata = {"format": "pt", _ALIASES_KEY: json.dumps(shard_aliases)}
            _replace_atomically(lambda p: save_file(shard, str(p), metadata=metadata), path)
        else:
            shard_with_aliases = dict(shard)
            shard_with_aliases.update({alias: shard[target] for alias, target in shard_aliases.items()})
            _replace_atomically(lambda p: torch.save(shard_with_aliases, p), path)

    written: list[Path] = []
    if len(shards) == 1:
        written.append(directory / single)
        write_shard(shards[0], written[0])
    else:
        weight_map: dict[str, str] = {}
        for number, shard in enumerate(shards, start=1):
            path = directory / pattern.format(index=number, total=len(shards))
            write_shard(shard, path)
            weight_map.update(dict.fromkeys(shard, path.name))
            written.append(path)
        weight_map.update({alias: weight_map[target] for alias, target in aliases.items()})
        total_size = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        index_path = directory / index_name
        _replace_atomically(lambda p: p.write_text(json.dumps(index, indent=2, sort_keys=True)), index_path)
        written.append(index_path)
    _remove_stale_weights(directory, keep=set(written))
    return written


def _remove_stale_weights(directory: Path, *, keep: set[Path]) -> None:
    patterns = ("model.safetensors", "model-*-of-*.safetensors", SAFE_WEIGHTS_INDEX_NAME,
                WEIGHTS_NAME, "pytorch_model-*-of-*.bin", WEIGHTS_INDEX_NAME)  # fmt: skip
    for pattern in patterns:
        for path in directory.glob(pattern):
            if path not in keep:
                path.unlink()


def _load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def load_state_dict_files(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read a weights file, an index json, or a folder holding either, into one CPU state dict."""
    path = Path(checkpoint)
    if path.is_dir():
        for name in (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise FileNotFoundError(
                f"{path} holds no {SAFE_WEIGHTS_NAME}, {WEIGHTS_NAME} or index json; point at a folder "
                "written by save_model or at a weights file."
            )
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {path} does not exist; check the path.")
    if not path.name.endswith(".index.json"):
        return _load_weights_file(path)
    weight_map = json.loads(path.read_text())["weight_map"]
    state_dict: dict[str, torch.Tensor] = {}
    for shard_name in dict.fromkeys(weight_map.values()):
        state_dict.update(_load_weights_file(path.parent / shard_name))
    return state_dict


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    strict: bool = False,
):
    """Load weights written by ``save_model`` (one file, or shards with an index) into ``model``.

    Args:
        model: The plain (unwrapped) module to load into; tensors are copied to its devices.
        checkpoint: A weights file, an index json, or the folder that holds them.
        dtype: Cast floating-point weights to this dtype first.
        strict: Raise on missing or unexpected keys (shape mismatches always raise).

    Returns:
        torch's ``(missing_keys, unexpected_keys)`` result.

    Example:
        >>> accelerator.save_model(model, "out/model")
        >>> load_checkpoint_in_model(fresh_model, "out/model")
    """
    state_dict = load_state_dict_files(checkpoint)
    if dtype is not None:
        state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    return model.load_state_dict(state_dict, strict=strict)
