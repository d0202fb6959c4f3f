"""``runner.models.with_peft``: a declared model wrapped with adapters by the ``peft`` package (LoRA and its kin),
so only the adapters train.

    model:
      _target_: runner.models.with_peft
      model:                                   # any model node: here, the weights of a shakespeare_hf run
        _target_: runner.models.from_run
        source: outputs/2026-12-01/10-00-00
        model: {_target_: transformers.GPT2LMHeadModel, config: {...}}
      config:                                  # peft's own config class and keys
        _target_: peft.LoraConfig
        r: 8
        lora_alpha: 16
        target_modules: [c_attn, c_proj]

The base weights are frozen (``requires_grad=False``), so the optimizer holds only the adapters. Checkpoints
hold the whole model (base and adapters), so a resume is exact on any strategy; the final ``model/`` holds the
adapters in PEFT's own format (``adapter_config.json``, ``adapter_model.safetensors``), which
``PeftModel.from_pretrained(base, folder)`` loads; ``runner export --merge-lora`` writes the merged weights.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

from torch import nn

logger = logging.getLogger("runner")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def with_peft(model: nn.Module, config: Any, **given) -> nn.Module:
    """``model`` with the adapters ``config`` (a ``peft.PeftConfig``, e.g. ``peft.LoraConfig``) declares; returns
    the ``peft.PeftModel``. ``given``: what a recipe passes a model it builds (the language model's
    ``vocab_size``): the model node must already say the same.

    Raises:
        ValueError: One sentence: ``config`` is not a peft config, names a module ``model`` does not have (with
            the closest name it has) or one LoRA does not adapt, or peft refuses the pair.
    """
    import peft

    from runner.models.run_weights import check_given

    if not isinstance(model, nn.Module):
        raise ValueError(f"with_peft's model is {type(model).__name__}, not a torch module; give it a model node.")
    check_given(model, given)
    if not isinstance(config, peft.PeftConfig):
        raise ValueError(
            f"with_peft's config is {type(config).__name__}, not a peft config; give it a node such as "
            "{_target_: peft.LoraConfig, r: 8, target_modules: [...]}."
        )
    config = _plain(config)
    _check_targets(model, config)
    try:
        with warnings.catch_warnings():  # peft asks transformers a question transformers has renamed
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = peft.get_peft_model(model, config)
    except (ValueError, AttributeError, TypeError) as error:  # peft's own checks, or a task the model is not for
        message = " ".join(str(error).split())
        message = message if len(message) <= 200 else message[:197] + "..."
        raise ValueError(
            f"peft could not wrap {type(model).__name__} with {type(config).__name__} ({type(error).__name__}: "
            f"{message}); check model.config against the model (its task_type, its target_modules)."
        ) from None
    if not any(parameter.is_meta for parameter in wrapped.parameters()):  # not the launcher's check
        trainable, total = wrapped.get_nb_trainable_parameters()
        logger.info(
            "%s adapters on %s: %s of %s parameters train (%.2f%%)",
            getattr(config.peft_type, "value", config.peft_type), type(model).__name__, f"{trainable:,}",
            f"{total:,}", 100 * trainable / max(total, 1),
        )  # fmt: skip
    return wrapped


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` (unwrapped) is a ``peft.PeftModel``; False where peft is not installed."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer gets: a peft model's adapters only (its frozen base has no optimizer state); any other
    model's parameters, all of them, as before."""
    if is_peft(model):
        return [parameter for parameter in model.parameters() if parameter.requires_grad]
    return list(model.parameters())


def save_adapter(model: nn.Module, state_dict: dict, directory: str | os.PathLike) -> list[Path]:
    """Write ``model``'s adapters in PEFT's format into ``directory``, taken from ``state_dict`` (the whole model's,
    gathered from every process); returns the files written."""
    directory = Path(directory)
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    return [directory / name for name in ADAPTER_FILES]


def _plain(config: Any) -> Any:
    """``config`` with OmegaConf lists and dicts (what Hydra passes for YAML values) as Python ones, as peft writes
    its fields to JSON and tests them with ``isinstance(..., list)``."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    changes = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
            changes[field.name] = set(value) if field.name == "target_modules" else value
    return dataclasses.replace(config, **changes) if changes else config


def _check_targets(model: nn.Module, config: Any) -> None:
    """Every name in ``config.target_modules`` (a list; a string is a regex, left to peft) ends a module's name."""
    targets = getattr(config, "target_modules", None)
    if targets is None or isinstance(targets, str):
        return
    modules = [(name, module) for name, module in model.named_modules() if name]
    last = sorted({name.rsplit(".", 1)[-1] for name, module in modules if _adaptable(module)})
    for target in sorted(targets):
        if target == "all-linear":
            continue
        matches = [module for name, module in modules if name == target or name.endswith(f".{target}")]
        if any(_adaptable(module) for module in matches):
            continue
        if matches:
            raise ValueError(
                f"The target module {target!r} of {type(model).__name__} is a {type(matches[0]).__name__}, which LoRA "
                f"does not adapt; name its layers in target_modules instead: {', '.join(last[:12])}"
                f"{', ...' if len(last) > 12 else ''}."
            )
        close = difflib.get_close_matches(target, last, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"The target module {target!r} is not in {type(model).__name__}{hint}; set target_modules to names of its "
            f"layers: {', '.join(last[:12])}{', ...' if len(last) > 12 else ''}."
        )


def _adaptable(module: nn.Module) -> bool:
    """A layer LoRA adapts: linear (transformers' ``Conv1D`` too), convolution, embedding."""
    kinds = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    return isinstance(module, kinds) or type(module).__name__ == "Conv1D"
