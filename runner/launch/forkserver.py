"""Workers forked from a process that has already imported torch, so that a multi-process run starts them at once.

Each worker of a multi-process run would otherwise import torch, ``torch._dynamo`` (which the first
``torch.optim`` optimizer imports) and torchmetrics itself: seconds per worker, after the launching
process has spent as long importing them for its checks. :func:`start` starts Python's forkserver
(:mod:`multiprocessing.forkserver`) with those modules preloaded as soon as the config is known to
start workers here, so that it imports them while the launching process checks the targets and
constructors; torch's elastic agent then forks every worker, and every restarted one, from it
(``start_method="forkserver"``). The server is a fresh interpreter, never a fork of the launching
process: nothing it holds (CUDA, threads, open files) is shared with the workers.

A forked worker inherits the server's environment, that of the moment it started. :func:`entry`
hands each worker the launching process's environment at launch instead, with what the agent set
for the worker's rank on top (see :func:`_run_in_launch_environment`), as a spawned worker has it.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
from collections.abc import Callable, Mapping
from multiprocessing import forkserver
from typing import Any

PRELOAD = ("torch", "torch._dynamo", "torchmetrics", "runner.launch.worker", "runner.training")
_server_environment: dict[str, str] | None = None  # this process's environment when it started the server


def start() -> None:
    """Start the forkserver with :data:`PRELOAD` imported in it (once per process; it imports in the background)."""
    global _server_environment
    if _server_environment is not None:
        return
    multiprocessing.set_forkserver_preload(list(PRELOAD))  # the server skips any that does not import
    _server_environment = dict(os.environ)
    forkserver.ensure_running()


def started() -> bool:
    """Whether :func:`start` started the server in this process."""
    return _server_environment is not None


def entry(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as the agent's workers run it from the server: in this process's environment of now."""
    if _server_environment is None:
        raise RuntimeError("forkserver.entry() needs forkserver.start() first.")
    run = functools.partial(_run_in_launch_environment, function, dict(os.environ), _server_environment)
    return functools.update_wrapper(run, function)  # the agent names the job after the function


def _run_in_launch_environment(
    function: Callable[..., Any], launched: Mapping[str, str], server: Mapping[str, str], *args: Any
) -> Any:
    """In a forked worker: the environment becomes ``launched`` plus what the elastic agent set for this rank (every
    variable that differs from the server's environment ``server``), then ``function(*args)`` runs."""
    set_for_this_rank = {name: value for name, value in os.environ.items() if server.get(name) != value}
    os.environ.clear()
    os.environ.update({**launched, **set_for_this_rank})
    return function(*args)
