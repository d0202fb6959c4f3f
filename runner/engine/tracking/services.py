"""The trackers that keep a run in an experiment store through its library: MLflow (a SQLite file, a server,
Databricks) and Weights & Biases. A resumed run continues the same run, by its id.

It may import the standard library and :mod:`~runner.engine.tracking.base`; ``mlflow`` and ``wandb`` are
imported when a tracker starts or writes, never at engine import.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from runner.engine.tracking.base import GeneralTracker, _scalar, flatten

logger = logging.getLogger("runner")


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

    Once it starts, what MLflow and the libraries under it log goes to the root logger's log files only (the
    runner's ``run.log``), not to the console (:func:`keep_store_logs_off_the_console`).
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

        keep_store_logs_off_the_console()  # after MLflow's import, which gives its loggers a console handler
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
# The loggers of MLflow and of the libraries it keeps runs through: its database store (SQLAlchemy, Alembic's
# migrations, Huey's job queue) and its server's HTTP client (urllib3's retries).
STORE_LOGGERS = ("mlflow", "sqlalchemy", "alembic", "huey", "urllib3")


def keep_store_logs_off_the_console() -> None:
    """Send what :data:`STORE_LOGGERS` log to the root logger's log files only (nowhere if it has none).

    A store that fails (a SQLite file that cannot be written, a server gone) is reported by the trackers'
    thread as one warning; MLflow logs the same failure first, with its SQLAlchemy traceback (some 90 lines), and
    urllib3 a line per retry. Those stay in the log file for whoever looks into the failure. MLflow gives some
    of these loggers a console handler of their own when it is imported: every logger of theirs that has
    handlers gets the files instead.
    """
    files = [handler for handler in logging.getLogger().handlers if isinstance(handler, logging.FileHandler)]
    names = [name for name in logging.root.manager.loggerDict if name.split(".")[0] in STORE_LOGGERS]
    for name in {*STORE_LOGGERS, *names}:
        library = logging.getLogger(name)
        if name in STORE_LOGGERS or library.handlers:
            library.handlers = list(files) or [logging.NullHandler()]
            library.propagate = False


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
