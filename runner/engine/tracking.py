"""Experiment trackers: TensorBoard event files and a plain JSON-lines log.

Trackers live on the main process only; the Accelerator's ``log`` is a no-op elsewhere.
TensorBoard is imported when a TensorBoard tracker is created, never at engine import.
"""

from __future__ import annotations

import abc
import json
import os
import time
from numbers import Number
from pathlib import Path
from typing import Any


def _scalar(value: Any) -> float | int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, Number):
        return value
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        return value.item()
    return None


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


class GeneralTracker(abc.ABC):
    """The tracker interface (Accelerate's): ``store_init_configuration``, ``log``, ``finish``."""

    name = "general"
    requires_logging_directory = False

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    @abc.abstractmethod
    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        """Record ``values`` (names to numbers or text) at ``step``."""

    def finish(self) -> None:
        pass


class TensorBoardTracker(GeneralTracker):
    """Writes event files under ``logging_dir/run_name``."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logging_dir = Path(logging_dir) / run_name
        self.writer = SummaryWriter(str(self.logging_dir), **kwargs)
        self._hparams: dict[str, Any] | None = None
        self._scalar_tags: set[str] = set()

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Record hyperparameters, so runs compare in TensorBoard's HParams tab.

        The hyperparameters are written now; which metrics the tab shows is declared when the run
        finishes (:meth:`finish`): every scalar the run logged, whose last value is its final one.
        """
        from torch.utils.tensorboard.summary import hparams

        self._hparams = {
            key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in _flatten(values).items()
        }
        _, session_start, _ = hparams(self._hparams, metric_dict={})
        self.writer.file_writer.add_summary(session_start)
        self.writer.add_text("config", "```\n" + json.dumps(values, indent=2, default=str) + "\n```")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        for key, value in values.items():
            scalar = _scalar(value)
            if scalar is not None:
                self.writer.add_scalar(key, scalar, global_step=step, **kwargs)
                self._scalar_tags.add(key)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, {k: _scalar(v) for k, v in value.items()}, global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        if self._hparams is not None:  # the HParams tab: these hyperparameters, and each metric's final value
            from torch.utils.tensorboard.summary import hparams

            experiment, _, session_end = hparams(self._hparams, metric_dict=dict.fromkeys(sorted(self._scalar_tags), 0))
            self.writer.file_writer.add_summary(experiment)
            self.writer.file_writer.add_summary(session_end)
        self.writer.close()


class JSONLTracker(GeneralTracker):
    """Appends one JSON object per ``log`` call to ``logging_dir/run_name/metrics.jsonl``."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs) -> None:
        directory = Path(logging_dir) / run_name
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    @property
    def tracker(self):
        return self._file

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        (self.path.parent / "config.json").write_text(json.dumps(values, indent=2, default=str))

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        record = {"step": step, "time": time.time()}
        record.update({key: _scalar(value) if _scalar(value) is not None else value for key, value in values.items()})
        self._file.write(json.dumps(record, default=str) + "\n")
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


TRACKERS: dict[str, type[GeneralTracker]] = {"tensorboard": TensorBoardTracker, "jsonl": JSONLTracker}


def build_trackers(
    log_with: str | GeneralTracker | list | None,
    *,
    run_name: str,
    logging_dir: str | os.PathLike | None,
    init_kwargs: dict[str, dict[str, Any]] | None = None,
) -> list[GeneralTracker]:
    """Create the trackers ``log_with`` names (``"all"``, a name, a tracker, or a list of them)."""
    if log_with is None:
        return []
    requested = log_with if isinstance(log_with, (list, tuple)) else [log_with]
    if "all" in requested:
        requested = list(TRACKERS)
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
        if tracker_class.requires_logging_directory and logging_dir is None:
            raise ValueError(
                f"The {name} tracker needs a logging directory; pass project_dir= (or project_config with "
                "logging_dir) to the Accelerator."
            )
        trackers.append(tracker_class(run_name, logging_dir, **init_kwargs.get(name, {})))
    return trackers
