"""The trackers in a helper process: a logged step costs the training loop a list append, whatever the trackers do.

A tracker's own work is its library's Python (TensorBoard's protobuf events, MLflow's SQLAlchemy store, W&B's
records): on a thread it holds the interpreter lock that a Python-bound training step needs, so a step of
0.4 ms pays 0.1-0.4 ms more per logged step (bench/trackers.py). :class:`TrackerProcess` keeps the same
interface as :class:`~runner.engine.tracking.thread.TrackerThread` and runs the trackers in a child forked
from this process when they start (fork: the child has the tracker objects as they were built, nothing is
pickled but the logged values). This process keeps what was logged in a list; a sender thread hands it over
as one batch at most every ``interval`` seconds, and the child calls the trackers with it, in order.

``trackers`` here are stand-ins (:class:`RemoteTracker`): their ``name``, the attributes a caller reads
(``run_id``, ...) fetched from the child, ``log`` and ``log_artifact`` sent to it. The library's own object
(``get_tracker(name, unwrap=True)``) stays in the child. A tracker that raises there is dropped and reported
here in the usual one warning; if the child dies, every tracker is, and training goes on. The child ignores
SIGINT and SIGTERM (the training process decides when the run ends) and finishes the trackers when this
process closes it or exits.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import multiprocessing
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from runner.engine.tracking.base import GeneralTracker
from runner.engine.tracking.thread import PLAIN_TYPES, TrackerThread, describe, logger, plain_values, warn_dropped


def available() -> bool:
    """Whether trackers can run in a helper process here (Linux: fork)."""
    return sys.platform == "linux"


class RemoteTracker(GeneralTracker):
    """This process's stand-in for a tracker that runs in the helper process."""

    def __init__(self, link: TrackerProcess, tracker: GeneralTracker) -> None:
        super().__init__(_blank=True)
        self._link = link
        self.name = tracker.name
        self.requires_logging_directory = tracker.requires_logging_directory
        self.main_process_only = tracker.main_process_only

    def __getattr__(self, attribute: str) -> Any:  # only for what this stand-in lacks: the tracker's own
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return self._link.request("getattr", self.name, attribute)

    @property
    def tracker(self) -> Any:
        raise ValueError(
            f"The {self.name} tracker runs in the trackers' helper process, so its library object is not in this "
            f"one; log through accelerator.log or get_tracker({self.name!r}).log, or keep the trackers in this "
            "process with Accelerator(tracker_process=False) (the runner: trainer.tracker_process=false)."
        )

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs) -> None:
        values = _portable(values)
        self._link.request("call", "log", (values,), {"step": step, **kwargs}, [self.name])

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None = None) -> None:
        self._link.log_artifact(local_path, artifact_path, [self.name])


class TrackerProcess:
    """:class:`TrackerThread`'s interface, with the trackers in a forked child (see the module docstring)."""

    interval = TrackerThread.interval  # seconds between batches while the run logs
    backlog = 65536  # records kept here at most: beyond, ``log`` hands them over itself
    finish_timeout = 60.0  # seconds end_training waits for the trackers to finish before stopping the helper

    def __init__(self, trackers: list[GeneralTracker]) -> None:
        self._pending: collections.deque = collections.deque()  # log() appends, the sender pops: no lock
        self._lock = threading.Lock()  # one conversation with the child at a time
        self._wake = threading.Event()
        self._closed = False
        self._warned_unsendable = False
        self._warned_unreadable = False
        self.trackers: list[GeneralTracker] = []
        if not trackers:
            self._child = None
            return
        ours, theirs = multiprocessing.get_context("fork").Pipe()
        self._conn = ours
        self._child = multiprocessing.get_context("fork").Process(
            target=_serve, args=(theirs, ours, trackers), name="runner-trackers", daemon=True
        )
        self._child.start()
        theirs.close()  # the child's end lives in the child: its exit is this end's EOF
        self.trackers = [RemoteTracker(self, tracker) for tracker in trackers]
        atexit.register(self.close)  # before multiprocessing's own exit handler, which would wait for the child
        # A process forked by multiprocessing (an elastic worker) leaves through multiprocessing's exit function, not
        # atexit: it joins its children, and the child waits for this end to close. Close it first there too.
        multiprocessing.util.Finalize(self, self.close, exitpriority=100)
        self._sender = threading.Thread(target=self._send_loop, name="runner-trackers-sender", daemon=True)
        self._sender.start()

    # ------------------------------------------------------------------ what TrackerThread offers
    def log(self, values: dict[str, Any], step: int | None, log_kwargs: dict[str, dict] | None) -> None:
        if self.trackers:
            self._pending.append((_portable(values), step, log_kwargs or _NO_KWARGS))
            if len(self._pending) > self.backlog:  # the child falls behind: wait for it here
                self._hand_over()

    def log_artifact(self, local_path: str | os.PathLike, artifact_path: str | None, names=None) -> None:
        if self.trackers:
            self._post(("call", "log_artifact", (str(local_path), artifact_path), {}, names, False))

    def flush(self) -> None:
        """Wait until every call asked so far has reached the trackers."""
        if self.trackers:
            self.request("flush")

    def call(self, method: str, *args, names=None) -> None:
        """Call ``method`` of every tracker (or those ``names`` names) in the child, and wait for it."""
        if self.trackers:
            self.request("call", method, args, {}, names)

    def close(self) -> None:
        """Hand over what is left, finish every tracker, and wait for the child to end."""
        if self._child is None or self._closed:
            return
        atexit.unregister(self.close)
        self._closed = True  # the sender stops first: the child's exit is then no news to it
        self._wake.set()
        self._sender.join()
        deadline = time.monotonic() + self.finish_timeout
        with self._lock:
            if self.trackers:
                self._send_pending()
                self._send(("close",), wanted=True)
                self._receive_answer(deadline)
        self._conn.close()  # the child ends at this EOF if it has not already
        self._child.join(timeout=max(deadline - time.monotonic(), 0.1))
        if self._child.is_alive():  # a library's finish that never returns must not keep the run
            logger.warning(
                "The trackers did not finish within %d s (%s); their helper process was stopped, and what they had "
                "not written yet is lost to them (metrics.json keeps every value).",
                self.finish_timeout, ", ".join(tracker.name for tracker in self.trackers) or "none left",
            )  # fmt: skip
            self._child.kill()
            self._child.join()
        self.trackers = []

    # ------------------------------------------------------------------ talking to the child
    def request(self, kind: str, *args) -> Any:
        """Hand over what was logged, then ask the child ``kind`` and wait for its answer."""
        with self._lock:
            if not self.trackers:
                return None
            self._send_pending()
            self._send((kind, *args, True) if kind == "call" else (kind, *args), wanted=True)
            return self._receive_answer()

    def _post(self, message: tuple) -> None:
        """Hand over what was logged, then ``message``, without waiting for the child."""
        with self._lock:
            if self.trackers:
                self._send_pending()
                self._send(message)

    def _hand_over(self) -> None:
        with self._lock:
            if self.trackers:
                self._send_pending()
                self._read_notices()

    def _send_loop(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._pending:
                self._hand_over()
            elif self.trackers:
                with self._lock:
                    self._read_notices()

    def _send_pending(self) -> None:
        if self._pending:  # what is there now; what log() appends meanwhile goes with the next batch
            records = [self._pending.popleft() for _ in range(len(self._pending))]
            self._send(("records", records))

    def _send(self, message: tuple, *, wanted: bool = False) -> None:
        """``message`` to the child, as an envelope it can always open: ``(kind, wanted, pickled rest)``. What the
        rest holds is the user's (logged values, a tracker's arguments); should the child fail to load it (a class
        defined after the fork), it says so and still answers when an answer is ``wanted``."""
        try:
            body = pickle.dumps(message[1:], protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a value of the user's that cannot travel: leave it out, and say so once
            if message[0] != "records":
                raise
            body = pickle.dumps((self._portable(message[1]),), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._conn.send_bytes(pickle.dumps((message[0], wanted, body), protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError):
            self._lost()

    def _portable(self, records: list[tuple]) -> list[tuple]:
        """``records`` without the values that cannot be sent to the helper; the first such value is warned about."""
        kept = []
        for values, step, kwargs in records:
            portable = {}
            for key, value in values.items():
                try:
                    pickle.dumps(value)
                    portable[key] = value
                except Exception as error:
                    if not self._warned_unsendable:
                        self._warned_unsendable = True
                        logger.warning(
                            "accelerator.log's value for %r (a %s) cannot be sent to the trackers' helper process "
                            "(%s); such values are left out. Log numbers, text and tensors, or keep the trackers in "
                            "this process with tracker_process=False (the runner: trainer.tracker_process=false).",
                            key, type(value).__name__, describe(error),
                        )  # fmt: skip
            kept.append((portable, step, kwargs))
        return kept

    def _receive_answer(self, deadline: float | None = None) -> Any:
        while True:  # the notices the child sent before its answer come first
            try:
                if deadline is not None and not self._conn.poll(max(deadline - time.monotonic(), 0)):
                    return None  # the caller stops the child
                message = self._conn.recv()
            except (EOFError, OSError):
                self._lost()
                return None
            if message[0] == "answer":
                if isinstance(message[1], BaseException):
                    raise message[1]
                return message[1]
            self._notice(message)

    def _read_notices(self) -> None:
        try:
            while self.trackers and self._conn.poll():
                self._notice(self._conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _notice(self, message: tuple) -> None:
        if message[0] == "unreadable":  # ("unreadable", reason): values the child could not load
            if not self._warned_unreadable:
                self._warned_unreadable = True
                logger.warning(
                    "Values sent to the trackers could not be read in their helper process (%s); they were left "
                    "out, and training goes on. Log numbers, text and tensors, or keep the trackers in this process "
                    "with tracker_process=False (the runner: trainer.tracker_process=false).",
                    message[1],
                )  # fmt: skip
            return
        _, name, reason = message  # ("dropped", name, reason): a tracker raised in the child
        self.trackers = [tracker for tracker in self.trackers if tracker.name != name]
        warn_dropped(name, reason)

    def _lost(self) -> None:
        """The child is gone: each tracker it ran is reported, and logging stops."""
        self._child.join(timeout=5)
        reason = f"the trackers' helper process ended, exit code {self._child.exitcode}"
        for tracker in self.trackers:
            warn_dropped(tracker.name, reason)
        self.trackers = []
        self._pending.clear()


_NO_KWARGS: dict = {}  # shared by every record logged without log_kwargs; never written to


def _portable(values: dict[str, Any]) -> dict[str, Any]:
    """:func:`plain_values` with tensors as CPU copies, with a fast path for what a loop logs: Python numbers."""
    for value in values.values():
        if type(value) not in PLAIN_TYPES:
            return plain_values(values, copy_tensors=True)
    return values.copy()


def helper_cpu(allowed: set[int], local_world_size: str) -> int | None:
    """The one CPU the helper of a node's only training process keeps to: the last this process may use. None
    with a single CPU, or beside other processes of the run on the node, where the scheduler places it.

    Spread over every CPU, the helper's threads and the services its trackers start (W&B's ``wandb-core``)
    land beside the training's threads and take turns with them; kept to one, they leave the others alone.
    Measured with bench/trackers.py's tiny loop on 2 cores: never slower, up to 10% faster for the loop, and the
    trackers take 13-23% more steps a second. Beside other ranks (DDP on the CPU, say) a pinned helper would
    slow one rank, and every rank waits for the slowest, so it is left unpinned there.
    """
    if len(allowed) < 2 or local_world_size not in ("", "1"):
        return None
    return max(allowed)


def _serve(conn: Connection, parents_end: Connection, trackers: list[GeneralTracker]) -> None:
    """The child: call the trackers as the training process asks, until it closes or exits."""
    parents_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and a preemption notice are the training's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(10)  # background work: where the cores are busy, the training's threads come first
    cpu = helper_cpu(os.sched_getaffinity(0), os.environ.get("LOCAL_WORLD_SIZE", ""))
    if cpu is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})  # this thread, so every thread and service started from here after it
    dispatch = TrackerThread(
        trackers, on_drop=lambda tracker, error: conn.send(("dropped", tracker.name, describe(error)))
    )
    while True:
        try:
            kind, wanted, body = conn.recv()  # the envelope: a string, a flag and bytes, which always load
        except (EOFError, OSError):  # the training process is gone: keep what reached us
            dispatch.call("finish")
            return
        try:
            message = (kind, *pickle.loads(body))
        except Exception as error:  # values that pickled there and do not load here (a class defined since)
            conn.send(("unreadable", describe(error)))
            if wanted:
                conn.send(("answer", None))
            continue
        if kind == "records":
            dispatch._send(message[1])
            continue
        answer: Any = None
        if kind == "call":
            _, method, args, kwargs, names, wanted = message
            for tracker in list(dispatch.trackers):
                if names is None or tracker.name in names:
                    dispatch._guarded(tracker, method, *args, **kwargs)
            if not wanted:
                continue
        elif kind == "getattr":
            answer = _attribute(dispatch.trackers, *message[1:])
        elif kind == "close":
            dispatch.call("finish")
        conn.send(("answer", answer))
        if kind == "close":
            return


def _attribute(trackers: list[GeneralTracker], name: str, attribute: str) -> Any:
    """A tracker's attribute, if it can travel to the training process; else the error to raise there."""
    tracker = next((tracker for tracker in trackers if tracker.name == name), None)
    if tracker is None:
        return AttributeError(f"The {name} tracker is no longer running.")
    try:
        value = getattr(tracker, attribute)
        pickle.dumps(value)
    except AttributeError as error:
        return error
    except Exception:
        return AttributeError(
            f"{type(tracker).__name__}.{attribute} lives in the trackers' helper process and cannot be sent to this "
            "one; construct the Accelerator with tracker_process=False to use it here."
        )
    return value
