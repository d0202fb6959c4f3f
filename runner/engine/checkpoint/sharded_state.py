"""Model and optimizer state through torch.distributed.checkpoint (DCP): FSDP's checkpoints.

Under FSDP every rank writes its own shards of each model (``model/``, ``model_1/``, ...) and
optimizer (``optimizer/``, ...) into the checkpoint's staging folder; DCP records in each folder's
``.metadata`` how the shards tile the full tensors, so loading reshards onto any number of
processes (under FSDP; a manifest records the format, and only the FSDP strategy loads this one).
With ``FULL_STATE_DICT`` the states are gathered to rank 0 on the CPU instead and written as
without FSDP.

Loading reads only data. DCP pickles ``.metadata`` and its own reader unpickles it without limits,
and its default planner reads non-tensor values (an optimizer's ``lr``) with
``torch.load(weights_only=False)``; both would run code from a crafted checkpoint. Here the reader
(passed as ``storage_reader=``) unpickles only DCP's metadata classes and lets the metadata point
only at the files the manifest lists, and the planner reads values with ``weights_only=True``.

Every function here is a collective when a process group exists: every rank calls it, in the same
order.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.constants import DCP_METADATA_NAME, MODEL_NAME, OPTIMIZER_NAME


def save_dcp(state: dict, folder: Path) -> None:
    """DCP's save of ``state`` as the folder ``folder`` (a collective when distributed)."""
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process():
        dcp.save(state, checkpoint_id=folder, no_dist=not _distributed())


def _load(state: dict, folder: Path, listed: Collection[str]) -> None:
    """DCP's load, reading only data (see :func:`read_dcp_metadata`), with its failure (a BaseException
    carrying each rank's error) as one CheckpointError."""
    import torch.distributed.checkpoint as dcp

    reader_class, planner_class = _checked_dcp_classes()
    reader = reader_class(folder, listed)
    reader.read_metadata()  # refused here, on every rank alike, before DCP's first collective
    with _dcp_failures(
        lambda why: (
            f"{folder} does not fit the prepared model or optimizer ({why}); load a checkpoint of the same model."
        )
    ):
        dcp.load(state, storage_reader=reader, planner=planner_class(folder), no_dist=not _distributed())


@contextlib.contextmanager
def _dcp_failures(sentence: Callable[[str], str]) -> Iterator[None]:
    """Run a DCP load quietly; its failure becomes the ``CheckpointError`` a reader raised, or ``sentence`` of the
    first line of what failed."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            yield
    except CheckpointException as error:
        exception = _first_failure(error)
        if isinstance(exception, CheckpointError):
            raise exception from None
        raise CheckpointError(sentence(_first_line(exception))) from None


def _first_failure(error: Exception) -> BaseException:
    """The exception behind a ``CheckpointException`` (DCP's failure, carrying each rank's error)."""
    failure = next(iter(error.failures.values()))
    return failure[0] if isinstance(failure, tuple) else failure


def _first_line(exception: BaseException) -> str:
    return str(exception).strip().splitlines()[0] if str(exception).strip() else type(exception).__name__


# Everything the .metadata of a DCP save of a model or an optimizer pickles (torch 2.13, FSDP2 or a
# plain module): DCP's metadata dataclasses, its file-slice record, torch.Size, dtypes, layouts (by
# name) and the path it was saved to. Nothing here runs code when built from a pickle.
_DCP_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _RefusedGlobal(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only DCP metadata; any other class or function a pickle names is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in _DCP_METADATA_GLOBALS.get(module, ()) or is_dtype:
            return super().find_class(module, name)
        raise _RefusedGlobal(f"{module}.{name}")


def read_dcp_metadata(folder: Path, listed: Collection[str]) -> Any:
    """The DCP ``Metadata`` in ``folder/.metadata``, unpickled with only DCP's metadata classes.

    Args:
        folder: A DCP folder of a checkpoint (``model/``, ``optimizer_1/``, ...).
        listed: The names of the folder's files that the checkpoint's manifest lists; the metadata
            may point at no other file.

    Raises:
        CheckpointError: The file names a class or function DCP metadata never holds (a crafted
            pickle: refused before anything in it runs), is not DCP metadata, or points outside ``listed``.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = folder / DCP_METADATA_NAME
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except _RefusedGlobal as refused:
        raise CheckpointError(
            f"{path} is not DCP metadata: its pickle names {refused}, which DCP metadata never holds; the file was "
            "altered, so load a different checkpoint."
        ) from None
    except Exception as error:  # whatever a damaged pickle makes the allowed classes raise
        metadata = error
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(metadata, Metadata) or not isinstance(storage, dict):
        detail = (
            f"{type(metadata).__name__}: {metadata}" if isinstance(metadata, Exception) else type(metadata).__name__
        )
        raise CheckpointError(
            f"{path} is not DCP metadata ({detail.splitlines()[0]}); the file is corrupted, so load a different "
            "checkpoint."
        )
    for info in storage.values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(relative, str) or relative not in listed:
            raise CheckpointError(
                f"{path} points at {relative!r}, which is not a file of this checkpoint; the file was altered, so "
                "load a different checkpoint."
            )
    return metadata


@functools.cache
def _checked_dcp_classes() -> tuple[type, type]:
    """DCP's file reader and load planner, made to read data only (defined on first use: DCP imports slowly)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataCheckingReader(FileSystemReader):
        """FileSystemReader whose metadata is read by :func:`read_dcp_metadata` (DCP's own calls pickle.load)."""

        def __init__(self, folder: Path, listed: Collection[str]) -> None:
            super().__init__(folder)
            self.listed = frozenset(listed)
            self.metadata = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self.metadata is None:
                self.metadata = read_dcp_metadata(Path(self.path), self.listed)
                if getattr(self.metadata, "storage_meta", None) is None:
                    self.metadata.storage_meta = StorageMeta()
                self.metadata.storage_meta.load_id = self.load_id
            return self.metadata

    class PlainValuesLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner, but the non-tensor values (an optimizer's lr, betas, ...) are read with
        ``torch.load(weights_only=True)``: DCP's own reads them with ``weights_only=False``."""

        def __init__(self, folder: Path) -> None:
            super().__init__()
            self.folder = folder

        def load_bytes(self, read_item: Any, value: Any) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise CheckpointError(
                    f"{self.folder} holds a value for {fqn} that is not plain data; the checkpoint was altered, so "
                    "load a different one."
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return MetadataCheckingReader, PlainValuesLoadPlanner


@functools.cache
def _whole_state_planner_class() -> type:
    """DCP's ``_EmptyStateDictLoadPlanner`` (the state dict rebuilt from the metadata), reading non-tensor values as
    ``PlainValuesLoadPlanner`` does."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    _, plain_values_planner = _checked_dcp_classes()

    class WholeStateLoadPlanner(plain_values_planner, _EmptyStateDictLoadPlanner):
        pass

    return WholeStateLoadPlanner


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a case we mean."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _options(full: bool, *, flatten: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full, flatten_optimizer_state_dict=flatten)


def owner_of(optimizer: torch.optim.Optimizer, models: Sequence[nn.Module]) -> nn.Module:
    """The model whose parameters ``optimizer`` updates (DCP names optimizer state by parameter name)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if any(id(p) in params for p in model.parameters()):
            return model
    raise ValueError("An optimizer updates none of the prepared models' parameters; prepare its model too.")


def save_sharded(
    folder: Any,
    models: Sequence[nn.Module],
    optimizers: Sequence[Any],
    names,
    *,
    flatten: bool = False,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Every rank writes its shards of each model and optimizer through ``folder`` (a ``CheckpointWriter``).

    Args:
        flatten: Write the optimizers' state flattened by parameter name (``state.<name>.<key>``,
            ``param_groups.<name>.<key>``), torch's ``flatten_optimizer_state_dict``: where ranks hold different
            parameters (pipeline stages), their parameter groups' indices would name different parameters.
        aliases: Parameter names this rank's optimizer state is written under another name (a tied weight's
            alias -> its canonical name, the one the whole model's optimizer knows it by).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    for i, model in enumerate(models):
        folder.save_sharded({"model": get_model_state_dict(model, options=_options(False))}, names(MODEL_NAME, i, ""))
    for i, optimizer in enumerate(optimizers):
        inner = optimizer.optimizer
        state = get_optimizer_state_dict(owner_of(inner, models), inner, options=_options(False, flatten=flatten))
        if aliases:
            state = _renamed(state, aliases)
        folder.save_sharded({"optimizer": state}, names(OPTIMIZER_NAME, i, ""))


def _renamed(state: dict[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state with the parameters ``names`` maps renamed: flattened (``state.<old>.x`` becomes
    ``state.<new>.x``) or by parameter group (``state[<old>]`` becomes ``state[<new>]``, and in the groups)."""
    if isinstance(state.get("state"), dict):
        groups = [{**group, "params": [names.get(p, p) for p in group["params"]]} for group in state["param_groups"]]
        return {"state": {names.get(k, k): v for k, v in state["state"].items()}, "param_groups": groups}
    renamed = {}
    for key, value in state.items():
        for old, new in names.items():
            for section in ("state.", "param_groups."):
                if key.startswith(f"{section}{old}."):
                    key = f"{section}{new}.{key.removeprefix(f'{section}{old}.')}"
        renamed[key] = value
    return renamed


def flattened_optimizer(folder: Path, listed: Collection[str]) -> bool:
    """Whether the DCP optimizer folder ``folder`` holds its parameter groups flattened by parameter name."""
    metadata = read_dcp_metadata(folder, listed)
    prefix = "optimizer.param_groups."
    return any(
        key.startswith(prefix) and not key.removeprefix(prefix).split(".", 1)[0].isdigit()
        for key in metadata.state_dict_metadata
    )


def gather_full(models: Sequence[nn.Module], optimizers: Sequence[Any]) -> tuple[list[dict], list[dict]]:
    """The full model and optimizer states, gathered to rank 0's CPU (the other ranks get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = [get_model_state_dict(model, options=_options(True)) for model in models]
    states = [
        get_optimizer_state_dict(owner_of(opt.optimizer, models), opt.optimizer, options=_options(True))
        for opt in optimizers
    ]
    return weights, states


def load_model(source: Path | dict[str, torch.Tensor], model: nn.Module, *, listed: Collection[str] = ()) -> None:
    """Load a DCP folder (whose files the manifest lists as ``listed``), or a full state dict, into ``model``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if isinstance(source, dict):
        set_model_state_dict(model, source, options=_options(True))
        return
    state = {"model": get_model_state_dict(model, options=_options(False))}
    _load(state, source, listed)
    set_model_state_dict(model, state["model"], options=_options(False))


def load_full_model_state(
    folder: Path, listed: Collection[str], *, names: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """A DCP model folder's whole tensors (only those ``names`` lists, if given), read on this one process (no
    process group, no model): each tensor is allocated at the full shape its metadata records, and DCP fills it from
    every rank's shards. A tensor ``names`` leaves out is neither allocated nor read.

    Raises:
        CheckpointError: The metadata is not DCP's (see :func:`read_dcp_metadata`), or holds no tensors.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(folder, listed)
    prefix = "model."  # save_sharded's key, as load_model's
    full = {
        key.removeprefix(prefix): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
        and key.startswith(prefix)
        and (names is None or key.removeprefix(prefix) in names)
    }
    if not full:
        if names is not None:
            return {}
        raise CheckpointError(f"{folder} holds no model tensors; export a checkpoint of a model.")
    state = {"model": full}
    _load(state, folder, listed)
    return state["model"]


def load_whole_dcp_state(folder: Path, listed: Collection[str]) -> dict[str, Any]:
    """Everything the DCP folder ``folder`` holds (a model's tensors; an optimizer's state and param groups), whole,
    read on this one process without a process group or a model.

    DCP's own ``dcp_to_torch_save`` does this, with ``_EmptyStateDictLoadPlanner`` rebuilding the nested state dict
    from the metadata (each tensor allocated at its full shape, filled from every rank's shards); here with the
    reader and planner that read only data (the module's docstring). Its public ``dcp.load`` cannot: it keeps only
    the keys the state dict it is given already has, and this one starts empty.

    Args:
        folder: A DCP folder (``model/``, ``optimizer_1/``, ...).
        listed: The names of the folder's files the metadata may point at.

    Raises:
        CheckpointError: The metadata is not DCP's (see :func:`read_dcp_metadata`), or the files it points at cannot
            be read.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader_class, _ = _checked_dcp_classes()
    reader = reader_class(folder, listed)
    reader.read_metadata()  # refused here, before DCP allocates a tensor
    state: dict[str, Any] = {}
    with _dcp_failures(lambda why: f"{folder} holds shards that cannot be read ({why}); the checkpoint is damaged."):
        _load_state_dict(state, storage_reader=reader, planner=_whole_state_planner_class()(folder), no_dist=True)
    return state


def load_optimizer(
    source: Path | dict[str, Any],
    optimizer: Any,
    models: Sequence[nn.Module],
    *,
    listed: Collection[str] = (),
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Load a DCP folder (whose files the manifest lists as ``listed``), or a full optimizer state dict, into a
    prepared optimizer. A folder's state is read as it was written, flattened by parameter name or not (see
    :func:`save_sharded`); ``aliases`` as there. A state written by parameter group (not flattened) names each
    group's parameters as the model that wrote it held them: the groups' settings are read, and the parameters each
    group holds here are kept (a pipeline stage holds some of the whole model's)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    inner = optimizer.optimizer
    model = owner_of(inner, models)
    if isinstance(source, dict):
        set_optimizer_state_dict(model, inner, source, options=_options(True))
    else:
        flatten = flattened_optimizer(source, listed)
        options = _options(False, flatten=flatten)
        state = get_optimizer_state_dict(model, inner, options=options)
        held = None if flatten else [list(group["params"]) for group in state["param_groups"]]
        if aliases:
            state = _renamed(state, aliases)
        state = {"optimizer": state}
        _load(state, source, listed)
        loaded = state["optimizer"]
        if aliases:
            loaded = _renamed(loaded, {new: old for old, new in aliases.items()})
        if held is not None:  # each group's parameters as this optimizer holds them
            for group, params in zip(loaded["param_groups"], held, strict=True):
                group["params"] = params
        set_optimizer_state_dict(model, inner, loaded, options=options)
    for group in inner.param_groups:  # torch's loader hands tuples (Adam's betas) back as lists
        for key, default in inner.defaults.items():
            if isinstance(default, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])
