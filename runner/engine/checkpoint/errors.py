"""The checkpoint room's errors, in a module that imports nothing: the command line catches them without torch."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: incomplete, damaged, or of other objects. One sentence."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint folder does not exist."""
