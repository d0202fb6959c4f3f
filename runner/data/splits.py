"""Split names with optional slices: ``train``, ``test[:8000]``, ``test[8000:]``, ``train[:10%]``."""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPLIT = re.compile(r"^(?P<name>[A-Za-z_]\w*)(?:\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\])?$")


@dataclass(frozen=True)
class SplitSpec:
    name: str
    start: str | None = None
    stop: str | None = None

    def indices(self, length: int) -> range:
        """The positions of this slice in a split of ``length`` items (percentages round down)."""
        return range(length)[slice(_bound(self.start, length), _bound(self.stop, length))]


def _bound(value: str | None, length: int) -> int | None:
    if value is None:
        return None
    if value.endswith("%"):
        percent = int(value[:-1])
        return int(length * percent / 100) if percent >= 0 else -int(length * -percent / 100)
    return int(value)


def parse_split(split: str) -> SplitSpec:
    """Parse ``name[start:stop]``; bounds are item counts or percentages.

    Raises:
        ValueError: The string is not of that form.
    """
    match = _SPLIT.match(split.strip())
    if not match:
        raise ValueError(f"Split {split!r} is not a split; write it like 'train', 'test[:8000]' or 'train[:10%]'.")
    return SplitSpec(match["name"], match["start"], match["stop"])
