"""Argument checks shared by the reference models: a bad size fails in the constructor, in one sentence,
rather than as a shape error at the first forward pass."""

from __future__ import annotations


def check_sizes(**sizes: int) -> None:
    """Raise ValueError for the first size below 1."""
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1.")


def check_dropout(dropout: float) -> None:
    if not 0 <= dropout < 1:
        raise ValueError(f"dropout={dropout} must be at least 0 and below 1.")
