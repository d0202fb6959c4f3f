"""The Accelerator's tracking verbs: ``init_trackers``, ``log``, ``log_artifact``, ``get_tracker``.

:class:`TrackingVerbs` is mixed into :class:`~runner.engine.accelerator.Accelerator`. It builds the trackers
of ``log_with`` (:mod:`~runner.engine.tracking.registry`) and hands every call to the thread or helper process
that runs them (:mod:`~runner.engine.tracking.thread`, :mod:`~runner.engine.tracking.process`). It reads the
attributes its class body declares, which the Accelerator sets, and imports only this room.
"""

from __future__ import annotations

import os
from typing import Any

from runner.engine.tracking.base import GeneralTracker, _BlankTracker
from runner.engine.tracking.process import TrackerProcess
from runner.engine.tracking.process import available as tracker_process_available
from runner.engine.tracking.registry import build_trackers
from runner.engine.tracking.thread import TrackerThread


class TrackingVerbs:
    """Start the trackers, send them values and files, and find one by name (a mixin of the Accelerator)."""

    log_with: str | GeneralTracker | list | None
    tracker_process: bool
    is_main_process: bool
    logging_dir: str | None
    _tracker_thread: TrackerThread | TrackerProcess

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Start the trackers of ``log_with`` and record ``config`` as their hyperparameters.

        Trackers run on the main process, and on every process those whose class sets
        ``main_process_only = False``. ``init_kwargs`` maps a tracker's name to its constructor's keywords.
        A tracker that fails to start is reported in one warning and left out; training goes on.
        """
        built = build_trackers(
            self.log_with, run_name=project_name, logging_dir=self.logging_dir, init_kwargs=init_kwargs, start=False
        )
        mine = [tracker for tracker in built if self.is_main_process or not tracker.main_process_only]
        in_process = self.tracker_process and mine and tracker_process_available()
        self._tracker_thread = TrackerProcess(mine) if in_process else TrackerThread(mine)
        self._tracker_thread.call("start")
        if config is not None:
            self._tracker_thread.call("store_init_configuration", config)

    @property
    def trackers(self) -> list[GeneralTracker]:
        """The trackers this process runs (those that failed are gone)."""
        return self._tracker_thread.trackers

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Send ``values`` at ``step`` to every tracker of this process (``log_kwargs``: a tracker's name to
        its ``log`` keywords). Returns at once: the trackers are called in order on a background thread,
        with the values as they are now (tensors are read here)."""
        self._tracker_thread.log(values, step, log_kwargs)

    def log_artifact(
        self, local_path: str | os.PathLike, artifact_path: str | None = None, *, trackers: list[str] | None = None
    ) -> None:
        """Keep a file or folder with the tracked run, in the trackers that store files (MLflow, W&B), or in
        those named in ``trackers``. Returns at once, as :meth:`log`."""
        self._tracker_thread.log_artifact(local_path, artifact_path, trackers)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker called ``name`` (its underlying object with ``unwrap=True``). On a process that runs
        no trackers, a stand-in that does nothing."""
        self._tracker_thread.flush()  # whatever was logged has reached it
        for tracker in self.trackers:
            if tracker.name == name:
                return tracker.tracker if unwrap else tracker
        if not self.is_main_process:
            return _BlankTracker(name)
        raise ValueError(f"No tracker named {name!r} was started; trackers: {[t.name for t in self.trackers]}.")
