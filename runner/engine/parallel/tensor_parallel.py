"""Tensor parallelism: layers split across the processes of the mesh's ``tp`` dimension.

A plan maps module-name patterns to styles (``parallel.tp_plan``; a model class may carry a default as
its ``tp_plan`` attribute, as Hugging Face models do)::

    {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}

``*`` stands for one segment of a dotted module name. ``colwise`` splits a Linear's output features
(an Embedding's embedding dimension), ``rowwise`` its input features (an Embedding's rows) and sums
the partial results, ``sequence`` runs a LayerNorm or Dropout on a shard of the sequence; torch's
``ParallelStyle`` objects are accepted as they are. :func:`apply_tensor_parallel` applies it with
torch's ``parallelize_module``; the model stays a plain ``nn.Module``.

Every parameter the plan does not split becomes a replicated DTensor on the same ``tp`` mesh, and
its module converts inputs and outputs at its edges. One kind of parameter for the whole model is
what lets ``fully_shard`` over the data-parallel mesh, ``clip_grad_norm_``, the optimizer's foreach
kernels and torch.distributed.checkpoint treat every parameter alike (mixing plain tensors with
DTensors, or DTensors of different meshes, fails in their cross-parameter ops). A parameter tied to
another (a GPT's head and token embedding) stays one parameter as long as the plan splits neither.

Order (torchtitan's): tensor parallelism first, then ``fully_shard`` per block and the root over the
``dp_shard`` (HSDP: ``(dp_replicate, dp_shard)``) submesh, then the optimizer.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from runner.engine.ops import recursively_apply

STYLE_NAMES = ("colwise", "rowwise", "sequence")
_HEAD_COUNT_NAMES = ("n_head", "num_heads", "num_attention_heads", "num_key_value_heads")


def default_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The model's own plan (its ``tp_plan`` attribute, e.g. ``GPT.tp_plan``), or None when it has none."""
    plan = getattr(model, "tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) and plan else None


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """Expand a plan of patterns into ``{module name: ParallelStyle}`` for ``parallelize_module``.

    Args:
        model: The model the names are relative to.
        plan: Module-name pattern (``*`` = one name segment) -> ``"colwise"``, ``"rowwise"``,
            ``"sequence"`` or a ``torch.distributed.tensor.parallel.ParallelStyle``.

    Returns:
        One freshly built style per matching module, in the model's module order.

    Raises:
        ValueError: An unknown style name; a pattern that matches no module; a column- or row-wise
            style on a module that is neither an ``nn.Linear`` nor an ``nn.Embedding``; a module that
            two patterns match.

    Example:
        >>> resolve_tp_plan(gpt, {"blocks.*.mlp.fc": "colwise"})
        {'blocks.0.mlp.fc': ColwiseParallel(...), 'blocks.1.mlp.fc': ColwiseParallel(...)}
    """
    modules = {name: module for name, module in model.named_modules() if name}
    matched_by: dict[str, str] = {}
    for pattern, style in plan.items():
        _check_style(pattern, style)
        names = [name for name in modules if _matches(pattern, name)]
        if not names:
            raise ValueError(
                f"parallel.tp_plan pattern {pattern!r} matches no module of the model (it has e.g. "
                f"{', '.join(_examples(pattern, modules))}); fix parallel.tp_plan."
            )
        for name in names:
            if name in matched_by:
                raise ValueError(
                    f"Module {name} is matched by both {matched_by[name]!r} and {pattern!r} in parallel.tp_plan; "
                    "keep one of them."
                )
            _check_target(pattern, style, name, modules[name])
            matched_by[name] = pattern
    return {name: _build_style(plan[matched_by[name]], modules[name]) for name in modules if name in matched_by}


def apply_tensor_parallel(model: nn.Module, tp_mesh, plan: Mapping[str, Any]) -> nn.Module:
    """Split ``model``'s layers across ``tp_mesh`` as ``plan`` says (in place); returns ``model``.

    Args:
        model: A plain ``nn.Module``. Its weights are those of the first process of ``tp_mesh``
            (scattered to the others, or broadcast: the others' initialisation does not matter).
        tp_mesh: A 1-D ``DeviceMesh``, e.g. ``mesh["tp"]``.
        plan: As for :func:`resolve_tp_plan`.

    Raises:
        ValueError: As :func:`resolve_tp_plan`; a split layer whose features, or an attention
            module whose heads, ``tp_mesh.size()`` does not divide; a tied parameter the plan would split.

    Example:
        >>> mesh = ParallelismConfig(tp_size=2).resolve(world_size=2).build_device_mesh("cpu")
        >>> apply_tensor_parallel(gpt, mesh["tp"], GPT.tp_plan)
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.ndim != 1:
        raise ValueError(
            f"apply_tensor_parallel needs a 1-D mesh such as mesh['tp'], not one of shape {tp_mesh.shape}."
        )
    styles = check_tp_plan(model, plan, tp_mesh.size())
    parallelize_module(model, tp_mesh, styles)
    _replicate_the_rest(model, tp_mesh)
    return model


def check_tp_plan(model: nn.Module, plan: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """:func:`resolve_tp_plan`, and the checks :func:`apply_tensor_parallel` makes for ``tp`` processes, with no
    mesh or process group: the runner checks a plan this way before it launches, on a model on the meta device.

    Raises:
        ValueError: As :func:`apply_tensor_parallel`.
    """
    styles = resolve_tp_plan(model, plan)
    _check_ties(model, styles)
    _check_divisible(model, styles, tp)
    return styles


def _matches(pattern: str, name: str) -> bool:
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(fnmatch.fnmatchcase(s, p) for s, p in zip(segments, parts, strict=True))


def _examples(pattern: str, modules: Mapping[str, nn.Module], count: int = 4) -> list[str]:
    """Names as deep as ``pattern``, the layers a plan can split first."""
    alike = [name for name in modules if name.count(".") == pattern.count(".")] or list(modules)
    alike.sort(key=lambda name: not isinstance(modules[name], (nn.Linear, nn.Embedding)))  # stable: module order
    return alike[:count]


def _check_style(pattern: str, style: Any) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(style, ParallelStyle) and style not in STYLE_NAMES:
        raise ValueError(
            f"parallel.tp_plan[{pattern!r}]={style!r} is not a tensor-parallel style; use 'colwise', 'rowwise' "
            "or 'sequence'."
        )


def _check_target(pattern: str, style: Any, name: str, module: nn.Module) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    splits = style in ("colwise", "rowwise") or isinstance(style, (ColwiseParallel, RowwiseParallel))
    if splits and not isinstance(module, (nn.Linear, nn.Embedding)):
        raise ValueError(
            f"parallel.tp_plan pattern {pattern!r} splits {name}, a {type(module).__name__}, but only nn.Linear "
            "and nn.Embedding modules split column- or row-wise; point it at a Linear or an Embedding."
        )


def _build_style(style: Any, module: nn.Module):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        # A row-wise Embedding looks up whole token ids (a row-wise Linear takes features split by a colwise one).
        return RowwiseParallel(input_layouts=Replicate()) if isinstance(module, nn.Embedding) else RowwiseParallel()
    if style == "sequence":
        return SequenceParallel()
    return copy.copy(style)  # torch's styles keep per-module settings on themselves while they are applied


def _split_size(module: nn.Module, style: Any) -> tuple[str, int] | None:
    """The size a style splits (named as the module names it), or None when it splits nothing."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    colwise, rowwise = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear) and (colwise or rowwise):
        return ("out_features", module.out_features) if colwise else ("in_features", module.in_features)
    if isinstance(module, nn.Embedding) and (colwise or rowwise):
        return ("embedding_dim", module.embedding_dim) if colwise else ("num_embeddings", module.num_embeddings)
    return None


def _check_divisible(model: nn.Module, styles: Mapping[str, Any], tp: int) -> None:
    modules = dict(model.named_modules())
    for name, style in styles.items():
        split = _split_size(modules[name], style)
        if split is None:
            continue
        # A split projection inside an attention module: every process must get whole heads.
        owner = name.rpartition(".")[0]
        for attribute in _HEAD_COUNT_NAMES:
            heads = getattr(modules[owner], attribute, None)
            if type(heads) is int and heads % tp:
                raise ValueError(
                    f"{owner or 'The model'} has {attribute}={heads} attention heads, which parallel.tp={tp} does not "
                    "divide; choose a parallel.tp that divides the number of heads."
                )
        if split[1] % tp:
            raise ValueError(
                f"parallel.tp={tp} does not divide {name}'s {split[0]}={split[1]}; choose a parallel.tp that "
                f"divides it, or leave {name} out of parallel.tp_plan."
            )


def _check_ties(model: nn.Module, styles: Mapping[str, Any]) -> None:
    users: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        users.setdefault(id(parameter), []).append(name)
    for names in users.values():
        split = [name for name in names if name.rpartition(".")[0] in styles]
        if len(names) > 1 and split:
            others = ", ".join(name for name in names if name != split[0])
            raise ValueError(
                f"{split[0]} is tied to {others}, and parallel.tp_plan would split it apart; leave the modules of "
                "all tied parameters out of parallel.tp_plan (they stay replicated)."
            )


def _replicate_the_rest(model: nn.Module, tp_mesh) -> None:
    """Make every parameter the plan left alone a replicated DTensor, each tied one once; see the module docstring."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    replicated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        names = [name for name, p in module.named_parameters(recurse=False) if not isinstance(p, DTensor)]
        for name in names:
            parameter = getattr(module, name)
            if id(parameter) not in replicated:
                # Broadcast from the group's first process, as parallelize_module does for the split layers.
                tensor = distribute_tensor(parameter.detach(), tp_mesh, [Replicate()], src_data_rank=0)
                replicated[id(parameter)] = nn.Parameter(tensor, requires_grad=parameter.requires_grad)
            module.register_parameter(name, replicated[id(parameter)])
        if names:
            _convert_at_the_edges(module, tp_mesh)


def _convert_at_the_edges(module: nn.Module, tp_mesh) -> None:
    """Plain tensors in become replicated DTensors (every process of the group holds the same); DTensors out, local."""
    from torch.distributed.tensor import DTensor, Replicate

    def to_dtensor(tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            return tensor
        return DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False)

    def to_local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor  # replicated: no communication

    module.register_forward_pre_hook(
        lambda _, args, kwargs: (recursively_apply(to_dtensor, args), recursively_apply(to_dtensor, kwargs)),
        with_kwargs=True,
    )
    module.register_forward_hook(lambda _, args, output: recursively_apply(to_local, output))
