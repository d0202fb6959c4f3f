"""Checks made before anything is written or launched, of the machine a run is about to use: its folder can be
written, its rendezvous resolves and answers (the constructors its config calls: runner.config.construction)."""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from pathlib import Path

from runner.config import ConfigError


def check_writable(folder: Path, key: str) -> None:
    """Raise :class:`ConfigError` naming ``key`` unless ``folder`` can be created and written."""
    probe = folder / f".write-test-{uuid.uuid4().hex[:8]}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.touch(exist_ok=False)  # created exclusively: never through a link of that name
        probe.unlink()
    except OSError as error:
        raise ConfigError(
            f"{key}={folder} cannot be written ({error.strerror or error}); choose a folder this user can write."
        ) from None


def check_resolves(endpoint: str) -> None:
    """Raise :class:`ConfigError` unless the rendezvous host of ``endpoint`` (HOST:PORT) resolves here.

    Every node checks it before it starts; otherwise torch's rendezvous fails on one node after minutes (c10d's
    "cannot be retrieved (gai error)") while the others wait for it up to ``trainer.rdzv_timeout``.
    """
    host = endpoint.rpartition(":")[0].strip("[]") if ":" in endpoint else endpoint
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        origin = " (the job's first node, from SLURM_JOB_NODELIST)" if "SLURM_JOB_ID" in os.environ else ""
        raise ConfigError(
            f"trainer.rdzv_endpoint={endpoint}: its host {host}{origin} does not resolve on {socket.gethostname()} "
            f"({reason}); make that name resolve on every node (DNS or /etc/hosts), or give "
            "trainer.rdzv_endpoint=ADDRESS:PORT that every node can reach."
        ) from None


def check_rendezvous_port(endpoint: str) -> None:
    """On the node that hosts the rendezvous, raise :class:`ConfigError` if its port is taken.

    Only meaningful on node 0 (the host), before its launcher starts (see :func:`check_port_free`).
    """
    port = endpoint.rpartition(":")[2]
    check_port_free(
        endpoint,
        refusal=ConfigError(
            f"trainer.rdzv_endpoint={endpoint}: port {port} is already in use on this machine (another job, or "
            "a run that has not exited); choose a free port and give every node the same endpoint."
        ),
    )


def check_port_free(endpoint: str, *, refusal: Exception) -> None:
    """Raise ``refusal`` (the caller's wording) if ``endpoint`` (HOST:PORT) is this machine and its port is taken.

    torch's c10d rendezvous would otherwise connect to whatever listens there and wait for it
    forever, or fail with a traceback (EADDRINUSE) when it hosts the store itself. An endpoint
    without a port, or on another machine, is not checked.
    """
    host, _, port = endpoint.rpartition(":")
    if not port.isdigit() or not _is_this_machine(host):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", int(port)))
        except OSError:
            raise refusal from None


def _is_this_machine(host: str) -> bool:
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    names = {socket.gethostname(), socket.getfqdn(), "localhost"}
    if host in names:
        return True
    try:
        return socket.gethostbyname(host) in {socket.gethostbyname(name) for name in names} | {"127.0.0.1"}
    except OSError:
        return False


def wait_for_rendezvous(endpoint: str, *, timeout: float) -> None:
    """On a node other than node 0, wait up to ``timeout`` seconds for the rendezvous host to answer.

    The node that hosts the rendezvous may start later than the others; a node whose endpoint nobody
    ever serves (a wrong address, node 0 not started) would otherwise fail only after torch's own
    timeouts, with a traceback.

    Raises:
        ConfigError: Nothing accepted a connection at ``endpoint`` within ``timeout`` seconds.
    """
    import logging
    import time

    host, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"trainer.rdzv_endpoint={endpoint} must be HOST:PORT, the address every node can reach.")
    deadline = time.monotonic() + timeout
    logging.getLogger("runner").info("Waiting up to %.0f s for the rendezvous at %s", timeout, endpoint)
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout)):
                return
        except OSError:
            if time.monotonic() >= deadline:
                break
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    raise ConfigError(
        f"trainer.rdzv_endpoint={endpoint}: nothing answered there within {timeout:g} s (trainer.rdzv_timeout); "
        "start node 0 (trainer.node_rank=0) with the same endpoint, or fix the address."
    )
