"""run.log read as data: each line's time and message, the last step it logged, and when it was last written.

A line is ``[2026-12-07 09:12:40,123][runner][INFO] - message`` (:data:`runner.folders.layout.LOG_FORMAT`); a
continuation line (a traceback's) is left out. Times are local, as the launching machine wrote them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from runner.folders.layout import LOG_FILE

TAIL_BYTES = 1 << 20  # the part of run.log read for its latest lines: the latest steps are at its end
_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\]\[[^]]*\]\[[A-Z]+\] - (.*)$")
_STEP = re.compile(r"^step (\d+)/(\d+|\?) \| (.*)$")


def messages(run: Path, *, tail: bool = False) -> Iterator[tuple[float, str]]:
    """``(when, message)`` for each line of ``run``'s run.log (of its last :data:`TAIL_BYTES` with ``tail``),
    ``when`` in seconds since the epoch; nothing if it has none or it cannot be read."""
    try:
        with open(run / LOG_FILE, "rb") as file:
            if tail:
                file.seek(max(0, os.fstat(file.fileno()).st_size - TAIL_BYTES))
            for line in file:
                found = _LINE.match(line.decode(errors="replace").rstrip("\r\n"))
                if found is None:
                    continue
                try:
                    when = datetime.strptime(f"{found.group(1)}.{found.group(2)}", "%Y-%m-%d %H:%M:%S.%f")
                except ValueError:  # a date that is no date (month 13)
                    continue
                yield when.timestamp(), found.group(3)
    except OSError:
        return


def first_logged(run: Path) -> float | None:
    """When run.log's first line was written: the first launch's first line."""
    return next((when for when, _ in messages(run)), None)


def last_logged(run: Path) -> float | None:
    """When run.log's last line was written (the file's own time changes when it is copied)."""
    last = None
    for when, _ in messages(run, tail=True):
        last = when
    return last


def latest_step(run: Path) -> tuple[str, dict[str, str]]:
    """The last step the run logged (``"120/300"``, ``"-"`` if none) and the latest value of each metric logged
    with a step, as written."""
    step, values = "-", {}
    for _, message in messages(run, tail=True):
        found = _STEP.match(message)
        if found is None:
            continue
        step = f"{found.group(1)}/{found.group(2)}"
        for part in found.group(3).split(" | "):
            key, _, value = part.strip().partition(" ")
            if key and value:
                values[key] = value
    return step, values
