"""The trackers ``log_with`` can name: the built-in ones (:data:`TRACKERS`), :func:`register_tracker_class` to
add one, and :func:`build_trackers`, which turns ``log_with`` into tracker objects.

It may import the standard library, the interface and the room's trackers (:mod:`~runner.engine.tracking.base`,
:mod:`~runner.engine.tracking.files`, :mod:`~runner.engine.tracking.services`); none of them loads a tracker's library.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from runner.engine.tracking.base import GeneralTracker
from runner.engine.tracking.files import CSVTracker, JSONLTracker, TensorBoardTracker
from runner.engine.tracking.services import MLflowTracker, WandBTracker

logger = logging.getLogger("runner")


TRACKERS: dict[str, type[GeneralTracker]] = {
    "tensorboard": TensorBoardTracker,
    "csv": CSVTracker,
    "mlflow": MLflowTracker,
    "wandb": WandBTracker,
    "jsonl": JSONLTracker,
}


def register_tracker_class(tracker_class: type[GeneralTracker]) -> None:
    """Let ``log_with`` name ``tracker_class`` by its ``name`` (as Accelerate's ``register_tracker_class``).

    Raises:
        ValueError: It is not a GeneralTracker subclass, or has no name of its own.
    """
    if not (isinstance(tracker_class, type) and issubclass(tracker_class, GeneralTracker)):
        raise ValueError(f"register_tracker_class takes a GeneralTracker subclass, not {tracker_class!r}.")
    name = getattr(tracker_class, "name", "")
    if not name or name == GeneralTracker.name:
        raise ValueError(f"{tracker_class.__name__} needs a name of its own (its class attribute `name`).")
    if name in TRACKERS and TRACKERS[name] is not tracker_class:
        logger.warning("The tracker %r (%s) now replaces %s.", name, tracker_class.__name__, TRACKERS[name].__name__)
    TRACKERS[name] = tracker_class


def build_trackers(
    log_with: str | GeneralTracker | list | None,
    *,
    run_name: str,
    logging_dir: str | os.PathLike | None,
    init_kwargs: dict[str, dict[str, Any]] | None = None,
    start: bool = True,
) -> list[GeneralTracker]:
    """The trackers ``log_with`` names (``"all"``, a name, a tracker, or a list of them), named ones built
    (and started, with ``start``); tracker objects are passed through as they are."""
    if log_with is None:
        return []
    requested = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    if "all" in requested:
        requested = [name for name, cls in TRACKERS.items() if _importable(cls)]
    init_kwargs = init_kwargs or {}
    trackers: list[GeneralTracker] = []
    for item in requested:
        if isinstance(item, GeneralTracker):
            trackers.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()
        if name not in TRACKERS:
            raise ValueError(f"log_with={item!r} is not a known tracker; use one of {sorted(TRACKERS)}.")
        tracker_class = TRACKERS[name]
        kwargs = init_kwargs.get(name, {})
        if tracker_class.requires_logging_directory:
            if logging_dir is None:
                raise ValueError(
                    f"The {name} tracker needs a logging directory; pass project_dir= (or project_config with "
                    "logging_dir) to the Accelerator."
                )
            tracker = tracker_class(run_name, logging_dir, **kwargs)
        else:
            tracker = tracker_class(run_name, **kwargs)
        if start:
            tracker.start()
        trackers.append(tracker)
    return trackers


_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb", "tensorboard": "tensorboard"}


def _importable(tracker_class: type[GeneralTracker]) -> bool:
    """Whether the library a built-in tracker needs is installed (``log_with="all"`` takes those that are)."""
    import importlib.util

    package = _PACKAGES.get(tracker_class.name)
    return package is None or importlib.util.find_spec(package) is not None
