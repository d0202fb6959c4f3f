"""Model weights on disk: safetensors files, shards with an index, and loading them back.

safetensors refuses tensors that share memory (tied embeddings, for one). We store each shared
tensor once and record the other names as aliases in the file's metadata, so a state dict
round-trips exactly. Read back, the aliases are data from whoever wrote the file: anything but a JSON
object mapping names the file lacks to tensors it holds is one CheckpointError sentence. Nothing here
unpickles arbitrary objects: ``.bin`` files are read with ``torch.load(weights_only=True)`` (and written
through :mod:`runner.engine.checkpoint.torch_files`).

The writers fail with the OSError behind a failed write (a full disk, say): safetensors reports it
inside a ``SafetensorError``, which would hide it from the callers that turn it into one sentence.

safetensors writes a file's metadata from a Rust ``HashMap``, so with more than one entry (ours:
``format`` and ``aliases``) their order, and so the file's bytes, changed from one save to the next.
We put the entries in sorted order once the file is written: the same tensors and metadata always
give the same bytes, and two runs that computed the same weights leave identical files.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
from collections.abc import Collection, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.torch_files import torch_save
from runner.engine.constants import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_SHARD_PATTERN,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_SHARD_PATTERN,
)
from runner.files import write_atomically

_ALIASES_KEY = "aliases"
# save_model_files marks its index jsons, its record of the files it wrote, with this metadata entry.
_WRITER_KEY, _WRITER = "written_by", "runner save_model"
_OS_ERROR_IN_MESSAGE = re.compile(r"\(os error (\d+)\)")
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
    """Write a state dict to one safetensors file, tied tensors stored once.

    Raises:
        OSError: The write failed (its errno and reason, and ``path``).
    """
    tensors, aliases = split_shared_tensors(state_dict)
    _save_file(tensors, path, {"format": "pt", _ALIASES_KEY: json.dumps(aliases)})


def _save_file(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> None:
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as error:  # "Error while serializing: I/O error: No space left on device (os error 28)"
        match = _OS_ERROR_IN_MESSAGE.search(str(error))
        if match is None:
            raise
        code = int(match.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None
    _sort_metadata(path)


def _sort_metadata(path: str | os.PathLike) -> None:
    """Rewrite the safetensors header of ``path`` with its metadata entries in sorted order, in place.

    The header keeps its length (the same entries, another order; safetensors pads it with spaces), so
    no tensor moves; the tensors' own entries keep safetensors' order, which is already fixed.
    """
    with open(path, "r+b") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
        metadata = header.get("__metadata__")
        if not metadata or len(metadata) < 2:
            return
        header["__metadata__"] = dict(sorted(metadata.items()))
        header = {"__metadata__": header.pop("__metadata__"), **header}
        rewritten = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(rewritten) > length:  # cannot happen for the same entries; never move the tensors' bytes
            raise RuntimeError(f"the sorted safetensors header of {path} is longer than the one written")
        file.seek(8)
        file.write(rewritten.ljust(length, b" "))


def load_safetensors(
    path: str | os.PathLike, device: str | torch.device = "cpu", *, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by :func:`save_safetensors` (or by anyone else): every tensor, or only those
    ``names`` asks for (an alias brings the tensor it names); no other tensor's bytes are read.

    Raises:
        CheckpointError: The file's ``aliases`` metadata is not a JSON object naming tensors the file holds.
    """
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        stored = list(f.keys())
        aliases = _aliases(path, f.metadata(), stored)
        wanted = set(stored) if names is None else {aliases.get(name, name) for name in names}
        state_dict = {name: f.get_tensor(name) for name in stored if name in wanted}
    for name, target in aliases.items():
        if target in state_dict and (names is None or name in names):
            state_dict[name] = state_dict[target]
    return state_dict


def safetensors_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Each tensor's name and shape in a safetensors file, its aliases included, from the header alone: no tensor's
    bytes are read, so a file that declares more than memory holds costs nothing to look at.

    Raises:
        CheckpointError: The file's ``aliases`` metadata is not a JSON object naming tensors the file holds.
    """
    with safe_open(str(path), framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
        aliases = _aliases(path, f.metadata(), list(shapes))
    return {**shapes, **{name: shapes[target] for name, target in aliases.items()}}


def _aliases(path: str | os.PathLike, metadata: dict[str, str] | None, stored: list[str]) -> dict[str, str]:
    """The file's aliases (name -> stored name), each checked: the metadata is data from whoever wrote the file."""
    try:
        aliases = json.loads((metadata or {}).get(_ALIASES_KEY, "{}"))
    except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
        aliases = None
    if not isinstance(aliases, dict) or not all(isinstance(v, str) for v in aliases.values()):
        raise CheckpointError(
            f"{path}: its {_ALIASES_KEY} metadata is not a JSON object of tensor names (name -> stored name); the file "
            "is damaged, so write it again or load a different one."
        )
    known = set(stored)
    for name, target in aliases.items():
        if name in known:
            wrong = f"maps {name!r}, a tensor the file holds itself, to {target!r}"
        elif target not in known:
            wrong = f"maps {name!r} to {target!r}, a tensor the file does not hold"
        else:
            continue
        raise CheckpointError(
            f"{path}: its {_ALIASES_KEY} metadata {wrong}; the file is damaged, so write it again or load a different "
            "one."
        )
    return aliases


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


def save_model_files(
    state_dict: Mapping[str, torch.Tensor],
    save_directory: str | os.PathLike,
    *,
    max_shard_size: int | str = "10GB",
    safe_serialization: bool = True,
) -> list[Path]:
    """Write ``state_dict`` as one weights file, or as shards when it is larger, and an index json listing them.

    The index json (HF's ``weight_map``, marked as ours) is the record of what a save wrote. Once the
    new files are written, the files the previous save's index of ours lists (under our own names)
    and this save did not rewrite are removed, so the folder never mixes two saves; nothing else in
    it is deleted. Every file is written under a temporary name and renamed into place, so a
    symbolic link in the folder is replaced, never written through.

    Returns:
        The files written, the index last.

    Raises:
        ValueError: ``save_directory`` is a file or a symbolic link, or holds weights this function
            did not write that loading the folder would pick before the new ones.
    """
    directory = _weights_directory(Path(save_directory))
    tensors, aliases = split_shared_tensors(state_dict)
    shards = _shard(tensors, parse_size(max_shard_size))
    single, index_name, pattern = (
        (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_SHARD_PATTERN)
        if safe_serialization
        else (WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_SHARD_PATTERN)
    )
    previous = _recorded_files(directory)
    _refuse_shadowing_weights(directory, index_name, previous)
    names = (
        [single]
        if len(shards) == 1
        else [pattern.format(index=i, total=len(shards)) for i in range(1, len(shards) + 1)]
    )
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards, strict=True):
        _write_shard(shard, directory / name, aliases, safe_serialization=safe_serialization)
        weight_map.update(dict.fromkeys(shard, name))
    weight_map.update({alias: weight_map[target] for alias, target in aliases.items()})
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total_size, _WRITER_KEY: _WRITER}, "weight_map": weight_map}
    text = json.dumps(index, indent=2, sort_keys=True)
    write_atomically(directory / index_name, lambda p: p.write_text(text))
    written = [directory / name for name in (*names, index_name)]
    for name in sorted(previous - {path.name for path in written}):
        _remove_regular_file(directory / name)
    return written


def _write_shard(
    shard: dict[str, torch.Tensor], path: Path, aliases: dict[str, str], *, safe_serialization: bool
) -> None:
    # Each shard records only the aliases of tensors it holds, so it loads on its own.
    shard_aliases = {alias: target for alias, target in aliases.items() if target in shard}
    if safe_serialization:
        metadata = {"format": "pt", _ALIASES_KEY: json.dumps(shard_aliases)}
        write_atomically(path, lambda p: _save_file(shard, p, metadata))
    else:
        shard_with_aliases = dict(shard)
        shard_with_aliases.update({alias: shard[target] for alias, target in shard_aliases.items()})
        write_atomically(path, lambda p: torch_save(shard_with_aliases, p))


def _weights_directory(directory: Path) -> Path:
    if directory.is_symlink():
        raise ValueError(
            f"save_model writes only into a real folder, but {directory} is a symbolic link; pass the folder it "
            "points to, or another path."
        )
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_model needs a directory, but {directory} is a file; pass a folder path.")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


_SHARD_NAMES = {
    SAFE_WEIGHTS_INDEX_NAME: (SAFE_WEIGHTS_NAME, re.compile(r"model-\d{5}-of-\d{5}\.safetensors")),
    WEIGHTS_INDEX_NAME: (WEIGHTS_NAME, re.compile(r"pytorch_model-\d{5}-of-\d{5}\.bin")),
}


def _recorded_files(directory: Path) -> set[str]:
    """The files an earlier save_model_files wrote into ``directory``, as its index jsons record them."""
    recorded = set()
    for index_name, (single, shard) in _SHARD_NAMES.items():
        weight_map = _own_weight_map(directory / index_name)
        if weight_map is not None:
            recorded.add(index_name)
            recorded |= {name for name in weight_map.values() if name == single or shard.fullmatch(str(name))}
    return recorded


def _own_weight_map(path: Path) -> dict | None:
    """The weight_map of an index json that save_model_files wrote, else None (never read through a link)."""
    if not _is_regular_file(path):
        return None
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    if not isinstance(metadata, dict) or metadata.get(_WRITER_KEY) != _WRITER:
        return None
    weight_map = index.get("weight_map")
    return weight_map if isinstance(weight_map, dict) else None


def _refuse_shadowing_weights(directory: Path, index_name: str, ours: set[str]) -> None:
    """Refuse weights of someone else's that load_state_dict_files would read instead of the new ones."""
    order = (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME)
    for name in order[: order.index(index_name)]:
        if name not in ours and os.path.lexists(directory / name):
            raise ValueError(
                f"{directory / name} was not written by save_model, and loading {directory} would read it instead of "
                "the new weights; move it away, or save to another folder."
            )


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _remove_regular_file(path: Path) -> None:
    if _is_regular_file(path):
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
