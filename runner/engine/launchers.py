"""Run a function on several processes of this machine: from a notebook, a test, or a debugger.

Both launchers are torch's elastic launcher (the engine behind ``torchrun``) called as a library:
each worker gets RANK, WORLD_SIZE, MASTER_ADDR, ... set, so an ``Accelerator()`` built inside the
function joins the group as it would under ``torchrun``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import torch

from runner.engine import forkserver
from runner.engine.constants import MIXED_PRECISION_ENV, USE_CPU_ENV
from runner.engine.environment import patch_environment


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str | None = None,
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` processes and return their results by rank.

    Workers are forked, so a function defined in the notebook itself works; CUDA must therefore not
    be initialised in the notebook's process before the call (build models inside ``function``).

    Args:
        num_processes: Processes on this machine; by default one per GPU, or 1 without GPUs (which
            runs ``function`` in this process).
        mixed_precision: What ``Accelerator()`` inside ``function`` uses when not told otherwise.
        use_port: The rendezvous port on ``master_addr``; by default a free port when there is one
            node, and 29500 with several.
        node_rank, num_nodes: This machine's place among several, all running the same call.
        rdzv_backend: torch's rendezvous backend: ``"static"`` (the nodes' ranks are ``node_rank``,
            the endpoint is the rank-0 node), ``"c10d"`` (nodes take ranks as they join; an
            endpoint any node can host) or another registered one. By default ``"c10d"`` on one
            node (so port 0 can pick a free port) and ``"static"`` on several.
        rdzv_endpoint: ``host:port`` of the rendezvous; ``master_addr:use_port`` by default.
        rdzv_conf: Extra options of the rendezvous backend (torch's ``rdzv_configs``, such as
            ``{"timeout": 1800}``); for ``"static"`` the node's ``rank`` is added.
        rdzv_id: The job's id, the same on every node (``"notebook"`` with several nodes, else fresh).
        max_restarts: Restart every worker this many times after a failure (elastic).
        monitor_interval: Seconds between the agent's checks of its workers.
        log_line_prefix_template: The prefix of each worker's output lines, in torch's template
            (``"[${role_name}${rank}]: "``, say); torch's own by default.

    Returns:
        ``function``'s return value on each of this machine's processes, in rank order.
    """
    if num_processes is None:
        num_processes = torch.cuda.device_count() or 1
    environment = {MIXED_PRECISION_ENV: str(mixed_precision)}
    if num_processes == 1 and num_nodes == 1:
        with patch_environment(**environment):
            return [function(*args)]
    if torch.cuda.is_initialized():
        raise ValueError(
            "notebook_launcher forks its workers, and CUDA has already been initialised in this process; "
            "restart the kernel and create models and tensors on the GPU only inside the launched function."
        )
    if rdzv_backend is None:
        rdzv_backend = "c10d" if num_nodes == 1 else "static"
    if not rdzv_endpoint:
        port = use_port if use_port is not None else (0 if num_nodes == 1 and rdzv_backend == "c10d" else 29500)
        rdzv_endpoint = f"{master_addr}:{port}"
    results = elastic_run(
        function,
        args,
        num_processes=num_processes,
        rdzv_endpoint=rdzv_endpoint,
        start_method="fork",
        environment=environment,
        num_nodes=num_nodes,
        rdzv_backend=rdzv_backend,
        rdzv_configs=dict(rdzv_conf or {}),
        node_rank=node_rank if rdzv_backend == "static" else None,
        run_id=rdzv_id or ("notebook" if num_nodes > 1 else None),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template,
    )
    return _by_rank(results)


def debug_launcher(
    function: Callable[..., Any], args: tuple = (), num_processes: int = 2, *, start_method: str = "fork"
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU processes (gloo) and return their results by rank.

    For debugging distributed code on any machine: every ``Accelerator()`` inside uses the CPU,
    even where GPUs are visible. ``start_method="spawn"`` and ``"forkserver"`` need ``function``
    importable by module (defined at the top level of a module, not in ``__main__`` of a notebook);
    ``"forkserver"`` forks the workers from a server that imported torch once
    (:mod:`runner.engine.forkserver`), which makes every launch after the first start in a fraction
    of the time spawned interpreters take.
    """
    results = elastic_run(
        function,
        args,
        num_processes=num_processes,
        rdzv_endpoint="127.0.0.1:0",
        start_method=start_method,
        environment={USE_CPU_ENV: "1"},
    )
    return _by_rank(results)


def elastic_run(
    function: Callable[..., Any],
    args: tuple,
    *,
    num_processes: int,
    rdzv_endpoint: str,
    start_method: str = "spawn",
    environment: dict[str, str] | None = None,
    num_nodes: int = 1,
    node_rank: int | None = None,
    rdzv_backend: str | None = None,
    rdzv_configs: dict[str, Any] | None = None,
    run_id: str | None = None,
    max_restarts: int = 0,
    monitor_interval: float = 0.05,
    rdzv_timeout: int = -1,
    log_line_prefix_template: str | None = None,
    local_addr: str | None = None,
) -> dict[int, Any]:
    """Run ``function(*args)`` as this node's share of an elastic job; return the results by global rank.

    Args:
        rdzv_endpoint: ``host:port`` of the rendezvous; port 0 takes a free port (one node only).
        start_method: ``"spawn"``, ``"fork"`` or ``"forkserver"``; with ``"forkserver"`` the workers
            are forked from Python's forkserver (started with torch preloaded unless it runs already)
            and run in this process's environment of the call (see :mod:`runner.engine.forkserver`).
        environment: Variables set for the workers (restored here afterwards). OMP_NUM_THREADS is
            added, like torchrun does, splitting the cores between the workers, unless already set.
        node_rank: This node's rank under a static rendezvous; None uses c10d's dynamic rendezvous,
            where nodes take ranks in the order they join.
        rdzv_backend: The rendezvous backend, when not the one ``node_rank`` implies.
        rdzv_configs: Options of the rendezvous backend (``rank`` is set from ``node_rank``).
        run_id: The job's id, the same on every node; a fresh one by default.
        rdzv_timeout: Seconds to wait for every node to join the rendezvous, and for the others to join again after a
            restart (-1: torch's default, 600 s for c10d).
        local_addr: The address the other nodes reach this one at; None takes this machine's fully qualified
            hostname, as torch does.

    Raises:
        ChildFailedError: When a worker fails (with no restarts left), with each failure's traceback.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    rdzv_configs = dict(rdzv_configs or {})
    if node_rank is not None:
        rdzv_configs["rank"] = node_rank
    if rdzv_timeout != -1:  # LaunchConfig hands it on as "timeout", which only the static backend reads
        rdzv_configs.setdefault("join_timeout", rdzv_timeout)
    rendezvous = {
        "rdzv_backend": rdzv_backend or ("c10d" if node_rank is None else "static"),
        "rdzv_configs": rdzv_configs,
    }
    config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=run_id or f"launch-{uuid.uuid4().hex[:12]}",
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        rdzv_timeout=rdzv_timeout,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(),
        log_line_prefix_template=log_line_prefix_template,
        local_addr=local_addr,
        **rendezvous,
    )
    environment = dict(environment or {})
    if "OMP_NUM_THREADS" not in os.environ:
        environment["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_processes))
    import multiprocessing

    if multiprocessing.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # A joblib worker runs with loky's start method, which the spawned workers would inherit
        # and could not find ("cannot find context for 'loky'").
        multiprocessing.set_start_method(start_method, force=True)
    with patch_environment(**environment):
        if start_method == "forkserver":  # the workers take this environment, not the server's
            forkserver.start()
            function = forkserver.entry(function)
        return elastic_launch(config, function)(*args)


def _by_rank(results: dict[int, Any]) -> list[Any]:
    return [results[rank] for rank in sorted(results)]
