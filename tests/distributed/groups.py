"""Worker groups that stay up: one launch of torch's elastic launcher runs the functions of many tests.

Each launch costs its agent, rendezvous, forked workers, gloo's connections and their teardown, seconds on a
busy 2-core machine, more than most checks of tests/distributed take to run. So, as Accelerate's test script
runs many checks in one launched script and PyTorch's ``MultiProcContinuousTest`` reuses one group per class,
a :class:`WorkerGroup` launches its workers once (``debug_launcher``, as :func:`launch_workers` does: real gloo
groups on the CPU) and then runs one function after another on every rank, each test still asserting on its
own results. Between two functions every worker puts back what a fresh worker starts with: its environment and
folder, the random generators of torch, Python and NumPy, its thread count, torch's default dtype and
determinism, its signal handlers, logging handlers and warning filters, ``sys.path``, and every attribute of the
runner's modules (a function may replace one to fail a save on one rank) with the stop signals
:mod:`runner.training.preemption` recorded. What it keeps is the process group (every ``Accelerator()`` joins the
one the first created) and the modules it imported.

A group runs functions only for callers with the environment it was launched with: a test that sets a variable
a worker reads at start (TORCH_DISTRIBUTED_DEBUG, say) gets a new group. A function that raises on a rank, or
that destroys the process group, ends the group, and the next call launches another.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import multiprocessing
import os
import pkgutil
import random
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

# How long the other ranks get to answer once one rank has failed (they may be waiting for it in a collective).
FAILURE_GRACE_SECONDS = 20.0
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


class WorkerFailed(AssertionError):
    """A function raised on a rank of a shared group (or a rank died); the message holds each failure."""


class WorkerGroup:
    """``nproc`` workers of one ``debug_launcher`` launch that run one function after another on every rank."""

    def __init__(self, nproc: int) -> None:
        from runner.engine import forkserver

        self.nproc = nproc
        self.environment = _launch_environment()
        self.alive = True
        forkserver.start()
        # The agent is a process of its own, forked from the forkserver in this process's environment, so that
        # the launch (its variables, torch's agent and its signal handlers) never touches this test process.
        context = multiprocessing.get_context("forkserver")
        pipes = [context.Pipe() for _ in range(nproc)]
        self._agent = context.Process(target=forkserver.entry(_agent), args=([end for _, end in pipes],))
        self._agent.start()
        for _, end in pipes:
            end.close()
        self._ranks: list[Connection] = [end for end, _ in pipes]
        for connection in self._ranks:
            if not wait([connection, self._agent.sentinel], timeout=120) or not connection.poll():
                self.close()
                raise WorkerFailed("the shared worker group did not start (its launch's output is above)")
        self._pids = [connection.recv() for connection in self._ranks]

    def fits(self, nproc: int) -> bool:
        """Whether a call with ``nproc`` workers from this process as it is now can run on this group."""
        return self.alive and nproc == self.nproc and _launch_environment() == self.environment

    def run(self, function: Callable[..., Any], args: tuple) -> list[Any]:
        """``function(*args)`` on every rank, in the caller's folder; the results by rank."""
        for connection in self._ranks:
            connection.send((function, args, os.getcwd()))
        replies: dict[int, tuple[bool, Any, bool]] = {}  # rank -> (returned, its value or traceback, group gone)
        pending = dict(enumerate(self._ranks))
        deadline = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait([*pending.values(), self._agent.sentinel], timeout=timeout)
            if not ready:
                break  # the ranks still running are stuck waiting for a failed one
            for rank in [rank for rank, connection in pending.items() if connection in ready]:
                try:
                    replies[rank] = pending.pop(rank).recv()
                except (EOFError, OSError):
                    replies[rank] = (False, "died (its output is above)", True)
            if self._agent.sentinel in ready and not any(connection.poll() for connection in pending.values()):
                replies.update({rank: (False, "its launch ended (its output is above)", True) for rank in pending})
                pending.clear()
            if deadline is None and any(not ok for ok, _, _ in replies.values()):
                deadline = time.monotonic() + FAILURE_GRACE_SECONDS
        failures = {rank: text for rank, (ok, text, _) in replies.items() if not ok}
        failures.update({rank: "still running after another rank had failed" for rank in pending})
        if failures or any(gone for _, _, gone in replies.values()):
            self.close(stuck=bool(pending))
        if failures:
            raise WorkerFailed(
                f"{function.__qualname__} failed on a shared worker group:\n"
                + "\n".join(f"[rank {rank}] {text}" for rank, text in sorted(failures.items()))
            )
        return [replies[rank][1] for rank in range(self.nproc)]

    def close(self, *, stuck: bool = False) -> None:
        """Stop the workers (they leave their loop and the launch ends), then the agent; kill what does not stop,
        at once when a rank is known to be ``stuck`` (waiting for a failed one in a collective, say)."""
        if not self.alive:
            return
        self.alive = False
        for connection in self._ranks:
            with contextlib.suppress(OSError):
                connection.send(None)
            connection.close()
        self._agent.join(timeout=0 if stuck else 5)
        if self._agent.is_alive():
            for pid in getattr(self, "_pids", []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self._agent.kill()
            self._agent.join()
        deadline = time.monotonic() + 10
        while any(map(running, getattr(self, "_pids", []))) and time.monotonic() < deadline:
            time.sleep(0.05)  # the workers are the agent's children, not ours: nothing here can wait for them


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has; what reaps it is up to the machine)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _launch_environment() -> dict[str, str]:
    """This process's environment, but for what pytest changes from test to test and no worker reads."""
    return {name: value for name, value in os.environ.items() if name != "PYTEST_CURRENT_TEST"}


# In the agent and the workers.


def _agent(connections: list[Connection]) -> None:
    from runner.engine.launchers import debug_launcher

    debug_launcher(_serve, (connections,), num_processes=len(connections), start_method="fork")


def _serve(connections: list[Connection]) -> None:
    """A worker: run each function sent to its rank, from a fresh worker's state, until told to stop."""
    import torch.distributed as dist

    connection = connections[int(os.environ["RANK"])]
    connection.send(os.getpid())
    fresh = _FreshState()
    while (task := connection.recv()) is not None:
        function, args, folder = task
        fresh.restore(folder)
        had_group = dist.is_initialized()
        try:
            returned, value = True, function(*args)
        except BaseException:  # noqa: BLE001 - the test process reports it, with the traceback
            returned, value = False, traceback.format_exc()
        gc.collect()
        gone = not returned or (had_group and not dist.is_initialized())  # a group destroyed is not set up again
        connection.send((returned, value, gone))
        if gone:
            break
    connection.close()


class _FreshState:
    """What a worker starts with, taken before its first function and put back before every other one."""

    def __init__(self) -> None:
        import torch

        self.environment = dict(os.environ)
        self.path = list(sys.path)
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.deterministic = (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())  # fmt: skip
        self.handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}
        self.loggers = {name: (list(logger.handlers), logger.level, logger.propagate)
                        for name, logger in [("", logging.getLogger()), *logging.root.manager.loggerDict.items()]
                        if isinstance(logger, logging.Logger)}  # fmt: skip
        self.warning_filters = list(warnings.filters)
        self.modules = {name: dict(vars(module)) for name, module in _runner_modules()}

    def restore(self, folder: str) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.environment)
        os.chdir(folder)
        sys.path[:] = self.path
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy_rng is not None:
            numpy.random.set_state(self.numpy_rng)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        for name, logger in [("", logging.getLogger()), *logging.root.manager.loggerDict.items()]:
            if name not in self.loggers:  # made by a module first imported later: as that import left it
                continue
            handlers, level, propagate = self.loggers[name]
            logger.handlers[:] = handlers
            logger.setLevel(level)
            logger.propagate = propagate
        warnings.filters[:] = self.warning_filters
        warnings._filters_mutated()
        for name, attributes in self.modules.items():  # what a function replaced (a writer that fails, say)
            module = sys.modules[name]
            namespace = vars(module)
            for attribute, value in attributes.items():
                if namespace.get(attribute, _MISSING) is not value:
                    setattr(module, attribute, value)
        # The stop signals recorded (none in a fresh worker).
        sys.modules["runner.training.preemption"]._received.clear()


_MISSING = object()


def _runner_modules() -> list[tuple[str, Any]]:
    """Every module of the runner, imported (once, in well under a second), so that each is seen before any
    function has replaced something in it."""
    import runner

    for found in pkgutil.walk_packages(runner.__path__, "runner."):
        importlib.import_module(found.name)
    return [(name, module) for name, module in list(sys.modules.items()) if name.split(".")[0] == "runner"]
