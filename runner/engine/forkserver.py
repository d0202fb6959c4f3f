"""Workers forked from a process that has already imported torch, so that a multi-process launch starts them at once.

A spawned worker is a fresh interpreter that imports torch (and whatever its function needs: ``torch._dynamo``
for the first ``torch.optim`` optimizer, torchmetrics, ...) before it does anything: seconds per worker. Python's
forkserver (:mod:`multiprocessing.forkserver`) is a fresh interpreter too, started once, that imports a list of
modules and then forks every worker from itself. :func:`start` starts it with those modules preloaded; torch's
elastic agent forks the workers from it with ``start_method="forkserver"``. Nothing the launching process holds
(CUDA, threads, open files) is shared with the workers, as with spawn.

multiprocessing hands each forked worker the launching process's working directory and ``sys.path`` of the
moment it starts, but its environment is the server's, that of the moment the server started, and its torch
sized its thread pool then. :func:`entry` wraps the workers' function so that it runs in the launching
process's environment of the launch instead, with what the agent set for the worker's rank on top, and with
that environment's OMP_NUM_THREADS threads, as a spawned worker has them. ``elastic_run(...,
start_method="forkserver")`` does both.
"""

from __future__ import annotations

import atexit
import functools
import gc
import multiprocessing
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from multiprocessing import forkserver
from typing import Any

# Set in the server's environment while start() starts it (runner.launch.preload.start too), and taken out of it
# here: the server, which imports this module first, ends without collecting garbage over the modules it preloaded
# (a second of CPU once torch is imported; see runner.training.startup.skip_collection_at_exit).
SERVER_ENV = "RUNNER_FORKSERVER"
if os.environ.pop(SERVER_ENV, None):
    atexit.register(gc.freeze)

# Taken when this module is imported. The server imports it first (see start()); a worker forked from a server
# that did not imports it while it unpickles its function, before torch's agent sets the rank's variables. In a
# worker, either way, this is the environment the server started with.
_ENVIRONMENT_AT_IMPORT = dict(os.environ)


def start(preload: Iterable[str] = ("torch", "runner.engine.accelerator")) -> None:
    """Start the forkserver with the modules ``preload`` imported in it (by default torch and the engine's
    Accelerator, with what it imports), unless it runs already.

    It returns at once; the server imports them in the background and skips any that fails to import. Once the
    server runs, its modules are fixed: a later call with other modules changes nothing.
    """
    multiprocessing.set_forkserver_preload([__name__, *preload])
    os.environ[SERVER_ENV] = "1"
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[SERVER_ENV]


def entry(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` as a worker forked from the server runs it: in this process's environment of now."""
    run = functools.partial(_run_in_launch_environment, function, dict(os.environ))
    return functools.update_wrapper(run, function)  # torch's agent names the job after the function


def _run_in_launch_environment(function: Callable[..., Any], launched: Mapping[str, str], *args: Any) -> Any:
    """In a forked worker: the environment becomes ``launched`` plus what the elastic agent set for this rank (every
    variable that differs from the server's environment), then ``function(*args)`` runs."""
    set_for_this_rank = {name: value for name, value in os.environ.items() if _ENVIRONMENT_AT_IMPORT.get(name) != value}
    os.environ.clear()
    os.environ.update({**launched, **set_for_this_rank})
    # multiprocessing's start method is the server's (forkserver), which a spawned worker would inherit too; a worker
    # of torchrun's (a fresh process) has the platform's: its DataLoader workers start as in a plain script (fork on
    # Linux), not from this server, which would unpickle the dataset and import its modules in each of them, each pass.
    multiprocessing.set_start_method(None, force=True)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdecimal() and int(threads) > 0 and "torch" in sys.modules:
        # The server's torch sized its thread pool from the server's environment when it was imported; a
        # spawned worker's reads OMP_NUM_THREADS at its start.
        sys.modules["torch"].set_num_threads(int(threads))
    return function(*args)
