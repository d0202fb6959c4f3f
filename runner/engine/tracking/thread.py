"""The trackers' background thread: ``Accelerator.log`` returns at once, and the trackers are called in order.

Values are read off tensors when they are logged (:func:`plain_values`); the thread sends what gathered
to each tracker as one batch at most every ``TrackerThread.interval`` seconds.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
from typing import Any

import torch

from runner.engine.tracking.base import GeneralTracker, _scalar

logger = logging.getLogger("runner")


def plain_values(values: dict[str, Any], copy_tensors: bool = False) -> dict[str, Any]:
    """``values`` with one-element tensors and NumPy scalars as Python numbers, nested dicts too: what a
    background thread may read later, whatever happens to the tensors meanwhile. ``copy_tensors``: other
    tensors become CPU copies too (what another process can receive)."""
    plain: dict[str, Any] = {}
    for key, value in values.items():
        if type(value) in PLAIN_TYPES:  # the common case, first: what a loop logs is mostly Python numbers
            plain[key] = value
        elif isinstance(value, dict):
            plain[key] = plain_values(value, copy_tensors)
        elif copy_tensors and type(value) in (list, tuple):  # a list of images, a histogram's bins
            plain[key] = type(value)(_cpu_copies(value))
        else:
            scalar = _scalar(value)
            if scalar is None and copy_tensors and isinstance(value, torch.Tensor):
                value = value.detach().to("cpu", copy=True)
            plain[key] = value if scalar is None else scalar
    return plain


def _cpu_copies(items: list | tuple):
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item.detach().to("cpu", copy=True)
        elif type(item) in (list, tuple):
            yield type(item)(_cpu_copies(item))
        else:
            yield item


PLAIN_TYPES = frozenset({float, int, str})  # logged as they are: nothing to read off a tensor


_REMARK = re.compile(r"\([^()]*\)")  # a line that is only a remark in parentheses


def describe(error: BaseException) -> str:
    """``Type: first line of the message``: how a tracker's failure is reported.

    Lines that are wholly a remark in parentheses are passed over: SQLAlchemy opens a message with one
    ("(raised as a result of Query-invoked autoflush; ...)") before the line that says what failed.
    """
    lines = str(error).splitlines()
    said = [line for line in lines if not _REMARK.fullmatch(line.strip())] or lines
    return f"{type(error).__name__}: {said[0] if said else ''}"


def warn_dropped(name: str, reason: str) -> None:
    """The one warning a tracker that failed gets."""
    logger.warning(
        "The %s tracker failed (%s) and logs nothing more in this run; training goes on, and metrics.json and "
        "the other trackers keep every value.",
        name, reason,
    )  # fmt: skip


def _warn_dropped_tracker(tracker: GeneralTracker, error: BaseException) -> None:
    """A :class:`TrackerThread`'s default ``on_drop`` (a module function, so an Accelerator pickles)."""
    warn_dropped(tracker.name, describe(error))


class TrackerThread:
    """Calls the trackers on one background thread, in the order they were asked: ``log`` returns at once.

    The thread sends at most every ``interval`` seconds: what was logged meanwhile reaches each tracker as
    one :meth:`GeneralTracker.log_records` batch (one database transaction for MLflow, one flush of the event
    file for TensorBoard), so a fast loop pays each tracker's fixed costs a few times a second, not every
    step. :meth:`flush`, an artifact and :meth:`close` do not wait for the interval. A tracker that raises is
    reported once (its name and the error) and called no more; the others and the training go on.
    """

    _STOP = object()
    interval = 0.5  # seconds: how stale a tracker's view may be while the run logs

    def __init__(self, trackers: list[GeneralTracker], on_drop=None) -> None:
        """``on_drop(tracker, error)``: what to do when a tracker raises (it is then called no more); by
        default, warn once."""
        self.trackers = list(trackers)
        self._on_drop = on_drop or _warn_dropped_tracker
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._urgent = threading.Event()  # a flush, an artifact or the end: send now
        self._thread: threading.Thread | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The trackers and ``on_drop``, once every call asked so far has reached the trackers; a copy starts with
        its own queue and thread (as ``pickle.dumps(accelerator)`` needs)."""
        self.flush()
        return {"trackers": self.trackers, "on_drop": self._on_drop}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["trackers"], state["on_drop"])

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="runner-trackers", daemon=True)
            self._thread.start()

    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, dict] | None) -> None:
        if self.trackers:
            self._ensure_thread()
            self._queue.put(("log", plain_values(values), step, log_kwargs or {}))

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None, names=None) -> None:
        if self.trackers:
            self._ensure_thread()
            self._queue.put(("artifact", str(local_path), artifact_path, names))
            self._urgent.set()

    def flush(self) -> None:
        """Wait until every call asked so far has reached the trackers."""
        if self._thread is not None and self._thread.is_alive():
            done = threading.Event()
            self._queue.put(("flush", done))
            self._urgent.set()
            done.wait()

    def call(self, method: str, *args, names=None) -> None:
        """Call ``method`` of every tracker (or those ``names`` names) now, on this thread, reporting and
        dropping those that raise."""
        for tracker in list(self.trackers):
            if names is None or tracker.name in names:
                self._guarded(tracker, method, *args)

    def close(self) -> None:
        """Flush, then finish every tracker and stop the thread."""
        self.flush()
        if self._thread is not None and self._thread.is_alive():
            self._queue.put((self._STOP,))
            self._urgent.set()
            self._thread.join()
        self.call("finish")
        self.trackers = []

    def _guarded(self, tracker: GeneralTracker, method: str, *args, **kwargs) -> None:
        try:
            getattr(tracker, method)(*args, **kwargs)
        except Exception as error:  # a tracker never stops the training
            self.trackers = [t for t in self.trackers if t is not tracker]
            self._on_drop(tracker, error)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while True:  # take what else is waiting: one batch per tracker
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            records: list[tuple[dict, int | None, dict]] = []
            for item in items:
                if item[0] == "log":
                    records.append(item[1:])
                    continue
                self._send(records)
                records = []
                if item[0] is self._STOP:
                    return
                if item[0] == "flush":
                    item[1].set()
                elif item[0] == "artifact":
                    self.call("log_artifact", item[1], item[2], names=item[3])
            self._send(records)
            self._urgent.wait(self.interval)  # let the next batch gather, unless someone waits for it
            self._urgent.clear()

    def _send(self, records: list[tuple[dict, int | None, dict]]) -> None:
        if not records:
            return
        for tracker in list(self.trackers):
            mine = [(values, step, kwargs.get(tracker.name, {})) for values, step, kwargs in records]
            self._guarded(tracker, "log_records", mine)
