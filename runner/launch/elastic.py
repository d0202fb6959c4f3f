"""Start the training processes: directly, through torch's elastic launcher, or by joining torchrun.

The launching process has settled the run (:class:`~runner.config.run_spec.RunSpec`: its config, folder, resume
and launch shape); every worker receives that value, so every rank and every restart trains in the same folder
with the same settings.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from runner.config.run_spec import RunSpec, resolve_num_processes
from runner.launch import preload
from runner.launch.lost_nodes import NodeWatch
from runner.training import preemption

logger = logging.getLogger("runner")


class WorkerFailed(RuntimeError):
    """A training process failed; the message names the rank and its error, ``traceback`` is the one it recorded."""

    def __init__(self, message: str, traceback: str | None = None) -> None:
        super().__init__(message)
        self.traceback = traceback


def starts_workers(trainer: Any) -> bool:
    """Whether a run with these ``trainer`` settings starts its processes here, through the elastic agent (when
    this process is not one of a launched group already)."""
    num_processes = resolve_num_processes(trainer["num_processes"], cpu=trainer["cpu"])
    return not (num_processes == 1 and trainer["num_nodes"] == 1)


def prepare_workers(cfg: Any) -> None:
    """Before the checks: a run that will start workers here starts the process they are forked from, which
    imports torch meanwhile (see :mod:`runner.launch.preload`)."""
    if starts_workers(cfg.trainer):
        preload.start()


def launch(spec: RunSpec) -> float | None:
    """Run the training ``spec`` describes and return rank 0's objective: in this process when it is one worker of a
    launched group (torchrun, srun) or the run's only process; otherwise its processes are started here."""
    from runner.launch.worker import run_worker

    if not spec.launch.starts_workers:
        return run_worker(spec, environment=spec.launch.environment)
    return _elastic_launch(spec)


def _elastic_launch(spec: RunSpec):
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from runner.engine.launchers import elastic_run
    from runner.launch.failures import describe_failure, recorded_traceback, root_cause
    from runner.launch.worker import run_worker_process

    trainer = spec.config_dict()["trainer"]
    num_processes, num_nodes = spec.launch.num_processes, spec.launch.num_nodes
    logger.info(
        "Starting %d processes on this node (%d node(s)) with torch's elastic launcher", num_processes, num_nodes
    )
    _TRANSLATED.clear()
    if (name := preemption.received()) is not None:  # recorded during the checks (runner eval watches from its start)
        raise preemption.Preempted(name, step=-1)
    # torch's agent stops the workers gracefully on SIGTERM (they save and exit); SIGUSR1 and SIGUSR2 (submitit's)
    # mean the same, and submitit's own handler is kept for the requeue (preemption.take_over). Until its
    # processes start, a signal stops the launch the way the agent's own handler does, as a SignalException.
    to_term = [number for number in preemption.SIGNALS if number != signal.SIGTERM]
    previous = {number: preemption.take_over(number, _as_sigterm) for number in to_term}
    previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _stop_launch)
    # Forked from the server started before the checks; a sweep's first job starts it here, and its later jobs
    # fork from it too. elastic_run hands each worker the environment of this launch.
    preload.start()
    watch = NodeWatch(trainer, str(spec.project_dir)) if num_nodes > 1 else None
    try:
        with watch or contextlib.nullcontext(), _quiet_failure_logs():
            try:
                results = elastic_run(
                    run_worker_process,
                    (spec,),
                    start_method="forkserver",
                    num_processes=num_processes,
                    # Port 0 lets the rendezvous pick a free port, so concurrent runs and sweep jobs never clash.
                    rdzv_endpoint=trainer["rdzv_endpoint"] or "127.0.0.1:0",
                    num_nodes=num_nodes,
                    run_id=None if num_nodes == 1 else _multinode_run_id(trainer, spec.project_dir),
                    max_restarts=trainer["max_restarts"],
                    monitor_interval=0.1,
                    rdzv_timeout=trainer["rdzv_timeout"],
                    **(_node_options(trainer, watch) if watch is not None else {}),
                )
            except RendezvousError as error:  # several nodes: after a failure, the others did not come back
                if watch is None:
                    raise
                if not watch.workers_started:
                    raise WorkerFailed(watch.never_met(num_nodes)) from None
                raise WorkerFailed(watch.sentence(_rendezvous_failure(error, trainer))) from None
            except ChildFailedError as error:
                rank, detail = root_cause(error.failures)
                if watch is not None and _LOST_CONNECTION.search(detail):
                    raise WorkerFailed(watch.sentence(f"rank {rank}'s collective failed ({detail})")) from None
                raise
    except SignalException as error:  # this process got the signal; the workers have stopped and saved
        raise preemption.Preempted(_signal_name(error.sigval), step=-1) from None
    except ChildFailedError as error:
        if all(failure.exitcode == preemption.EXIT_CODE for failure in error.failures.values()):
            name = _TRANSLATED[0] if _TRANSLATED else "a stop signal to the workers"
            raise preemption.Preempted(name, step=-1) from None
        rank, _ = root_cause(error.failures)
        raise WorkerFailed(describe_failure(error.failures), recorded_traceback(error.failures, rank)) from None
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    return results.get(0)


# torch's loggers that print a failed worker's traceback (the first to fail, often a peer that failed on the broken
# connection) and the teardown of the others, line by line: the run says which rank caused it and prints that rank's
# traceback itself (runner.cli.app), and keeps it in run.log.
_FAILURE_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


@contextlib.contextmanager
def _quiet_failure_logs():
    loggers = [logging.getLogger(name) for name in _FAILURE_LOGGERS]
    levels = [each.level for each in loggers]
    for each in loggers:
        each.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for each, level in zip(loggers, levels, strict=True):
            each.setLevel(level)


# A rank's error that says another node stopped answering: a collective's timeout, a connection the peer or the
# network cut.
_LOST_CONNECTION = re.compile(
    r"[Tt]imed out|[Tt]imeout|Connection (closed|reset) by peer|No route to host|Network is unreachable"
)


def _rendezvous_failure(error: Exception, trainer: dict[str, Any]) -> str:
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    if isinstance(error, RendezvousTimeoutError):
        return "after a worker failed, the other nodes did not join the rendezvous again in time"
    cause = error.__cause__ or error
    detail = f"{type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
    return f"the rendezvous at trainer.rdzv_endpoint={trainer['rdzv_endpoint']} failed ({detail})"


_TRANSLATED: list[str] = []  # the stop signals this launching process turned into SIGTERM for torch's agent


def _as_sigterm(number: int, frame) -> None:
    _TRANSLATED.append(signal.Signals(number).name)
    os.kill(os.getpid(), signal.SIGTERM)


def _signal_name(sigval: int) -> str:
    """The signal that stopped the launch: the one this process was sent, though the agent saw SIGTERM."""
    return _TRANSLATED[0] if _TRANSLATED else signal.Signals(sigval).name


def _stop_launch(number: int, frame) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sigval = signal.Signals(number)
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)


def _node_options(trainer: dict[str, Any], watch: NodeWatch) -> dict[str, Any]:
    """How this node takes part in a rendezvous of several, beyond torch's defaults:

    - Node 0 hosts the rendezvous store (it runs on the endpoint's host: the runner's rule). torch would decide from
      the hostname, and where that resolves to loopback (as many /etc/hosts have it) node 0 would wait as a client
      of a store nobody hosts.
    - Each round of the rendezvous gives the workers a fresh store, hosted by the round's rank 0
      (TORCH_DISABLE_SHARE_RDZV_TCP_STORE). The agents' shared store keeps an earlier round's keys, and after one
      node's workers restarted the nodes cannot agree on a prefix for them: their restart counts differ.
    - The agent's own store calls wait at most ``rdzv_timeout`` seconds (torch: 60), so a node cut off from node 0
      ends no later than the others wait for it.
    - The workers report to this launcher's :class:`NodeWatch` (runner.launch.lost_nodes).
    - Where this machine's hostname resolves to loopback, or not at all, the other nodes reach it at the address
      its route to the endpoint leaves from (torch would hand them the hostname), and gloo binds the interface that
      holds that address (GLOO_SOCKET_IFNAME, unless given; gloo would bind the hostname's loopback address).
    """
    host, _, port = trainer["rdzv_endpoint"].rpartition(":")
    options: dict[str, Any] = {
        "rdzv_configs": {"is_host": trainer["node_rank"] == 0, "read_timeout": min(60, trainer["rdzv_timeout"])},
        "environment": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **watch.environment},
    }
    if not _hostname_reachable():
        options["local_addr"] = _route_address(host.strip("[]"), int(port))
        interface = _interface_of(options["local_addr"])
        if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            options["environment"]["GLOO_SOCKET_IFNAME"] = interface
    return options


def _hostname_reachable() -> bool:
    """Whether this machine's hostname resolves to an address other machines can reach (not only loopback)."""
    try:
        found = socket.getaddrinfo(socket.getfqdn(), None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return any(not ipaddress.ip_address(info[4][0].partition("%")[0]).is_loopback for info in found)


def _route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host``: connecting a datagram socket sends nothing, it only picks
    the route and the address it leaves from."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)
        return probe.getsockname()[0]


def _interface_of(address: str) -> str | None:
    """The network interface whose IPv4 address is ``address``, on Linux (None elsewhere, or if none is)."""
    if not sys.platform.startswith("linux"):
        return None
    import fcntl
    import struct

    siocgifaddr = 0x8915  # linux/sockios.h: an interface's address, into struct ifreq
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def _multinode_run_id(trainer: dict[str, Any], project_dir: Path) -> str:
    # Every node must present the same run id to the rendezvous: derive it from what every node was
    # given alike, the rendezvous address and the shared run folder (required by the runner's checks).
    key = f"{trainer['rdzv_endpoint']}|{project_dir}"
    return "runner-" + uuid.uuid5(uuid.NAMESPACE_URL, key).hex[:12]
