"""The checks of what a run trains: recipe, data, model, loss, metrics and objective, where types cannot tell.

:func:`runner.config.validation.validate` calls them among its own checks. Each failure is one
:class:`~runner.config.ConfigError` sentence naming the key and the fix. Nothing here imports torch;
:func:`recipe_module` finds a recipe's module without importing it.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.config import CHAR_CORPUS, DIRECTIONS, MODEL_COMPUTES_LOSS, RECIPES, ConfigError, GPTConfig
from runner.config.value_checks import at_least, choice
from runner.data.mixture_weights import weights_problem

_SPLIT = re.compile(r"^(?P<name>[A-Za-z_]\w*)(\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")


def check_split(key: str, value: str) -> None:
    if not _SPLIT.match(value):
        raise ConfigError(
            f"{key}={value!r} is not a split; write a name with an optional slice, like 'train', 'test[:8000]' "
            "or 'train[:10%]'."
        )


def _is_node(value: Any) -> bool:
    return isinstance(value, DictConfig) and "_target_" in value


def check_data(cfg: DictConfig) -> None:
    """The datasets are ``_target_`` nodes, the loader options fit them, the presets' splits parse."""
    data = cfg.data
    if not _is_node(data.train):
        raise ConfigError(
            f"data.train={OmegaConf.select(cfg, 'data.train')!r} must be a node with a _target_ that builds the "
            "train dataset, e.g. {_target_: mylab.data.MyDataset, ...}; see `python -m runner --cfg job data=mnist`."
        )
    if data.eval is not None and not _is_node(data.eval):
        raise ConfigError(
            f"data.eval={data.eval!r} must be a node with a _target_ that builds the eval dataset, or null for no "
            "evaluation."
        )
    if data.collate_fn is not None and not (_is_node(data.collate_fn) and data.collate_fn.get("_partial_")):
        raise ConfigError(
            "data.collate_fn must be a _target_ node with _partial_: true (a function called with each list of "
            "samples), or null for torch's default collation."
        )
    if data.persistent_workers and data.num_workers == 0:
        raise ConfigError("data.persistent_workers=true needs worker processes; set data.num_workers to 1 or more.")
    for key in ("train_split", "eval_split"):
        if data[key] is not None:
            check_split(f"data.{key}", data[key])
    if data.val_fraction is not None and not 0 < data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction={data.val_fraction} must be between 0 and 1 (exclusive), e.g. 0.1.")
    at_least(cfg, "data.samples_per_epoch", 1, optional=True)
    check_mixture_weights(cfg)
    check_block_sizes(cfg)


_MIXTURES = ("runner.data.Mixture", "runner.data.mixture.Mixture")
_PACKINGS = ("runner.data.Packed", "runner.data.packing.Packed")
# The keys that hold a model's longest context: runner.models.GPT's, and Hugging Face configs' (GPT-2's, and most).
_CONTEXT_KEYS = ("n_positions", "max_position_embeddings")


def check_mixture_weights(cfg: DictConfig) -> None:
    """Every ``runner.data.Mixture`` of the data has weights its draws can use (as the Mixture itself checks), so a
    weight of inf, or a sum past the largest float, stops the run here rather than at its first step."""
    for key, node in _data_nodes(cfg):
        if _selected(node, "_target_") not in _MIXTURES or _selected(node, "weights") is None:
            continue
        weights = _selected(node, "weights")
        weights = OmegaConf.to_container(weights, resolve=True) if isinstance(weights, ListConfig) else weights
        problem = weights_problem(weights) if isinstance(weights, list) else "must be a list of numbers, or null"
        if problem is not None:
            raise ConfigError(f"{key}.weights={weights} {problem}.")


def check_block_sizes(cfg: DictConfig) -> None:
    """Every ``runner.data.Packed`` of the data cuts blocks no longer than the model's context, where the config
    gives both (the model's position embeddings would otherwise be indexed past their end at the first step)."""
    context = _model_context(cfg)
    if context is None:
        return
    context_key, positions = context
    for key, node in _data_nodes(cfg):
        size = _selected(node, "block_size")
        if _selected(node, "_target_") in _PACKINGS and type(size) is int and size > positions:
            raise ConfigError(
                f"{key}.block_size={size} is longer than the model's context, {context_key}={positions}; set "
                f"{key}.block_size to at most {positions} (or lengthen the model's context)."
            )


def _model_context(cfg: DictConfig) -> tuple[str, int] | None:
    """The key and value of the model's longest context, where its config says: runner.models.GPT's block_size,
    or a Hugging Face config's n_positions or max_position_embeddings, in the model's node or one inside it."""
    for key, node in _nodes(cfg._get_node("model"), "model"):
        names = ("block_size",) if _selected(node, "_target_") == GPTConfig._target_ else _CONTEXT_KEYS
        for name in names:
            if type(value := _selected(node, name)) is int:
                return f"{key}.{name}", value
    return None


def _data_nodes(cfg: DictConfig) -> Iterator[tuple[str, DictConfig]]:
    for split in ("train", "eval"):
        yield from _nodes(cfg.data._get_node(split), f"data.{split}")


def _nodes(node: Any, key: str) -> Iterator[tuple[str, DictConfig]]:
    """``node`` (at ``key``) and every mapping inside it, with their keys; interpolations are not followed."""
    if isinstance(node, DictConfig) and not node._is_none():
        yield key, node
        for name in node:
            yield from _nodes(node._get_node(name), f"{key}.{name}")
    elif isinstance(node, ListConfig) and not node._is_none():
        for index in range(len(node)):
            yield from _nodes(node._get_node(index), f"{key}[{index}]")


def _selected(node: DictConfig, name: str) -> Any:
    """``node``'s value at ``name``, resolved; None where it has none, or it cannot be resolved (other checks say)."""
    return OmegaConf.select(node, name, throw_on_missing=False, throw_on_resolution_failure=False)


def check_loss_and_metrics(cfg: DictConfig) -> None:
    loss = cfg.loss
    supervised = RECIPES.get(cfg.recipe) == RECIPES["supervised"]
    if not (loss == MODEL_COMPUTES_LOSS or _is_node(loss) or (loss is None and not supervised)):
        raise ConfigError(
            f"loss={loss!r} must be a _target_ node called as loss(outputs, targets) (e.g. "
            "{_target_: torch.nn.CrossEntropyLoss}), or 'model' when the model returns its own loss."
        )
    metrics = cfg.metrics
    if metrics is None:
        return
    if not isinstance(metrics, DictConfig):
        raise ConfigError(f"metrics={metrics!r} must map names to _target_ nodes, e.g. {{accuracy: {{_target_: ..}}}}.")
    for name, node in metrics.items():
        if node is None:  # metrics.accuracy=null switches one off
            continue
        if "/" in str(name) or not _is_node(node):
            raise ConfigError(
                f"metrics.{name} must be a _target_ node of a metric (a torchmetrics Metric, or an object with "
                "update(outputs, targets), compute() and reset()), under a name without '/'."
            )


def produced_metrics(cfg: DictConfig) -> list[str] | None:
    """The metrics the built-in recipes log for ``cfg`` (None for a user's recipe: anything goes)."""
    if cfg.recipe not in RECIPES:
        return None
    if cfg.recipe == "language_model":
        return ["eval/loss", "eval/perplexity", "train/loss"]
    if cfg.data.eval is None:
        return ["train/loss"]
    declared = [name for name, node in (cfg.metrics or {}).items() if node is not None]
    return ["eval/loss", *(f"eval/{name}" for name in declared), "train/loss"]


def check_objective(cfg: DictConfig) -> None:
    choice(cfg, "objective.direction", DIRECTIONS)
    produced = produced_metrics(cfg)
    metric = cfg.objective.metric
    if produced is None or metric in produced:
        return
    close = difflib.get_close_matches(metric, produced, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    why = " (data.eval is null, so nothing is evaluated)" if cfg.data.eval is None else ""
    raise ConfigError(
        f"objective.metric={metric!r} is not logged by this run{why}{hint}; choose one of {', '.join(produced)}."
    )


def check_recipe_fits(cfg: DictConfig) -> None:
    """The built-in recipes' needs: a dataset of their kind, and for the language model a context length."""
    corpus = OmegaConf.select(cfg, "data.train._target_") == CHAR_CORPUS
    language = cfg.recipe == "language_model"
    if language and not corpus:
        raise ConfigError(
            f"recipe=language_model trains on {CHAR_CORPUS} (a character vocabulary and windows), not "
            f"data.train._target_={OmegaConf.select(cfg, 'data.train._target_')!r}; use data=shakespeare_char "
            "(or experiment=shakespeare_gpt)."
        )
    if language and OmegaConf.select(cfg, "model.block_size") is None:
        raise ConfigError("recipe=language_model needs a model with a block_size; use model=gpt.")
    if cfg.data.samples_per_epoch is not None and not language:
        raise ConfigError(
            f"data.samples_per_epoch applies to recipe=language_model, not recipe={cfg.recipe}; leave it null (an "
            "epoch is one pass over the train dataset)."
        )
    supervised = RECIPES.get(cfg.recipe) == RECIPES["supervised"]
    if supervised and corpus:
        raise ConfigError(
            f"recipe={cfg.recipe} cannot train on the text corpus {CHAR_CORPUS}; use recipe=language_model "
            "(or experiment=shakespeare_gpt)."
        )
    gpt = OmegaConf.select(cfg, "model._target_") == GPTConfig._target_
    if supervised and gpt:
        raise ConfigError(f"recipe={cfg.recipe} cannot train model=gpt, a language model; use recipe=language_model.")
    if language and cfg.metrics:
        raise ConfigError(
            "recipe=language_model logs its own eval/loss and eval/perplexity; set metrics={} (metrics are for "
            "recipe=supervised)."
        )
    if gpt:
        at_least(cfg, "model.block_size", 1)
        at_least(cfg, "model.n_layer", 1)
        at_least(cfg, "model.n_head", 1)
        if cfg.model.n_embd < 1 or cfg.model.n_embd % cfg.model.n_head:
            raise ConfigError(
                f"model.n_embd={cfg.model.n_embd} must be a positive multiple of model.n_head={cfg.model.n_head}."
            )
        if not 0 <= cfg.model.dropout < 1:
            raise ConfigError(f"model.dropout={cfg.model.dropout} must be at least 0 and below 1.")


def recipe_module(recipe: str) -> str:
    """The module that holds ``recipe``'s ``train(cfg, accelerator)``; checked without importing it."""
    module = RECIPES.get(recipe, recipe)
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None and recipe in RECIPES:
        raise ConfigError(
            f"recipe={recipe!r} lives in {module}, which is not importable; reinstall the project (pip install -e .)."
        )
    if found is None:
        close = difflib.get_close_matches(recipe, RECIPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"recipe={recipe!r} is neither a built-in recipe{hint} ({', '.join(RECIPES)}) nor an importable module; "
            "pass a dotted path to a module with train(cfg, accelerator)."
        )
    return module
