"""What a stream's saved state may be, checked when a checkpoint is loaded, before any stream reads it.

A checkpoint's loader position holds its stream's state (``dataset_state``, or each loader worker's in
``worker_states``), and a run folder may come from someone else: a state that its stream could never have
reached would otherwise fail deep in a worker with a traceback, or, worse, resume on other data. So a
position is checked as it is loaded, field by field, and a state that does not fit is one sentence naming
the field (:func:`stream_state_error`).

:func:`check_stream_state` checks a state against the stream that will read it: by the stream's own
``check_state_dict(state, *, field)`` where it has one (``runner.data.Packed`` and ``Mixture`` do, and
check their sources' states through this function in turn), by the layout of the stream's own state for a
Hugging Face ``IterableDataset`` (the same keys and pipeline of iterables, counts where it has counts).
Any other stream's state is its own business.
"""

from __future__ import annotations

import reprlib
from typing import Any

from runner.engine.checkpoint.errors import CheckpointError

_SHOWN = reprlib.Repr()  # keyword settings need Python 3.12
_SHOWN.maxlist = _SHOWN.maxdict = 4
_SHOWN.maxstring = _SHOWN.maxother = 40


def shown(value: Any) -> str:
    """``value`` as a message shows it: short, whatever its size."""
    return _SHOWN.repr(value)


def is_count(value: Any) -> bool:
    """Whether ``value`` is a non-negative integer (JSON's true and false are not)."""
    return type(value) is int and value >= 0


def known_length(dataset: Any) -> int | None:
    """How many samples ``dataset`` holds, where it says (a stream does not)."""
    try:
        return len(dataset)
    except TypeError:
        return None


def stream_state_error(field: str, problem: str) -> CheckpointError:
    """The sentence for a saved stream state that its stream cannot have: ``field`` (where it sits in the loader's
    position, e.g. ``dataset_state.carry``) and ``problem``, followed by what to do."""
    return CheckpointError(
        f"{field}: {problem}; the checkpoint's stream state is not one this data can have: resume from another "
        "checkpoint or start a new run."
    )


def check_stream_state(stream: Any, state: Any, *, field: str) -> None:
    """Raise :func:`stream_state_error` if ``stream`` cannot have reached ``state`` (saved at ``field``).

    Args:
        stream: The stream that will continue from ``state``.
        state: The saved state, as the manifest holds it (JSON).
        field: Where the state sits in the loader's position, named in the sentence.

    Raises:
        CheckpointError: One sentence naming the field that does not fit.

    Example:
        >>> check_stream_state(Packed([[1, 2, 3]], block_size=4), "abc", field="dataset_state")
        Traceback (most recent call last):
        CheckpointError: dataset_state: 'abc' is not Packed's state (documents, carry, positions, source); ...
    """
    check = getattr(stream, "check_state_dict", None)
    if callable(check):
        check(state, field=field)
    elif type(stream).__module__.split(".")[0] == "datasets" and callable(getattr(stream, "state_dict", None)):
        _check_layout(state, stream.state_dict(), field=field)


def _check_layout(saved: Any, own: Any, *, field: str) -> None:
    """``saved`` laid out as a Hugging Face stream's own state ``own`` is: the same keys, each iterable of its
    pipeline of the same ``type``, a count wherever ``own`` holds one (what varies as it reads is not compared)."""
    if isinstance(own, dict):
        if not isinstance(saved, dict) or set(saved) != set(own):
            raise stream_state_error(
                field, f"{shown(saved)} is not laid out as this Hugging Face stream's state ({', '.join(sorted(own))})"
            )
        for key, value in own.items():
            if key == "type" and saved[key] != value:
                raise stream_state_error(f"{field}.type", f"{shown(saved[key])} where this stream reads a {value}")
            _check_layout(saved[key], value, field=f"{field}.{key}")
    elif type(own) is int and not is_count(saved):
        raise stream_state_error(field, f"{shown(saved)} is not a count")
