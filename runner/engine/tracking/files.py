"""The trackers that write files under the run's logging directory: TensorBoard's event files, a CSV table
and a JSON-lines log.

It may import the standard library and :mod:`~runner.engine.tracking.base`; TensorBoard (through torch) and
:mod:`runner.files` are imported when a tracker starts or writes, never at engine import.
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from pathlib import Path
from typing import Any

from runner.engine.tracking.base import GeneralTracker, _scalar, flatten


class TensorBoardTracker(GeneralTracker):
    """Writes event files under ``logging_dir/run_name``."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs) -> None:
        super().__init__()
        self.logging_dir = Path(logging_dir) / run_name
        self.writer_kwargs = kwargs
        self.writer = None
        self._hparams: dict[str, Any] | None = None
        self._scalar_tags: set[str] = set()

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.logging_dir), **self.writer_kwargs)

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
            for key, value in flatten(values).items()
        }
        _, session_start, _ = hparams(self._hparams, metric_dict={})
        self.writer.file_writer.add_summary(session_start)
        self.writer.add_text("config", "```\n" + json.dumps(values, indent=2, default=str) + "\n```")
        self.writer.flush()

    def _add(self, values: dict[str, Any], step: int | None, **kwargs) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        scalars = []  # one event for a call's scalars (add_scalar writes one per scalar: 2x the cost)
        for key, value in values.items():
            scalar = _scalar(value)
            if scalar is not None:
                if kwargs:  # add_scalar's own options (walltime, new_style, ...)
                    self.writer.add_scalar(key, scalar, global_step=step, **kwargs)
                else:
                    scalars.append(Summary.Value(tag=key, simple_value=float(scalar)))
                self._scalar_tags.add(key)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, {k: _scalar(v) for k, v in value.items()}, global_step=step)
        if scalars:
            self.writer.file_writer.add_summary(Summary(value=scalars), step)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        self._add(values, step, **kwargs)
        self.writer.flush()

    def log_records(self, records) -> None:
        for values, step, kwargs in records:
            self._add(values, step, **kwargs)
        self.writer.flush()  # once per batch: the event file is readable up to here

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
        super().__init__()
        self.path = Path(logging_dir) / run_name / "metrics.jsonl"
        self._file = None

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
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


class CSVTracker(GeneralTracker):
    """``logging_dir/run_name/metrics.csv``: a ``step`` column, then a column per metric, a row per ``log`` call.

    Numbers only (text and nested values are skipped). A metric first logged later (``eval/loss`` at
    the first evaluation) adds its column: the file is rewritten once with the wider header. A run
    that continues an existing file (a resume) first drops the rows at or after the first step it
    logs, which the earlier attempt logged past its checkpoint, so no step appears twice.
    """

    name = "csv"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike, **kwargs) -> None:
        super().__init__()
        self.path = Path(logging_dir) / run_name / "metrics.csv"
        self.columns: list[str] = ["step"]
        self._file = None
        self._continuing = False

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file() and self.path.stat().st_size:
            with self.path.open(newline="", encoding="utf-8") as existing:
                header = next(csv.reader(existing), None)
            if header and header[0] == "step":
                self.columns, self._continuing = header, True
            else:  # not ours: keep it, start a fresh file beside it
                self.path.replace(self.path.with_suffix(".csv.old"))
        self._file = self.path.open("a", newline="", encoding="utf-8")
        if not self._continuing:
            csv.writer(self._file).writerow(self.columns)

    @property
    def tracker(self):
        return self._file

    def _rows(self) -> list[dict[str, str]]:
        self._file.flush()
        with self.path.open(newline="", encoding="utf-8") as existing:
            return list(csv.DictReader(existing))

    def _rewrite(self, rows: list[dict[str, str]]) -> None:
        from runner.files import write_text_atomically

        self._file.close()
        text = io.StringIO()
        writer = csv.writer(text)
        writer.writerow(self.columns)
        writer.writerows([row.get(column) or "" for column in self.columns] for row in rows)
        write_text_atomically(self.path, text.getvalue())
        self._file = self.path.open("a", newline="", encoding="utf-8")

    def _add(self, values: dict[str, Any], step: int | None) -> None:
        numbers = {key: scalar for key, value in values.items() if (scalar := _scalar(value)) is not None}
        if not numbers:
            return
        new = [key for key in numbers if key not in self.columns]
        if self._continuing and step is not None:  # an earlier attempt's rows from this step on are replaced
            self._continuing = False
            rows = self._rows()
            kept = [row for row in rows if not (row.get("step") or "").isdigit() or int(row["step"]) < step]
            if len(kept) != len(rows) or new:
                self.columns += new
                self._rewrite(kept)
                new = []
        if new:
            self.columns += new
            self._rewrite(self._rows())
        row = {"step": "" if step is None else step, **numbers}
        csv.writer(self._file).writerow([_csv_value(row.get(column)) for column in self.columns])

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        self._add(values, step)
        self._file.flush()

    def log_records(self, records) -> None:
        for values, step, _ in records:
            self._add(values, step)
        self._file.flush()

    def finish(self) -> None:
        self._file.close()


def _csv_value(value: Any) -> Any:
    return "" if value is None else repr(value) if isinstance(value, float) else value
