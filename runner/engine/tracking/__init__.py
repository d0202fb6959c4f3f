"""The engine's tracking room: experiment trackers (TensorBoard, CSV, MLflow, Weights & Biases and a plain
JSON-lines log) behind Accelerate's :class:`GeneralTracker` interface, and how ``log_with`` names them.

- :mod:`~runner.engine.tracking.base`: the interface (:class:`GeneralTracker`), the blank stand-in, and the
  value helpers every tracker shares.
- :mod:`~runner.engine.tracking.files`: TensorBoard, CSV and JSON lines, files under the logging directory.
- :mod:`~runner.engine.tracking.services`: MLflow and W&B, a run kept in an experiment store.
- :mod:`~runner.engine.tracking.registry`: the trackers by name, ``register_tracker_class`` and ``build_trackers``.
- :mod:`~runner.engine.tracking.thread`: :class:`TrackerThread`, one background thread that calls the trackers
  in order, so a training step never waits for a file, a database or a network. A tracker that raises is
  reported once and dropped; training goes on.
- :mod:`~runner.engine.tracking.process`: :class:`TrackerProcess`, the same calls in a helper process (Linux).
- :mod:`~runner.engine.tracking.verbs`: the Accelerator's tracking verbs (``init_trackers``, ``log``, ...).

The trackers and their registry import the standard library only (the thread and the verbs, which read
tensors, import torch too); each tracker's library is imported in ``start()`` (or when it writes), never at
engine import. The names below are importable from here, as they were from the module this room
grew from, and ``runner.engine.tracking.GeneralTracker`` (and the others) stay valid dotted names.

It may import the trackers' libraries (each when its tracker is built) and :mod:`runner.files`; nothing else of
the engine, and nothing outside it.
"""

from runner.engine.tracking.base import GeneralTracker, flatten
from runner.engine.tracking.files import CSVTracker, JSONLTracker, TensorBoardTracker
from runner.engine.tracking.registry import TRACKERS, build_trackers, register_tracker_class
from runner.engine.tracking.services import MLflowTracker, WandBTracker

__all__ = [
    "TRACKERS",
    "CSVTracker",
    "GeneralTracker",
    "JSONLTracker",
    "MLflowTracker",
    "TensorBoardTracker",
    "WandBTracker",
    "build_trackers",
    "flatten",
    "register_tracker_class",
]
