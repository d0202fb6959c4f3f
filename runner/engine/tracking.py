"""Experiment trackers: TensorBoard, CSV, MLflow, Weights & Biases and a plain JSON-lines log.

The interface is Accelerate's: a :class:`GeneralTracker` has a ``name``, says whether it needs a
logging directory, is built cheaply and does its work in ``start()``, then takes
``store_init_configuration``, ``log`` and ``finish``. :func:`register_tracker_class` adds a class
that ``log_with`` can then name.

Trackers run on the main process only unless their class sets ``main_process_only = False``. The
Accelerator hands their calls to :class:`runner.engine.tracker_thread.TrackerThread`: one background
thread that calls them in order, so a training step never waits for a file, a database or a network.
A tracker that raises is reported once and dropped; training goes on.

Each library is imported in ``start()``, never at engine import.
"""

from __future__ import annotations

import abc
import contextlib
import csv
import io
import json
import logging
import os
import time
from numbers import Number
from pathlib import Path
from typing import Any

logger = logging.getLogger("runner")


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


class MLflowTracker(GeneralTracker):
    """An MLflow run, through ``mlflow.MlflowClient`` (any tracking URI: a SQLite file, a server, Databricks).

    Args:
        experiment_name: The experiment (created if missing); ``MLFLOW_EXPERIMENT_NAME`` wins, as in Accelerate.
        logging_dir: Where a new experiment keeps its artifacts (default: the tracking store's choice).
        run_id: Continue this run (its status goes back to running); ``MLFLOW_RUN_ID`` wins.
        tags: Tags for the run (a dict, or its JSON); ``MLFLOW_TAGS`` wins.
        nested_run: Show this run under the run active in this process (``mlflow.start_run``), as
            Accelerate's; ``MLFLOW_NESTED_RUN`` wins.
        run_name: A new run's name.
        description: The run's description.
        tracking_uri: Where runs are stored (default: ``MLFLOW_TRACKING_URI``, else MLflow's default).
        parent_run_id: Show this run under that one.
        group: Show this run under the group's parent run: one per group name and experiment, found by its
            tag ``runner.group`` or created (and marked finished: it only holds its runs). A sweep's jobs.
        store_lock: A file locked while the store is first opened (a new SQLite file gets its tables) and the
            experiment and the group's parent are found or created, so that runs starting at once on one
            store (a sweep's parallel jobs) do each of those once.

    A continued run keeps what it has: a metric's steps up to the last one it already logged are not
    logged again (an exact resume gives the same values), and a parameter it already has is not changed
    (MLflow forbids it); a changed value is recorded as the tag ``changed_on_resume.<name>``.
    Text goes to ``<name>/step_<step>.txt`` artifacts; ``unwrap=True`` gives the ``MlflowClient``
    (the run is ``run_id``).
    """

    name = "mlflow"
    requires_logging_directory = False

    def __init__(
        self,
        experiment_name: str | None = None,
        logging_dir: str | os.PathLike | None = None,
        run_id: str | None = None,
        tags: dict[str, Any] | str | None = None,
        nested_run: bool = False,
        run_name: str | None = None,
        description: str | None = None,
        *,
        tracking_uri: str | None = None,
        parent_run_id: str | None = None,
        group: str | None = None,
        store_lock: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        tags = os.environ.get("MLFLOW_TAGS", tags)
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", experiment_name) or "Default"
        self.logging_dir = None if logging_dir is None else str(logging_dir)
        self.run_id = os.environ.get("MLFLOW_RUN_ID", run_id) or None
        self.tags = {str(k): str(v) for k, v in (json.loads(tags) if isinstance(tags, str) else tags or {}).items()}
        nested = os.environ.get("MLFLOW_NESTED_RUN", nested_run)
        self.nested_run = nested if isinstance(nested, bool) else str(nested).lower() in ("1", "true", "yes")
        self.run_name, self.description = run_name, description
        self.tracking_uri, self.parent_run_id = tracking_uri, parent_run_id
        self.group, self.store_lock = group, store_lock
        self.client = None
        self._logged_through: dict[str, int] = {}  # a continued run: each metric's last logged step

    def start(self) -> None:
        import mlflow
        from mlflow import MlflowClient

        if self.nested_run and self.parent_run_id is None and (active := mlflow.active_run()) is not None:
            self.parent_run_id = active.info.run_id
        with _locked(self.store_lock):  # the client opens the store: a new SQLite file gets its tables now
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            if self.run_id is None:
                experiment_id = self._experiment_id()
                if self.group and self.parent_run_id is None:
                    self.parent_run_id = self._group_run(experiment_id)
        if self.run_id is not None:
            run = self.client.get_run(self.run_id)
            self.client.update_run(self.run_id, status="RUNNING")
            for key in run.data.metrics:
                steps = [metric.step for metric in self.client.get_metric_history(self.run_id, key)]
                self._logged_through[key] = max(steps, default=-1)
            self._params = dict(run.data.params)
            for key, value in self.tags.items():
                self.client.set_tag(self.run_id, key, value)
            return
        tags = dict(self.tags)
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        if self.description:
            tags["mlflow.note.content"] = self.description
        run = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        self._params = {}

    def _experiment_id(self) -> str:
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        if experiment is not None:
            return experiment.experiment_id
        return self.client.create_experiment(self.experiment_name, artifact_location=self.logging_dir)

    def _group_run(self, experiment_id: str) -> str:
        quoted = self.group.replace("\\", "\\\\").replace("'", "\\'")
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`{GROUP_TAG}` = '{quoted}'", max_results=1
        )
        if found:
            return found[0].info.run_id
        parent = self.client.create_run(experiment_id, run_name=self.group, tags={GROUP_TAG: self.group})
        self.client.set_terminated(parent.info.run_id)
        return parent.info.run_id

    @property
    def tracker(self):
        return self.client

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params, changed = [], []
        for key, value in flatten(values).items():
            text = str(value)
            if len(text) > MAX_PARAM_VAL_LENGTH:
                logger.warning("MLflow params hold %d characters at most: %s is not logged.", MAX_PARAM_VAL_LENGTH, key)
            elif key not in self._params:
                params.append(Param(key, text))
            elif self._params[key] != text:
                changed.append(RunTag(f"changed_on_resume.{key}", text[:MAX_PARAM_VAL_LENGTH]))
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[start : start + MAX_PARAMS_TAGS_PER_BATCH])
        for start in range(0, len(changed), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(self.run_id, tags=changed[start : start + MAX_PARAMS_TAGS_PER_BATCH])
        self._params.update((param.key, param.value) for param in params)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        self.log_records([(values, step, kwargs)])

    def log_records(self, records) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        metrics = []
        for values, step, _ in records:
            timestamp = int(time.time() * 1000)
            for key, value in flatten(values).items():
                if (scalar := _scalar(value)) is not None:
                    if step is not None and step <= self._logged_through.get(key, -1):
                        continue  # a continued run logged this step already
                    metrics.append(Metric(key, float(scalar), timestamp, step or 0))
                elif isinstance(value, str):
                    name = f"{key}/step_{step}.txt" if step is not None else f"{key}.txt"
                    self.client.log_text(self.run_id, value, name)
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        path = Path(local_path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path=artifact_path or path.name)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


GROUP_TAG = "runner.group"  # MLflow: the tag naming a group's parent run


@contextlib.contextmanager
def _locked(path: str | os.PathLike | None):
    """Hold an exclusive lock on the file ``path`` (created if missing); nothing when None."""
    if path is None:
        yield
        return
    import fcntl

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class WandBTracker(GeneralTracker):
    """A Weights & Biases run: ``wandb.init(project=run_name, **kwargs)``, as Accelerate's.

    ``kwargs`` go to ``wandb.init`` (``entity``, ``mode`` such as ``"offline"``, ``dir``, ``name``, ``group``,
    ``tags``, ``id`` and ``resume`` to continue a run). A continued run keeps what it has: steps before the
    run's next one are not logged again (W&B would drop them with a warning). ``unwrap=True`` gives the run.
    """

    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs) -> None:
        super().__init__()
        self.run_name = run_name
        self.init_kwargs = kwargs
        self.run = None
        self._next_step = 0

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)
        self._next_step = self.run.step if self.run.resumed else 0

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        if step is not None and step < self._next_step:
            return  # a continued run logged this step already
        self.run.log(values, step=step, **kwargs)

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        import wandb

        path = Path(local_path)
        artifact = wandb.Artifact(
            name=f"{self.run.id}-{artifact_path or path.stem}", type="model" if path.is_dir() else "file"
        )
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finish(self) -> None:
        self.run.finish()


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
