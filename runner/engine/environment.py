"""Temporarily set environment variables: Accelerate's ``patch_environment``, which the launchers use too."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set each keyword as an environment variable (upper-cased name, ``str`` value) inside the block.

    On leaving, every variable gets back the value it had before, or is removed if it had none, also
    when the block raises. Child processes started inside inherit the values.

    Example:
        >>> with patch_environment(omp_num_threads=1):
        ...     os.environ["OMP_NUM_THREADS"]
        '1'
    """
    values = {name.upper(): str(value) for name, value in kwargs.items()}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``1`` (or True) for ``y``, ``yes``, ``t``, ``true``, ``on``, ``1``; ``0`` (or False) for their opposites.

    Raises:
        ValueError: Any other string.
    """
    lowered = value.strip().lower()
    if lowered not in _TRUE + _FALSE:
        raise ValueError(f"invalid truth value {value!r}; use one of {', '.join(_TRUE + _FALSE)}.")
    truth = lowered in _TRUE
    return truth if to_bool else int(truth)


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    """Whether the environment variable ``key`` says yes (see :func:`str_to_bool`); ``default`` when it is unset."""
    return str_to_bool(os.environ.get(key, str(default))) == 1
