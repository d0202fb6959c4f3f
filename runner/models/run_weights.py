"""``runner.models.from_run``: a model declared in YAML, started from the weights of another run.

    model:
      _target_: runner.models.from_run
      source: outputs/2026-12-01/10-00-00      # a run folder, a checkpoint, or a weights folder
      model:                                   # the model to build, as any model node
        _target_: transformers.GPT2LMHeadModel
        config: {_target_: transformers.GPT2Config, n_layer: 4, ...}

The model is built as its node says, then takes the weights ``source`` holds: a finished run's final
``model/`` (an unfinished run's newest intact checkpoint), any checkpoint (one process, DDP, FSDP or tensor
parallel shards), or a weights folder (``runner export``'s, ``save_model``'s, a Hugging Face model's
``model.safetensors``). The folder's own config is never read: the code that runs is the model node here.

The folder is data from whoever wrote it. A symbolic link in it (or in the run a ``checkpoints/<name>`` or
``model/`` belongs to) is refused, and so is a weights file with other names (a hard link): either would read a
file that is not the run's. A Hugging Face cache snapshot, whose files are links to its blobs, is copied first
(``cp -rL``). The names and shapes in the files' headers are compared with the model before any tensor is read,
and only the tensors the model takes are read.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.model_weights import ModelWeights, find_model_weights


def from_run(
    source: str | os.PathLike, model: nn.Module, strict: bool = True, reads: str = "source", **given
) -> nn.Module:
    """``model`` with the weights of ``source`` (see the module docstring); returns ``model``.

    With ``strict``, every parameter and buffer of ``model`` must be in ``source`` (a tied weight may be there
    under one of its names, as Hugging Face stores a tied head) and ``source`` may hold nothing else.
    ``reads`` says what the weights come from, and the runner sets it (:func:`reading`): ``"source"``, or
    ``"checkpoint"`` where a checkpoint is loaded into the model next (a resume, ``runner eval``, ``runner
    generate``; ``source`` is not read, and may be gone), or ``"check"`` for the launcher's check on the meta
    device (``source`` must exist; nothing is read).
    ``given``: what a recipe passes a model it builds (the language model's ``vocab_size``, from its data):
    the model node must already say the same, since the model was built before this call.

    Raises:
        ValueError: One sentence: ``source`` holds no weights, damaged ones, or weights of another model.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"from_run's model is {type(model).__name__}, not a torch module; give it a model node.")
    if reads not in READS:
        raise ValueError(f"from_run's reads={reads!r} is not one of {', '.join(READS)}; leave it out.")
    check_given(model, given)
    if reads == "checkpoint":
        return model  # a resume, or a verb after training: the checkpoint holds every weight (source may be gone)
    if reads == "check" or any(parameter.is_meta for parameter in model.parameters()):
        if not Path(source).expanduser().exists():  # the launcher's check, on the meta device: read nothing
            folder = Path(source).expanduser().absolute()
            raise ValueError(
                f"{folder} does not exist; pass a run folder or a checkpoint folder (checkpoints/checkpoint_N)."
            )
        return model
    weights = _found_weights(source)
    expected = dict(model.state_dict(keep_vars=True))
    tied = _tied_names(model)
    _check_fits(model, weights, expected=expected, tied=tied, strict=strict)
    try:  # only what the model takes: a tensor it does not (strict=False) is never read
        tensors = weights.read([name for name in weights.shapes if name in expected])
    except CheckpointError as error:
        raise ValueError(str(error)) from None
    with torch.no_grad():
        for name, tensor in tensors.items():
            if name in expected:
                expected[name].copy_(tensor)
        for name, names in tied.items():  # a tied weight present under one name only: the others share it
            if name not in tensors and (other := next((n for n in names if n in tensors), None)) is not None:
                expected[name].copy_(tensors[other])
    return model


def _found_weights(source: str | os.PathLike) -> ModelWeights:
    """The weights ``source`` holds, their headers read, once no link is found where they are."""
    from runner.config import ConfigError
    from runner.folders.layout import check_no_links

    path = Path(source).expanduser().absolute()
    try:
        check_no_links(_folder_to_check(path))
        return find_model_weights(path)
    except (ConfigError, CheckpointError) as error:
        raise ValueError(str(error)) from None


def _folder_to_check(path: Path) -> Path:
    """The folder walked for links: the run a ``checkpoints/<name>`` or ``model/`` belongs to (either may be the
    link), else ``path`` itself, which the user named (it and the folders above it may be links)."""
    from runner.engine.constants import CHECKPOINTS_DIR
    from runner.folders.layout import MODEL_DIR, resumed_run_folder

    folder = resumed_run_folder(str(path))
    if folder.name == MODEL_DIR and (folder.parent / CHECKPOINTS_DIR).is_dir():
        return folder.parent
    return folder


def _check_fits(
    model: nn.Module,
    weights: ModelWeights,
    *,
    expected: dict[str, torch.Tensor],
    tied: dict[str, tuple[str, ...]],
    strict: bool,
) -> None:
    """Refuse weights of other names or shapes, from the files' headers: before any tensor is read."""
    shapes = weights.shapes
    missing = [name for name in expected if name not in shapes and not any(n in shapes for n in tied.get(name, ()))]
    unexpected = [name for name in shapes if name not in expected]
    mismatched = [
        f"{name} {shapes[name]} for {tuple(expected[name].shape)}"
        for name in shapes
        if name in expected and shapes[name] != tuple(expected[name].shape)
    ]
    if mismatched or (strict and (missing or unexpected)):
        found = "; ".join(
            f"{label}: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
            for label, names in (("missing", missing), ("unexpected", unexpected), ("other shapes", mismatched))
            if names
        )
        raise ValueError(
            f"The weights in {weights.folder} are not {type(model).__name__}'s ({found}); point model.source at a run "
            "of this model, or build the model its weights were saved from."
        )


def check_given(model: nn.Module, given: dict) -> None:
    """What a recipe passes a model node that wraps one already built (the language model's ``vocab_size``, from
    its data) must be what the inner node built: one sentence naming the key to set otherwise."""
    for key, value in given.items():
        if getattr(model, key, value) != value:
            raise ValueError(
                f"The data needs {key}={value}, and model.model builds {type(model).__name__} with "
                f"{key}={getattr(model, key)}; set model.model.{key}={value}."
            )


READS = ("source", "checkpoint", "check")  # what from_run's weights come from (see its ``reads``)
_TARGETS = ("runner.models.from_run", "runner.models.run_weights.from_run")


def reading(node: DictConfig, reads: str) -> DictConfig:
    """A copy of the model node ``node`` in which every ``runner.models.from_run`` reads as ``reads`` says:
    ``"checkpoint"`` where a checkpoint is loaded into the model next, ``"check"`` for the launcher's check."""
    copied = copy.deepcopy(node)  # keeps its place in the config: ${...} in it resolve as in the original

    def visit(each: Any) -> None:
        if OmegaConf.is_list(each):
            for item in each:
                visit(item)
        elif OmegaConf.is_dict(each):
            if each.get("_target_") in _TARGETS:
                with open_dict(each):
                    each.reads = reads
            for key in each:
                visit(each._get_node(key))

    visit(copied)
    return copied


def _tied_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter or buffer name that shares its tensor with others, mapped to those others."""
    groups: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(tensor), []).append(name)
    return {name: tuple(n for n in group if n != name) for group in groups.values() if len(group) > 1 for name in group}
