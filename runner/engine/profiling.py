"""Accelerate's ``ProfileKwargs``: the settings of the ``torch.profiler.profile`` that ``Accelerator.profile`` runs.

The dataclass keeps Accelerate's fields and plain values (activity names as strings, the schedule as a
dict of ``torch.profiler.schedule``'s keyword arguments), so a script ports by renaming its imports.
Both are checked when the handler is made, so a typo fails at start-up with one sentence, not after the
first training steps; :meth:`ProfileKwargs.build` turns them into torch's objects.

Each process writes its own Chrome trace, named by :data:`PROFILE_TRACE_PATTERN` as Accelerate names it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

PROFILE_TRACE_PATTERN = "profile_{process_index}.json"  # Accelerate's PROFILE_PATTERN_NAME

_ALWAYS_ACCEPTED = {"cpu": ProfilerActivity.CPU, "cuda": ProfilerActivity.CUDA}
_ACCEPTED_WHEN_AVAILABLE = ("xpu", "mtia", "hpu")  # torch.<name> backends, as in Accelerate


def _activity_names() -> dict[str, ProfilerActivity]:
    names = dict(_ALWAYS_ACCEPTED)
    for name in _ACCEPTED_WHEN_AVAILABLE:
        backend = getattr(torch, name, None)
        if backend is not None and backend.is_available():
            names[name] = getattr(ProfilerActivity, name.upper())
    return names


def _schedule_keys() -> tuple[list[str], list[str]]:
    """``torch.profiler.schedule``'s required and optional keywords, read from this torch's signature."""
    parameters = inspect.signature(torch.profiler.schedule).parameters.values()
    required = [p.name for p in parameters if p.default is inspect.Parameter.empty]
    optional = [p.name for p in parameters if p.default is not inspect.Parameter.empty]
    return required, optional


def build_activities(names: Sequence[str]) -> list[ProfilerActivity]:
    """The ``ProfilerActivity`` of each name in ``names`` (``"cpu"``, ``"cuda"``, ...)."""
    accepted = _activity_names()
    for name in names:
        if name not in accepted:
            raise ValueError(
                f"ProfileKwargs.activities got {name!r}; use any of {', '.join(map(repr, accepted))} on this machine."
            )
    return [accepted[name] for name in names]


def build_schedule(option: Mapping[str, int]) -> Callable:
    """``torch.profiler.schedule(**option)``, once the keys are known to be its keywords."""
    required, optional = _schedule_keys()
    missing = [key for key in required if key not in option]
    unknown = [key for key in option if key not in required + optional]
    if missing or unknown:
        problem = f"is missing {missing[0]!r}" if missing else f"has the unknown key {unknown[0]!r}"
        raise ValueError(
            f"ProfileKwargs.schedule_option {problem}; give {', '.join(required)} "
            f"(and optionally {', '.join(optional)})."
        )
    return torch.profiler.schedule(**option)


@dataclass
class ProfileKwargs:
    """How ``Accelerator.profile`` profiles: pass one to ``Accelerator(kwargs_handlers=[...])`` or to ``profile``.

    The fields are those of ``torch.profiler.profile``, under Accelerate's names.

    Args:
        activities: Activity names to record, any of ``"cpu"`` and ``"cuda"`` (and ``"xpu"``, ``"mtia"``,
            ``"hpu"`` where that device is available); None records what this torch supports.
        schedule_option: Keywords of ``torch.profiler.schedule``: ``wait``, ``warmup`` and ``active``, with
            ``repeat`` and ``skip_first`` optional. Each ``profiler.step()`` advances it; only the ``active``
            steps are recorded. None records everything inside the context.
        on_trace_ready: Called with the profiler each time a scheduled cycle's active steps are recorded.
        record_shapes: Record the operators' input shapes.
        profile_memory: Record tensor allocations and frees.
        with_stack: Record the source file and line of each operator.
        with_flops: Estimate the FLOPs of matrix multiplications and convolutions.
        with_modules: Record the module hierarchy around each operator.
        output_trace_dir: Folder where each process writes its Chrome trace (``profile_<process index>.json``,
            readable in ``chrome://tracing`` or Perfetto) when the context exits; a relative path is taken
            from the working folder, as in Accelerate. None writes nothing.

    Raises:
        ValueError: An activity name this machine does not know, or a schedule_option key missing or unknown.

    Example:
        >>> handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2}, output_trace_dir="traces")
        >>> accelerator = Accelerator(kwargs_handlers=[handler])
        >>> with accelerator.profile() as profiler:
        ...     for batch in loader:
        ...         train_step(batch)
        ...         profiler.step()
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | os.PathLike | None = None

    def __post_init__(self) -> None:
        if self.activities is not None:
            build_activities(self.activities)
        if self.schedule_option is not None:
            build_schedule(self.schedule_option)

    def build(self) -> torch.profiler.profile:
        """A new ``torch.profiler.profile`` with these settings, not yet started (enter it as a context)."""
        return torch.profiler.profile(
            activities=None if self.activities is None else build_activities(self.activities),
            schedule=None if self.schedule_option is None else build_schedule(self.schedule_option),
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


def export_trace(profiler: torch.profiler.profile, folder: str | os.PathLike, *, process_index: int) -> Path | None:
    """Write this process's Chrome trace into ``folder`` (made if missing) and return the file's path.

    A schedule whose first active step was never reached recorded nothing: that is a warning and no file, not
    an error at the end of the work it watched.
    """
    if profiler.profiler is None:
        warnings.warn(
            f"profile() recorded no step, so it writes no trace to {folder}: profiler.step() was called "
            "fewer times than ProfileKwargs.schedule_option's skip_first, wait and warmup steps.",
            stacklevel=4,  # the with statement of Accelerator.profile
        )
        return None
    path = Path(folder) / PROFILE_TRACE_PATTERN.format(process_index=process_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    return path


@contextlib.contextmanager
def profiled(
    handler: ProfileKwargs, *, process_index: int, wait_for_everyone: Callable[[], None]
) -> Iterator[torch.profiler.profile]:
    """``accelerator.profile``: profile the block with ``handler``'s profiler and yield it.

    With ``output_trace_dir`` set, each process writes its Chrome trace there on leaving
    (``profile_<process_index>.json``; a relative folder is taken from the working folder), then waits
    for the others. Nothing is written when the block raises.

    Example:
        >>> with accelerator.profile(ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 1})) as prof:
        ...     for batch in loader:
        ...         train_step(batch)
        ...         prof.step()
        >>> accelerator.print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))
    """
    with handler.build() as profiler:
        yield profiler
    if handler.output_trace_dir is not None:
        export_trace(profiler, handler.output_trace_dir, process_index=process_index)
        wait_for_everyone()  # once any process leaves, every process's trace is on disk (as in Accelerate)
