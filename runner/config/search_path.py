"""The config folders a command line composes from: ``conf/``, then ``--config-dir`` and ``hydra.searchpath``."""

from __future__ import annotations

from pathlib import Path

from runner.config import ConfigError
from runner.config import overrides as parsed
from runner.config.overrides import hydra_value


def is_search_path(override: str) -> bool:
    """Whether ``override`` sets ``hydra.searchpath``."""
    return parsed.key(override) == "hydra.searchpath"


def search_path_overrides(overrides: list[str], *, config_dir: str | None) -> list[str]:
    """One ``hydra.searchpath=[...]`` override holding ``--config-dir`` and the command line's search path.

    Hydra adds ``--config-dir`` to its search path by itself; composing here (to check the command
    line, or for ``--help``) needs it spelled out. The user's folders come after ``conf/``: they add
    groups, options and experiments to the built-in ones.

    Raises:
        ConfigError: ``--config-dir`` is not a folder, or ``hydra.searchpath`` is not a list.
    """
    entries = search_path_entries(overrides, config_dir=config_dir)
    if not entries:
        return []
    return ["hydra.searchpath=[" + ",".join(hydra_value(entry) for entry in entries) + "]"]


def search_path_entries(overrides: list[str], *, config_dir: str | None) -> list[str]:
    """``--config-dir`` (as ``file://<folder>``) and the entries of the command line's ``hydra.searchpath``.

    Raises:
        ConfigError: ``--config-dir`` is not a folder, or ``hydra.searchpath`` is not a list.
    """
    entries = []
    if config_dir is not None:
        folder = Path(config_dir).expanduser().resolve()
        if not folder.is_dir():
            raise ConfigError(f"--config-dir {config_dir} is not a folder; pass the folder that holds your groups.")
        entries.append(f"file://{folder}")
    for line, override in zip(overrides, parsed.parse(overrides), strict=True):
        if override.key_or_group != "hydra.searchpath":
            continue
        value = override.value()
        if not isinstance(value, list):
            raise ConfigError(f"{line} must be a list, e.g. hydra.searchpath=[file://./conf] or [pkg://mylab.conf].")
        entries += [str(entry) for entry in value]
    return entries
