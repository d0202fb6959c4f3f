"""Where a run's start-up time goes, from the command to its first optimizer step.

Each phase is stamped when it ends, in an environment variable, so the workers a launcher starts
inherit the launching process's stamps and add their own. Rank 0 logs one line after its first
optimizer step, e.g.::

    Start-up: first optimizer step 4.07 s after the command (check the command line 0.23 s, compose
    with Hydra 0.06 s, import torch 1.10 s, validate and check data 0.03 s, start workers 1.26 s,
    process group 0.05 s, build and prepare 1.19 s, first optimizer step 0.13 s)

The record starts at the process's own start (:func:`process_start`), so the first phase is the
interpreter's start and imports. Whoever starts the command may stamp its own start first instead
(``RUNNER_STARTUP=spawned=<time.time()>``; bench/startup.py does).

:func:`skip_collection_at_exit` takes the other end: the second a process with torch loaded spends collecting
garbage as its interpreter ends.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time

STARTUP_ENV = "RUNNER_STARTUP"
logger = logging.getLogger("runner")


def skip_collection_at_exit() -> None:
    """Let this process's interpreter end without its final garbage collections (registered once per process).

    As it ends, Python collects garbage over every object it holds: a second of CPU once torch, ``torch._dynamo``
    and torchmetrics are imported, spent after the run's work is done (the forkserver skips it too: see
    runner.engine.forkserver). :func:`gc.freeze`, registered early, runs after the exit handlers registered later
    (they run last in, first out) and leaves every object it freezes to the process's end. Every exit handler still
    runs and an object still goes with its last reference; only garbage in reference cycles is left uncollected,
    which an ending process need not collect.
    """
    global _COLLECTION_SKIPPED
    if not _COLLECTION_SKIPPED:
        _COLLECTION_SKIPPED = True
        atexit.register(gc.freeze)


_COLLECTION_SKIPPED = False


def stamp(phase: str) -> None:
    """Record that ``phase`` ended now; processes started after this inherit the record.

    The first stamp of a command starts the record at the process's own start (where the system says when), so the
    phases add up to the time since the command: the interpreter's start and imports are the first phase.
    """
    previous = os.environ.get(STARTUP_ENV, "")
    if not previous and (started := process_start()) is not None:
        previous = f"command={started:.6f}"
    os.environ[STARTUP_ENV] = f"{previous};{phase}={time.time():.6f}" if previous else f"{phase}={time.time():.6f}"


def process_start() -> float | None:
    """When this process started, as ``time.time()`` (to the clock tick, 10 ms); None where ``/proc`` cannot say."""
    try:
        with open("/proc/self/stat") as file:
            ticks = int(file.read().rpartition(")")[2].split()[19])  # starttime, field 22: ticks after boot
        with open("/proc/uptime") as file:
            uptime = float(file.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def restart(phase: str) -> None:
    """Start a new record at ``phase`` (a sweep's next job in the same process starts from there)."""
    os.environ[STARTUP_ENV] = f"{phase}={time.time():.6f}"


def stamps() -> list[tuple[str, float]]:
    """The phases stamped so far, in order, with the time each ended."""
    found = []
    for entry in filter(None, os.environ.get(STARTUP_ENV, "").split(";")):
        phase, _, when = entry.rpartition("=")
        try:
            found.append((phase, float(when)))
        except ValueError:
            return []  # not ours: report nothing rather than nonsense
    return found


def summary() -> str | None:
    """One sentence: the time from the first stamp to the last, and each phase's share."""
    found = stamps()
    if len(found) < 2:
        return None
    durations = [(phase, end - start) for (_, start), (phase, end) in zip(found, found[1:], strict=False)]
    phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in durations)
    return f"Start-up: {found[-1][0]} {found[-1][1] - found[0][1]:.2f} s after the command ({phases})"


def elapsed() -> float | None:
    """Seconds since this command started (its record's first stamp), or None without a record."""
    found = stamps()
    return time.time() - found[0][1] if found else None


def timings() -> dict[str, float]:
    """metrics.json's account of this command's time: its wall time so far (``wall_time_s``) and the time to its
    first optimizer step (``time_to_first_step_s``), in seconds; what the record cannot say is left out."""
    found = stamps()
    if not found:
        return {}
    start = found[0][1]
    times = {"wall_time_s": round(time.time() - start, 3)}
    first = dict(found).get("first optimizer step")
    if first is not None:
        times["time_to_first_step_s"] = round(first - start, 3)
    return times


def log_first_step() -> None:
    """Stamp the first optimizer step and log the summary (the first start of a run only)."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0):
        return  # after a restart the launching process's stamps no longer describe this start
    stamp("first optimizer step")
    line = summary()
    if line:
        logger.info(line)
