"""Command-line overrides read with Hydra's own grammar: one parser for the command line, resume and sweeps.

Whatever the runner decides from an override (which key it sets, the folder it names, whether it
switches a config group) it reads through Hydra's ``OverridesParser``, so quoting, the ``+``,
``++`` and ``~`` prefixes, ``group@package`` and sweeps mean here exactly what Hydra will compose.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from runner.config import ConfigError


@functools.cache
def _parser():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def parse(lines: Iterable[str]) -> list:
    """Hydra's ``Override`` for each line.

    Raises:
        ConfigError: A line Hydra cannot read, with the quoting that fixes the usual cause.
    """
    parsed = []
    for line in lines:
        try:
            parsed.extend(_parser().parse_overrides([line]))
        except Exception as error:  # Hydra's OverrideParseException
            raise ConfigError(
                f"Cannot parse the override {line!r} ({str(error).splitlines()[0]}); values with brackets, commas "
                """or spaces need inner quotes, e.g. 'data.train_split="test[:8000]"'."""
            ) from None
    return parsed


def key(line: str) -> str:
    """The key or config group ``line`` sets or deletes, without its ``+``, ``++`` or ``~``."""
    return parse([line])[0].key_or_group


def text(override) -> str | None:
    """An override's value as a plain string (quotes removed; ``null`` is ``"null"``, ``1e-3`` is ``"0.001"``:
    :func:`as_typed` keeps what was typed); None for a deletion or a sweep."""
    if override.is_delete() or override.is_sweep_override():
        return None
    value = override.value()
    return value if isinstance(value, str) else override.get_value_element_as_str()


def value(lines: Iterable[str], name: str) -> str | None:
    """The value the last of ``lines`` that sets ``name`` gives it (see :func:`text`); None if none sets it."""
    found = None
    for override in parse(lines):
        if override.key_or_group == name:
            found = text(override)
    return found


def as_typed(lines: Iterable[str]) -> dict[str, str]:
    """Each key's value as the line wrote it (``1e-3`` stays ``1e-3``; the last line of a key wins): for display."""
    lines = list(lines)
    return {
        override.key_or_group: line.split("=", 1)[1]
        for line, override in zip(lines, parse(lines), strict=True)
        if not override.is_delete() and "=" in line
    }


def values(lines: Iterable[str]) -> dict[str, str | None]:
    """Each key's value (the last line of it wins), as :func:`text` gives it."""
    return {override.key_or_group: text(override) for override in parse(lines)}


def sets(lines: Iterable[str], name: str) -> bool:
    """Whether any of ``lines`` sets (or deletes) ``name``."""
    return any(override.key_or_group == name for override in parse(lines))


def without(lines: Iterable[str], *names: str) -> list[str]:
    """``lines`` less those that set any of ``names``."""
    lines = list(lines)
    return [line for line, override in zip(lines, parse(lines), strict=True) if override.key_or_group not in names]


def last_per_key(lines: Iterable[str]) -> list[str]:
    """``lines`` with only the last one of each key kept (what Hydra applies), in their order."""
    lines = list(lines)
    keys = [override.key_or_group for override in parse(lines)]
    last = {name: i for i, name in enumerate(keys)}
    return [line for i, line in enumerate(lines) if last[keys[i]] == i]


def is_hydra(line: str) -> bool:
    """Whether ``line`` configures Hydra itself (``hydra.*`` or a ``hydra/...`` group)."""
    name = key(line)
    return name == "hydra" or name.startswith(("hydra.", "hydra/"))


def hydra_value(text: str) -> str:
    """``text`` as a value in Hydra's override grammar: bare when plain, else double-quoted."""
    if re.fullmatch(r"[\w./:-]+", text, flags=re.ASCII):
        return text
    # Inside quotes Hydra reads a backslash as an escape only before a quote or at the very end.
    escaped = re.sub(r'(\\*)"', lambda match: match.group(1) * 2 + '\\"', text)
    escaped = re.sub(r"(\\+)$", lambda match: match.group(1) * 2, escaped)
    return f'"{escaped}"'
