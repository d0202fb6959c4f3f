"""The tracker interface: :class:`GeneralTracker` (Accelerate's), the blank stand-in ``get_tracker`` returns on
a process that runs no trackers, and the value helpers every tracker shares (:func:`flatten`, ``_scalar``).

The interface is Accelerate's: a :class:`GeneralTracker` has a ``name``, says whether it needs a
logging directory, is built cheaply and does its work in ``start()``, then takes
``store_init_configuration``, ``log`` and ``finish``. Trackers run on the main process only unless
their class sets ``main_process_only = False``.

It imports the standard library only: the trackers, the registry, and the thread and process that call
trackers (:mod:`runner.engine.tracking.thread`, :mod:`runner.engine.tracking.process`) import it.
"""

from __future__ import annotations

import abc
import os
from numbers import Number
from typing import Any


def _scalar(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, Number):
        return value.item() if hasattr(value, "item") else value  # NumPy scalars become Python numbers
    if hasattr(value, "item") and (getattr(value, "numel", lambda: 0)() == 1 or getattr(value, "size", 0) == 1):
        return value.item()  # a one-element tensor or NumPy array
    return None


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


class GeneralTracker(abc.ABC):
    """A tracker, as Accelerate's: subclass it for your own and pass an instance to ``log_with``.

    A subclass names itself (``name``), says whether it needs the Accelerator's logging directory
    (``requires_logging_directory``), and implements ``log``. Its constructor should only keep its
    arguments: ``start()`` (main process only, unless ``main_process_only = False``) opens files or runs.
    ``tracker`` is the underlying object ``get_tracker(name, unwrap=True)`` returns.
    """

    name = "general"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, _blank: bool = False) -> None:
        """``_blank``: Accelerate's flag for a stand-in; the class attributes above are the defaults a subclass
        overrides (``register_tracker_class`` insists on a ``name`` of its own)."""

    @property
    def tracker(self) -> Any:
        return self

    def start(self) -> None:
        """Open the run (files, database rows, a service); called once, before anything is logged."""

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record ``values`` (the run's configuration, nested) as its hyperparameters."""

    @abc.abstractmethod
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        """Record ``values`` (names to numbers or text) at ``step``."""

    def log_records(self, records: list[tuple[dict[str, Any], int | None, dict[str, Any]]]) -> None:
        """Several ``(values, step, kwargs)`` at once, in order (the background thread's batch). Trackers that
        pay per call (a database, a network) override it to send them together."""
        for values, step, kwargs in records:
            self.log(values, step=step, **kwargs)

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Keep a file or a folder with the run, where the tracker stores files (MLflow, W&B); else nothing."""

    def finish(self) -> None:
        """Close the run."""


class _BlankTracker(GeneralTracker):
    """What ``get_tracker`` returns on a process that runs no trackers: every call does nothing."""

    def __init__(self, name: str) -> None:
        super().__init__(_blank=True)
        self.name = name

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        pass
