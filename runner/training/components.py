"""What a recipe builds from the config's ``_target_`` nodes, and how a batch meets the model and the loss.

- :func:`build` instantiates one node; a constructor that rejects a value becomes one sentence
  naming the config key (a bug inside the user's code keeps its traceback).
- :func:`build_loaders` turns ``data.train`` / ``data.eval`` and the loader options into DataLoaders.
- A batch is ``(inputs, targets)`` (inputs a tensor, a tuple or a dict of tensors) or a dict
  (Hugging Face style, ``model(**batch)``). ``loss`` is called as ``loss(outputs, targets)``, or is
  ``"model"`` when the model returns its own loss (``outputs.loss``, ``outputs["loss"]`` or a scalar).
  For a dict batch with a ``loss`` node, its ``labels`` entry is the targets.
- :func:`save_final_model` writes the final ``model/`` folder (a peft model's adapters in PEFT's format);
  :func:`save_pretrained_config` completes the final model's folder for a Hugging Face model, so
  ``from_pretrained`` loads it.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.config import MODEL_COMPUTES_LOSS, ConfigError
from runner.folders import launch_record

# Errors by which a constructor says a value is wrong (torch raises RuntimeError for a negative size, an
# ``assert`` on an argument is AssertionError); anything else raised inside is a bug (traceback).
_REJECTIONS = (ValueError, TypeError, FileNotFoundError, RuntimeError, AssertionError)
LABELS = "labels"  # the targets of a dict batch (Hugging Face's name)


class BatchError(ValueError):
    """A batch, a model's output or a metric's result of a shape the recipe cannot use: one sentence saying
    what arrived and what is expected."""


def build(node, *, key: str, target: str | None = None, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate(node, **kwargs)``, with a rejected value reported as a ConfigError naming ``key``
    (and ``target``, by default the node's).

    Raises:
        ConfigError: The constructor raised ValueError, TypeError or FileNotFoundError.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from runner.data.download import DataFileError, DownloadError

    try:
        built = instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if cause is None:  # Hydra's own complaint (a node it cannot call): its first line says which
            raise ConfigError(f"{key}: {str(error).splitlines()[0]}") from None
        if isinstance(cause, (DataFileError, DownloadError)) or not isinstance(cause, _REJECTIONS):
            raise cause from None
        where = _failed_inside(error, node)
        if where is not None:  # a nested node's constructor failed (loss.weight, say): name that one
            inner = OmegaConf.select(node, where)
            raise rejected(f"{key}.{where}", inner._target_, cause, arguments=_arguments(inner)) from None
        raise rejected(key, target or node._target_, cause, arguments={**_arguments(node), **kwargs}) from None
    launch_record.note_generators(key, built)  # state no checkpoint saves, for the run's record
    return built


def _failed_inside(error: Exception, node) -> str | None:
    """The path below ``node`` of the nested ``_target_`` node whose call failed (Hydra names its full key)."""
    found = re.search(r"^full_key: (\S+)$", str(error), re.MULTILINE)
    own = node._get_full_key(None) if isinstance(node, DictConfig) else ""
    if found is None or found.group(1) == own:
        return None
    where = found.group(1)[len(own) + 1 :] if own else found.group(1)
    inner = OmegaConf.select(node, where) if where else None
    return where if isinstance(inner, DictConfig) and "_target_" in inner else None


def call(factory, *args: Any, key: str, target: str) -> Any:
    """``factory(*args)`` for a built ``_partial_`` node (an optimizer given its parameters, say), with a
    rejected value reported as a ConfigError naming ``key``."""
    try:
        return factory(*args)
    except _REJECTIONS as error:
        raise rejected(key, target, error, arguments=getattr(factory, "keywords", None)) from None


def rejected(key: str, target: str, error: BaseException, *, arguments: Mapping | None = None) -> ConfigError:
    """One sentence for a constructor that rejected the values under ``key``:
    ``model: MnistCNN(channels=0, hidden=128) failed: <its message>; fix the model.* keys.``

    A message that is a whole sentence (it ends with a period: ours say what to change) is kept as
    it is; a terse one ("Invalid learning rate: -1.0") is told where to fix it.
    """
    message = str(error).strip().splitlines()[0].strip() if str(error).strip() else type(error).__name__
    shown = {name: value for name, value in (arguments or {}).items() if not str(name).startswith("_")}
    positional = [_short(value) for value in (arguments or {}).get("_args_", None) or []]
    values = ", ".join([*positional, *(f"{name}={_short(value)}" for name, value in shown.items())])
    if len(values) > 160:
        values = values[:157] + "..."
    called = f"{target.rsplit('.', 1)[-1]}({values})"
    if message.endswith("."):
        return ConfigError(f"{key}: {called} failed: {message}")
    return ConfigError(f"{key}: {called} failed: {message}; fix the {key}.* keys.")


def _arguments(node) -> dict:
    """The node's keys with their values, resolved where they resolve."""
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation that does not resolve (OmegaConf raises several types): as written
        return OmegaConf.to_container(node, resolve=False)


def _short(value: Any) -> str:
    """A value as the message shows it: nested nodes and tensors are not spelled out."""
    from omegaconf import ListConfig

    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    if isinstance(value, Mapping):
        return "{...}"
    if isinstance(value, (list, tuple)) and len(value) <= 4 and all(isinstance(v, (int, float, str)) for v in value):
        return repr(list(value))
    if isinstance(value, (int, float, str, bool, type(None))):
        return repr(value)
    return f"<{type(value).__name__}>"


# ------------------------------------------------------------------------------------------------ data
def build_loaders(data, *, seed: int, datasets: tuple[Any, Any]):
    """The train loader (shuffled from ``seed`` when ``data.shuffle``) and the eval loader (None without one)."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    collate_fn = build(data.collate_fn, key="data.collate_fn") if data.collate_fn is not None else None
    options = {
        "num_workers": data.num_workers,
        "collate_fn": collate_fn,
        "pin_memory": data.pin_memory,
        "persistent_workers": data.persistent_workers,
    }
    train_set, eval_set = datasets
    iterable = isinstance(train_set, IterableDataset)  # an iterable dataset streams in its own order
    shuffle = data.shuffle and not iterable
    generator = torch.Generator().manual_seed(seed) if shuffle else None  # the prepared loader shuffles from it
    train_loader = DataLoader(
        train_set, batch_size=data.batch_size, shuffle=shuffle, drop_last=data.drop_last, generator=generator,
        **options,
    )  # fmt: skip
    eval_loader = None
    if eval_set is not None:
        eval_loader = DataLoader(eval_set, batch_size=data.eval_batch_size, **options)
    return train_loader, eval_loader


def build_datasets(data, accelerator) -> tuple[Any, Any]:
    """``data.train`` and ``data.eval`` (None when null), built on the main process first (caches, downloads)."""
    with accelerator.main_process_first():
        train_set = build(data.train, key="data.train")
        eval_set = build(data.eval, key="data.eval") if data.eval is not None else None
    return train_set, eval_set


def build_loss(loss):
    """The loss callable of ``loss`` (None for ``loss: model``)."""
    return None if loss == MODEL_COMPUTES_LOSS else build(loss, key="loss")


# --------------------------------------------------------------------------------------------- batches
def split_batch(batch: Any, *, model_loss: bool) -> tuple[Any, Any]:
    """``(inputs, targets)`` of a batch; for a dict batch, targets are its ``labels`` (None with ``loss: model``).

    Raises:
        BatchError: The batch is neither a pair nor a dict, or a dict without labels for a ``loss`` node.
    """
    if isinstance(batch, Mapping):
        if model_loss:
            return batch, None
        if LABELS not in batch:
            raise BatchError(
                f"A dict batch (keys {', '.join(map(str, batch))}) needs a {LABELS!r} entry for the loss node to "
                "compare against; add it in the dataset or collate_fn, or set loss=model if the model computes "
                "its own loss."
            )
        return {k: v for k, v in batch.items() if k != LABELS}, batch[LABELS]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise BatchError(
        f"A batch arrived as {_describe(batch)}; the recipe expects (inputs, targets) or a dict of tensors "
        "(model(**batch)); return one of those from the dataset's __getitem__ or from data.collate_fn."
    )


def labels(inputs: Any, targets: Any) -> Any:
    """The targets metrics compare with: ``targets``, or a dict batch's ``labels`` when the model took them.

    Raises:
        BatchError: A dict batch without labels.
    """
    if targets is not None or not isinstance(inputs, Mapping):
        return targets
    if LABELS not in inputs:
        raise BatchError(
            f"The metrics compare outputs with targets, but the dict batch (keys {', '.join(map(str, inputs))}) has "
            f"no {LABELS!r} entry; add it in the dataset or collate_fn, or declare no metrics."
        )
    return inputs[LABELS]


def forward(model, inputs: Any, targets: Any = None, *, model_loss: bool = False) -> Any:
    """``model(inputs)``, ``model(*inputs)`` or ``model(**inputs)``; with ``loss: model`` the targets go along."""
    args, kwargs = call_arguments(inputs, targets, model_loss=model_loss)
    return model(*args, **kwargs)


def call_arguments(inputs: Any, targets: Any = None, *, model_loss: bool = False) -> tuple[tuple, dict]:
    """The positional and keyword arguments :func:`forward` calls the model with."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    extra = (targets,) if model_loss and targets is not None else ()
    if isinstance(inputs, (tuple, list)):
        return (*inputs, *extra), {}
    return (inputs, *extra), {}


def compute_loss(loss_fn, outputs: Any, targets: Any):
    """``loss_fn(outputs, targets)``, or the loss the model returned (``loss_fn`` None).

    Raises:
        BatchError: The model was to return its loss but its output holds none.
    """
    import torch

    if loss_fn is not None:
        return loss_fn(outputs, targets)
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        loss = outputs
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise BatchError(
            f"With loss=model the model must return its loss (outputs.loss, outputs['loss'] or a scalar tensor), "
            f"but it returned {_describe(outputs)}; return the loss, or declare a loss node."
        )
    return loss


def predictions(outputs: Any):
    """What metrics and the eval loss see of a model's output: the tensor itself, or its ``logits``."""
    import torch

    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise BatchError(
            f"The model returned {_describe(outputs)}; metrics need a tensor or outputs with 'logits' to compare "
            "with the targets."
        )
    return logits


def batch_size(inputs: Any) -> int:
    """The number of samples in ``inputs`` (a tensor, or the first tensor of a tuple or dict)."""
    import torch

    if isinstance(inputs, torch.Tensor):
        return len(inputs)
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    return next((len(v) for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), 0)


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, Mapping):
        return f"a {type(value).__name__} with keys {', '.join(map(str, value))}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


# ----------------------------------------------------------------------------------------- final model
def save_final_model(accelerator, model, directory: str | os.PathLike) -> None:
    """The run's final ``model/`` folder (every process calls it: under FSDP the weights are gathered).

    A model wrapped with ``peft`` adapters (:func:`runner.models.with_peft`) is saved as its adapters in PEFT's
    format; any other as its whole weights, with ``config.json`` for a transformers model
    (:func:`save_pretrained_config`).
    """
    from runner.models.adapters import is_peft, save_adapter

    unwrapped = accelerator.unwrap_model(model)
    if is_peft(unwrapped):
        state_dict = accelerator.get_state_dict(model)
        if accelerator.is_main_process:
            save_adapter(unwrapped, state_dict, directory)
        accelerator.wait_for_everyone()
        return
    accelerator.save_model(model, directory)
    if accelerator.is_main_process:
        save_pretrained_config(unwrapped, directory)


def save_pretrained_config(model, directory: str | os.PathLike) -> list[Path]:
    """Write ``config.json`` (and ``generation_config.json`` when the model can generate) of a transformers
    model into ``directory``, beside the weights ``save_model`` wrote there; returns the files written.

    With them the folder is a Hugging Face model: ``AutoModelForCausalLM.from_pretrained(directory)``
    loads it (the weights are ``model.safetensors``; a tied head is stored once, or under FSDP as an equal copy).
    ``config.architectures`` names the model's class, as ``save_pretrained`` records it: FSDP2 renames the
    class of a sharded module to ``FSDP<name>``, and the prefix is dropped again. ``config.dtype`` is the
    parameters' dtype. The model's own config is left as it is. Any other model (not a transformers
    ``PreTrainedModel``; transformers is not imported for the question) writes nothing.

    Args:
        model: The unwrapped model (``accelerator.unwrap_model(model)``); call on the main process only.
        directory: The folder ``accelerator.save_model`` wrote.
    """
    transformers = sys.modules.get("transformers")  # no transformers model can exist unless it was imported
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return []
    from transformers.utils import CONFIG_NAME, GENERATION_CONFIG_NAME

    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.save_pretrained(directory)
    written = [Path(directory) / CONFIG_NAME]
    if model.can_generate() and model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
        written.append(Path(directory) / GENERATION_CONFIG_NAME)
    return written
