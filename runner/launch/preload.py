"""The forkserver of a multi-process run, started before the launching process's checks import torch.

A run that starts its workers here forks them from Python's forkserver (:mod:`runner.engine.forkserver` says
how, and how each worker takes the launch's environment). :func:`start` starts that server as soon as the config
is known to start workers, with torch, ``torch._dynamo`` (which the first ``torch.optim`` optimizer imports),
torchmetrics and the runner's worker preloaded in it, so that it imports them while the launching process checks
the targets and constructors, which imports them too. This module imports nothing heavy itself: the server must
start before torch is imported here.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing import forkserver

# runner.engine.forkserver first: its environment snapshot is the server's (see there).
PRELOAD = ("runner.engine.forkserver", "torch", "torch._dynamo", "torchmetrics", "runner.engine.accelerator",
           "runner.launch.worker", "runner.training.loop")  # fmt: skip
SERVER_ENV = "RUNNER_FORKSERVER"  # runner.engine.forkserver.SERVER_ENV, which this module cannot import (torch)


def start(extra: tuple[str, ...] = ()) -> None:
    """Start the forkserver with :data:`PRELOAD` (and ``extra``) imported in it, unless it runs already (it imports in
    the background; ``runner.engine.forkserver.start`` does the same, but importing it here would import torch
    first)."""
    multiprocessing.set_forkserver_preload([*PRELOAD, *extra])  # the server skips any that does not import
    os.environ[SERVER_ENV] = "1"  # marks the server as runner.engine.forkserver.start does
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[SERVER_ENV]
