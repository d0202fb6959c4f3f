"""The one-key checks the config's validation modules share: a minimum, a choice among names, a key a node lacks.

Each failure is one :class:`~runner.config.ConfigError` sentence naming the key; a near miss of a choice
or a key gets a did-you-mean. Nothing here imports torch.
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


# Names other libraries use for a parameter, and torch's name for it: no spelling is close, the meaning is.
SYNONYMS = {"learning_rate": "lr", "learningrate": "lr", "wd": "weight_decay", "epsilon": "eps"}


def not_a_key(full_key: str, known: list[str]) -> str:
    """``trainer.max_step is not a key of 'trainer' (did you mean 'trainer.max_steps'?); ...``: the sentence for
    a key its node lacks, ``known`` being the node's keys."""
    parent, _, name = full_key.rpartition(".")
    close = [SYNONYMS[name]] if SYNONYMS.get(name) in known else difflib.get_close_matches(name, known, n=1)
    suggestion = f" (did you mean {'.'.join(filter(None, [parent, close[0]]))!r}?)" if close else ""
    where = f"'{parent}'" if parent else "the config"
    return f"{full_key} is not a key of {where}{suggestion}; `python -m runner --cfg job` lists every key."
