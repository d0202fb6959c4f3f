"""The one sentence for a failed run of several processes: the rank that caused it, and its error."""

from __future__ import annotations

import json
import re
from pathlib import Path

# When one rank dies, its peers fail too, on the broken connection; those are not the cause.
_COLLATERAL = re.compile(
    r"Connection (closed|reset) by peer|remote worker|Broken pipe|communicator was aborted|SIGTERM"
)


def describe_failure(failures: dict) -> str:
    """One sentence for the root cause among the failed ranks (:func:`root_cause`)."""
    rank, detail = root_cause(failures)
    return f"Worker rank {rank} failed: {detail}"


def root_cause(failures: dict) -> tuple[int, str]:
    """The rank whose failure caused the others, and the last line of its error (or ``exit code N``).

    When a rank raises, its peers fail next on the broken connection, and the elastic agent may
    report one of those before the rank that raised has exited. So the error files torch's agent
    keeps for every local rank of the attempt are read too, and an error of a rank's own is
    preferred over a peer's broken connection. When every error is a broken connection and exactly one
    local rank left no error file, that rank went away first (killed or crashed) and is named.
    """
    candidates: dict[int, str] = {}
    silent: set[int] = set()
    for rank, failure in failures.items():
        text = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        if failure.exitcode >= 0 and not Path(str(failure.error_file)).is_file():
            text = ""  # no error of its own: torch's message is only advice on how to record one
        candidates[rank] = str(text or "").strip() or f"exit code {failure.exitcode}"
        candidates.update(_sibling_errors(rank, failure))
        silent.update(_silent_siblings(rank, failure))
    rank = min(candidates, key=lambda r: (bool(_COLLATERAL.search(candidates[r])), r not in failures, r))
    silent -= candidates.keys()  # the reported ranks are among them
    if _COLLATERAL.search(candidates[rank]) and len(silent) == 1:
        # Every error is a broken connection, and one rank left none: it was the one that went away. torch's agent
        # reports one failed process per poll, and the peer that raised on the connection can exit in the same poll.
        return silent.pop(), (
            "it left no error of its own: it was killed (by a signal, e.g. the out-of-memory killer) or crashed, "
            f"and rank {rank} then failed on the broken connection"
        )
    detail = candidates[rank].splitlines()[-1]
    # "runner.engine.checkpoint.CheckpointError: ..." reads better as "CheckpointError: ..."
    detail = re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", detail)
    return rank, detail


def recorded_traceback(failures: dict, rank: int) -> str | None:
    """The traceback ``rank`` wrote into its error file (torch's record of a failed worker), read from the file of
    its own failure or, for a rank the agent stopped, from the attempt's folder its peers' files are in."""
    for failed, failure in failures.items():
        error_file = Path(str(failure.error_file))
        if failed != rank:
            if not error_file.parent.name.isdigit():
                continue
            error_file = error_file.parent.parent / str(rank - failed + failure.local_rank) / "error.json"
        try:
            trace = json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(trace, str) and trace.strip():
            return trace.rstrip()
    return None


def _sibling_errors(rank: int, failure) -> dict[int, str]:
    """Messages in the error files of the other local ranks of ``failure``'s attempt, by global rank."""
    error_file = Path(str(failure.error_file))
    if not error_file.is_file() or not error_file.parent.name.isdigit():
        return {}
    found = {}
    for sibling in error_file.parent.parent.glob("*/error.json"):
        if not sibling.parent.name.isdigit() or sibling == error_file:
            continue
        try:
            message = json.loads(sibling.read_text())["message"]["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(message, str) and message.strip():
            found[rank - failure.local_rank + int(sibling.parent.name)] = message.strip()
    return found


def _silent_siblings(rank: int, failure) -> set[int]:
    """The global ranks of the other local ranks of ``failure``'s attempt that left no error file at all."""
    error_file = Path(str(failure.error_file))
    if not error_file.is_file() or not error_file.parent.name.isdigit():
        return set()
    return {
        rank - failure.local_rank + int(folder.name)
        for folder in error_file.parent.parent.iterdir()
        if folder.name.isdigit() and folder != error_file.parent and not (folder / "error.json").exists()
    }
