"""The one-key checks the config's validation modules share: a minimum, and a choice among names.

Each failure is one :class:`~runner.config.ConfigError` sentence naming the key; a near miss of a choice
gets a did-you-mean. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError


def at_least(cfg: DictConfig, key: str, minimum: int | float, *, optional: bool = False) -> None:
    value = OmegaConf.select(cfg, key)
    if value is None and optional:
        return
    if value is None or value < minimum:
        hint = " (or null)" if optional else ""
        raise ConfigError(f"{key}={value} must be at least {minimum}{hint}.")


def choice(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    one_of(key, OmegaConf.select(cfg, key), choices)


def one_of(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not supported{hint}; use one of {', '.join(choices)}.")
