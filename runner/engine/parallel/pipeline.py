"""Pipeline parallelism's pieces: a model cut into stages that keep its parameter names, the stages each rank holds,
and torch's schedules by name.

A model says how it is cut with a pipeline plan (:class:`PipelinePlan`, from its ``pp_plan()`` method, as its
``tp_plan`` says how tensor parallelism splits a layer): its units in forward order (module names: the
embeddings, each block, the final norm, the head), a stage forward that runs only the units a stage holds, and
its tied weights. torch's tracer (``torch.distributed.pipelining.pipeline``) cuts only what ``torch.export`` can
capture whole, which a Hugging Face model is not; a plan cuts any model whose forward is a sequence of units.

A stage is a copy of the whole model with the other stages' units removed in place: a block list loses entries
without renumbering (``blocks.2`` stays ``blocks.2``), any other unit becomes None. Every parameter keeps its
name, so the stages' state dicts are parts of the model's: a checkpoint of the stages is a checkpoint of the
model, and loads on another layout by name. The model's class is kept; its ``forward`` is the plan's stage
forward, bound on the copy.

The stages of one rank (:func:`stage_indices`): one for the single-stage schedules (``gpipe``, ``1f1b``), several
for the multi-stage ones, looped (rank ``r`` of ``pp`` holds ``r, r + pp, ...``) or V-shaped (rank ``r`` holds
``r`` and ``stages - 1 - r``).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

# The schedules by the names a config gives them: torch.distributed.pipelining's classes, and whether each holds
# one stage per rank or several (and how it lays them out).
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "looped"),
    "looped_bfs": ("ScheduleLoopedBFS", "looped"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "looped"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v"),
}


@dataclass(frozen=True)
class PipelinePlan:
    """How a model is cut into pipeline stages.

    Args:
        units: Module names in forward order; each stage holds a run of them. The repeated ones (entries of a
            ``ModuleList`` or ``ModuleDict``: the blocks) are what an even cut spreads over the stages.
        stage_forward: ``forward(self, x, **kwargs)`` of a stage: ``self`` is the model with only the stage's
            units (the others None, or absent from their list); ``x`` is the model's input on the first stage and
            the previous stage's output on the others.
        tied: Parameter names that share one tensor with another (alias -> canonical), such as a head tied to
            the token embedding: stages holding both ends must sum their gradients.
    """

    units: tuple[str, ...]
    stage_forward: Callable[..., Any]
    tied: Mapping[str, str] = field(default_factory=dict)


def sequential_plan(model: nn.Module, tied: Mapping[str, str] | None = None) -> PipelinePlan:
    """The plan of a model whose forward runs its children one after another, each on the previous one's output
    (``x = child(x)``, the entries of a ``ModuleList`` or ``ModuleDict`` in turn): its units are the children in
    the order they were registered, lists expanded, and a stage runs those it holds. A model whose forward is that
    sequence gives it as its plan::

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed, self.blocks, self.head = nn.Embedding(256, 64), nn.ModuleList(...), nn.Linear(64, 256)

            def forward(self, x):
                x = self.embed(x)
                for block in self.blocks:
                    x = block(x)
                return self.head(x)

            def pp_plan(self):
                return sequential_plan(self)

    Only the model knows whether its forward is that sequence (a residual around the blocks, a second input, an
    output of several tensors are not); stages cut by this plan compute the sequence.

    Args:
        tied: Tied weights, as :class:`PipelinePlan` takes them.
    """
    units: list[str] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units.extend(f"{name}.{entry}" for entry in child._modules)
        else:
            units.append(name)
    return PipelinePlan(tuple(units), _sequential_stage_forward, tied=dict(tied or {}))


def _sequential_stage_forward(self: nn.Module, x: Any) -> Any:
    for child in self.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for entry in child._modules.values():
                x = entry(x)
        else:
            x = child(x)
    return x


# Plans for classes that cannot carry a pp_plan() of their own (a library's models), by class name.
_REGISTERED_PLANS: dict[str, Callable[[nn.Module], PipelinePlan]] = {}


def register_pp_plan(class_name: str, plan: Callable[[nn.Module], PipelinePlan]) -> None:
    """Cut models of class ``class_name`` by ``plan(model)`` (``runner.models`` registers Hugging Face's GPT-2)."""
    _REGISTERED_PLANS[class_name] = plan


def pipeline_plan(model: nn.Module) -> PipelinePlan:
    """The model's own plan (its ``pp_plan()``), or the one registered for its class.

    Raises:
        ValueError: The model has none.
    """
    plan = getattr(model, "pp_plan", None)
    if callable(plan):
        return plan()
    registered = _REGISTERED_PLANS.get(type(model).__name__)
    if registered is not None:
        return registered(model)
    raise ValueError(
        f"{type(model).__name__} has no pp_plan() saying how pipeline parallelism cuts it; give the model a "
        "pp_plan() method returning a runner.engine.parallel.pipeline.PipelinePlan (runner.models.GPT has one)."
    )


def stage_units(
    model: nn.Module, plan: PipelinePlan, num_stages: int, split_points: Sequence[str] | None = None
) -> list[tuple[str, ...]]:
    """The units of each of ``num_stages`` stages, in order.

    Args:
        split_points: The unit each stage after the first begins with (torchtitan's split points); None cuts
            evenly: the blocks spread over the stages (the first ones one more where they do not divide), the
            units before them on the first stage and those after them on the last.

    Raises:
        ValueError: A split point that is not a unit, out of order, or the wrong number of them; more stages
            than the units (or blocks) can fill.
    """
    units = list(plan.units)
    if num_stages < 1:
        raise ValueError(f"A pipeline has at least one stage, not {num_stages}.")
    if split_points is not None:
        return _at_split_points(units, num_stages, list(split_points))
    blocks = [unit for unit in units if _in_a_list(model, unit)]
    if len(blocks) < num_stages:
        raise ValueError(
            f"{type(model).__name__} has {len(blocks)} blocks, too few for {num_stages} pipeline stages; use at most "
            f"{len(blocks)} stages, or give the split points."
        )
    first, last = units.index(blocks[0]), units.index(blocks[-1])
    per_stage, extra = divmod(len(blocks), num_stages)
    stages, start = [], 0
    for stage in range(num_stages):
        end = start + per_stage + (stage < extra)
        stages.append(
            tuple(units[:first] if stage == 0 else [])
            + tuple(blocks[start:end])
            + tuple(units[last + 1 :] if stage == num_stages - 1 else [])
        )
        start = end
    return stages


def _at_split_points(units: list[str], num_stages: int, points: list[str]) -> list[tuple[str, ...]]:
    if len(points) != num_stages - 1:
        raise ValueError(
            f"The split points name {len(points)} units, and {num_stages} stages begin at {num_stages - 1} (every "
            "stage after the first)."
        )
    unknown = [point for point in points if point not in units]
    if unknown:
        raise ValueError(
            f"The split point {unknown[0]} is not a unit the model is cut at; choose among {', '.join(units)}."
        )
    starts = [0, *(units.index(point) for point in points), len(units)]
    if any(later <= earlier for earlier, later in zip(starts, starts[1:], strict=False)):
        raise ValueError(
            f"The split points {list(points)} must name units in forward order, each after the one before and after "
            "the first unit; every stage holds at least one."
        )
    return [tuple(units[begin:end]) for begin, end in zip(starts, starts[1:], strict=False)]


def cut(model: nn.Module, plan: PipelinePlan, units: Iterable[str]) -> nn.Module:
    """A copy of ``model`` holding only ``units`` (the rest removed in place, names kept), running the plan's stage
    forward."""
    stage = copy.deepcopy(model)
    kept = set(units)
    for unit in plan.units:
        if unit in kept:
            continue
        parent, name = _parent_of(stage, unit)
        if isinstance(parent, (nn.ModuleList, nn.ModuleDict)):
            del parent._modules[name]  # the list keeps its other entries' names: no renumbering
        else:
            setattr(parent, name, None)
    stage.forward = types.MethodType(plan.stage_forward, stage)
    return stage


def stage_indices(pp_rank: int, pp_size: int, num_stages: int, *, layout: str) -> tuple[int, ...]:
    """The stages rank ``pp_rank`` of ``pp_size`` holds: ``layout`` ``"single"`` (its own), ``"looped"`` (``r,
    r + pp, ...``) or ``"v"`` (``r`` and ``stages - 1 - r``).

    Raises:
        ValueError: The stages do not fit the layout (one per rank; a multiple of the ranks; two per rank).
    """
    if layout == "single":
        if num_stages != pp_size:
            raise ValueError(f"A single-stage schedule holds one stage per rank: {pp_size} stages, not {num_stages}.")
        return (pp_rank,)
    if layout == "looped":
        if num_stages % pp_size or num_stages == pp_size:
            raise ValueError(
                f"A looped schedule holds several stages per rank: a multiple of {pp_size} above it, not {num_stages}."
            )
        return tuple(range(pp_rank, num_stages, pp_size))
    if layout == "v":
        if num_stages != 2 * pp_size:
            raise ValueError(f"A V-shaped schedule holds two stages per rank: {2 * pp_size} stages, not {num_stages}.")
        return (pp_rank, num_stages - 1 - pp_rank)
    raise ValueError(f"Unknown stage layout {layout!r}; use single, looped or v.")


def schedule_class(name: str) -> tuple[type, str]:
    """torch's schedule class of the schedule ``name``, and its stage layout (see :func:`stage_indices`).

    Raises:
        ValueError: ``name`` is not one of :data:`SCHEDULES`.
    """
    if name not in SCHEDULES:
        raise ValueError(f"{name!r} is not a pipeline schedule; choose one of {', '.join(SCHEDULES)}.")
    from torch.distributed.pipelining import schedules

    class_name, layout = SCHEDULES[name]
    return getattr(schedules, class_name), layout


def check_schedule(
    name: str, *, pp: int, stages: int, microbatches: int, split_points: Sequence[str] | None = None
) -> None:
    """Raise one sentence, naming the config key, where torch's schedule ``name`` cannot run ``stages`` stages on
    ``pp`` processes over ``microbatches`` micro-batches (the rules its constructors enforce, checked before any
    process starts), or ``split_points`` do not begin each stage after the first.

    Raises:
        ValueError: An unknown schedule, a stage count the layout does not take, too few micro-batches, or
            micro-batches the schedule's rounds do not divide.
    """
    if name not in SCHEDULES:
        raise ValueError(
            f"parallel.pp_schedule={name!r} is not a pipeline schedule; choose one of {', '.join(SCHEDULES)}."
        )
    layout = SCHEDULES[name][1]
    try:
        stage_indices(0, pp, stages, layout=layout)
    except ValueError as error:
        raise ValueError(f"parallel.pp_schedule={name}: {error}") from None
    if split_points is not None and len(split_points) != stages - 1:
        raise ValueError(
            f"parallel.pp_split_points names {len(split_points)} units, and the {stages} stages of "
            f"parallel.pp={pp} under {name} begin at {stages - 1} (every stage after the first); give {stages - 1}."
        )
    if name in ("1f1b", "zbv_zero_bubble") and microbatches < stages:
        raise ValueError(
            f"parallel.pp_microbatches={microbatches} is too few for {name} on {stages} stages, which needs at least "
            f"one micro-batch per stage; set parallel.pp_microbatches to {stages} or more."
        )
    if name in ("interleaved_1f1b", "interleaved_zero_bubble"):  # looped BFS runs any number
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"parallel.pp_microbatches={microbatches} does not suit {name} on parallel.pp={pp}: it runs them in "
                f"{rounds} rounds (micro-batches // pp), which must divide them; use a multiple of {pp}, or fewer "
                f"than {pp}."
            )


def bubble_fraction(name: str, *, pp: int, microbatches: int, stages_per_rank: int = 2) -> float | None:
    """The share of a training step each process idles under schedule ``name``, in theory (equal stages, free
    communication): ``(pp - 1) / (microbatches + pp - 1)`` for GPipe and 1F1B, the fill and drain divided by the
    stages each process holds for interleaved 1F1B (Megatron-LM's result); None for the others, whose idle time
    depends on how torch orders their split backward."""
    if SCHEDULES[name][1] == "single":
        return (pp - 1) / (microbatches + pp - 1)
    if name == "interleaved_1f1b":
        fill = (pp - 1) / stages_per_rank
        return fill / (microbatches + fill)
    return None


def sum_tied_gradients(stages: Sequence[nn.Module], plan: PipelinePlan, *, group: Any = None) -> None:
    """Give both ends of each tied weight the sum of their gradients, as the one weight of the whole model has
    (Megatron's embedding all-reduce), once the stages' backward is done: added here where this rank's stages hold
    both ends (a V-shaped schedule), all-reduced over ``group`` where they hold one. ``group`` is the process group
    of the ranks that hold the two ends (the first and the last stage's); None where no rank holds only one.
    The two ends start equal (the stages are copies of one model) and, stepped with equal gradients by the same
    optimizer, stay equal.
    """
    import torch
    import torch.distributed as dist

    for alias, canonical in plan.tied.items():
        ends: dict[int, nn.Parameter] = {}
        for stage in stages:
            parameters = dict(stage.named_parameters(remove_duplicate=False))
            for name in (alias, canonical):
                if name in parameters:
                    ends[id(parameters[name])] = parameters[name]
        grads = [end.grad if end.grad is not None else torch.zeros_like(end) for end in ends.values()]
        if len(ends) == 2:
            total = grads[0] + grads[1]
            for end in ends.values():
                end.grad = total.clone()
        elif len(ends) == 1 and group is not None:
            (end,) = ends.values()
            end.grad = grads[0]
            local = end.grad.to_local() if hasattr(end.grad, "to_local") else end.grad  # a shard: the same on both
            dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)


def _parent_of(model: nn.Module, unit: str) -> tuple[nn.Module, str]:
    *path, name = unit.split(".")
    parent = model
    for part in path:
        parent = parent._modules[part]
    if name not in parent._modules:
        raise ValueError(f"The pipeline plan's unit {unit} is not a module of {type(model).__name__}.")
    return parent, name


def _in_a_list(model: nn.Module, unit: str) -> bool:
    parent, _ = _parent_of(model, unit)
    return isinstance(parent, (nn.ModuleList, nn.ModuleDict))
