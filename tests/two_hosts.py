"""Two "hosts" on this machine, for the tests and for contributors: two Linux network namespaces joined by a veth
pair, so that a multi-node run crosses a link that can be pulled.

    python -m tests.two_hosts up            # prints the commands that run something on each host
    ip netns exec rnr0a python -m runner ... trainer.rdzv_endpoint=10.213.0.1:29500 ...
    python -m tests.two_hosts down

Host 0 is namespace ``rnr<tag>a`` with ``10.213.0.1/24`` on its veth end ``rnr<tag>a0``; host 1 is ``rnr<tag>b``
with ``10.213.0.2/24`` on ``rnr<tag>b0``. Each namespace has its own ``lo`` (up) and its end of the pair, nothing
else: the subnet exists only inside them, so it never clashes with this machine's networks, and concurrent test
processes (each its own tag, the PID by default) may all use it. Everything else is shared with this machine: the
filesystem (both hosts write one run folder, the shared folder a multi-node run needs), the processes, the users.

The hostname is shared too, and it resolves to 127.0.0.1 on both hosts, as on a machine whose ``/etc/hosts`` maps
its own name to loopback (Debian's 127.0.1.1 alike). The runner needs no setting for that (runner.launch.elastic:
node 0 hosts the rendezvous, each node is handed to the others by its address on the route to the endpoint, gloo
binds that address's interface); torchrun or a plain torch.distributed script need :meth:`TwoHosts.environment`'s
``GLOO_SOCKET_IFNAME`` (``TP_SOCKET_IFNAME`` is tensorpipe's, for torch.distributed.rpc), and torch's c10d
rendezvous, which decides from the hostname whether this machine hosts its store, does not host it on node 0.
``names=True`` gives each host a hostname of its own instead (``host0-<tag>``, ``host1-<tag>``, which a process
takes in a UTS namespace of its own: ``unshare --uts``) that resolves on both hosts to its veth address
(``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over ``/etc/hosts``): two machines as a cluster's
DNS describes them. The tests run their commands on a host as tests/preloaded.py's ``Host`` does the same to a
process forked from an interpreter that has imported torch already.

``link_down()`` sets both ends of the pair down (the kernel drops the subnet's route: packets are dropped, a
connection attempt fails with "Network is unreachable"), ``link_up()`` brings them back with their addresses.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

SUBNET = "10.213.0"  # a /24 of 10/8 that no common default (Docker, libvirt, Kubernetes, VPNs) takes


class Unavailable(RuntimeError):
    """The two hosts cannot be made on this machine; the message says why."""


class TwoHosts:
    """Two network namespaces joined by a veth pair: ``TwoHosts().create()``, or ``with TwoHosts() as hosts:``."""

    def __init__(self, tag: str | int | None = None, *, subnet: str = SUBNET, names: bool = False) -> None:
        tag = str(os.getpid() % 10000 if tag is None else tag)
        self.namespaces = (f"rnr{tag}a", f"rnr{tag}b")
        self.interfaces = (f"rnr{tag}a0", f"rnr{tag}b0")  # at most 15 characters: a tag of at most 9
        self.addresses = (f"{subnet}.1", f"{subnet}.2")
        self.hostnames = (f"host0-{tag}", f"host1-{tag}") if names else None
        if len(self.interfaces[0]) > 15:
            raise ValueError(f"tag {tag!r} is too long: interface names are at most 15 characters")

    def environment(self, host: int) -> dict[str, str]:
        """What a process on ``host`` needs for torch's gloo and tensorpipe to talk over the veth pair, not
        loopback. Harmless with ``names=True``, where the hostname resolves to the veth address already."""
        return {"GLOO_SOCKET_IFNAME": self.interfaces[host], "TP_SOCKET_IFNAME": self.interfaces[host]}

    def create(self) -> TwoHosts:
        """Make both namespaces, the veth pair between them, their addresses; bring every interface up.

        Raises:
            Unavailable: Not root, no ``ip``, a namespace of the same name exists, or the kernel refused.
        """
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root (ip netns add)")
        if shutil.which("ip") is None:
            raise Unavailable("iproute2's ip is not installed (apt-get install iproute2)")
        existing = self._existing()
        if taken := [name for name in self.namespaces if name in existing]:
            raise Unavailable(
                f"network namespace {taken[0]} exists already (another test process, or one that died: "
                f"ip netns del {taken[0]})"
            )
        try:
            for namespace in self.namespaces:
                _ip("netns", "add", namespace)
            _ip("link", "add", self.interfaces[0], "netns", self.namespaces[0],
                "type", "veth", "peer", "name", self.interfaces[1], "netns", self.namespaces[1])  # fmt: skip
            for namespace, interface, address in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", interface)
                _ip("-n", namespace, "link", "set", "lo", "up")
                _ip("-n", namespace, "link", "set", interface, "up")
            if self.hostnames is not None:
                self._write_hosts_files()
        except Unavailable:
            self.remove()
            raise
        return self

    def link_down(self) -> None:
        """Pull the cable: both ends of the pair down."""
        for namespace, interface in zip(self.namespaces, self.interfaces, strict=True):
            _ip("-n", namespace, "link", "set", interface, "down")

    def link_up(self) -> None:
        """Plug it back: both ends up (their addresses and the subnet's route come back with them)."""
        for namespace, interface in zip(self.namespaces, self.interfaces, strict=True):
            _ip("-n", namespace, "link", "set", interface, "up")

    def remove(self) -> None:
        """Delete both namespaces (each takes its end of the pair with it) and the hosts files; quiet about what
        is gone already. Processes still running in a namespace keep it alive, unnamed, until they end."""
        existing = self._existing()
        for namespace in self.namespaces:
            if namespace in existing:
                subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only if no other namespace keeps files there

    def __enter__(self) -> TwoHosts:
        return self.create()

    def __exit__(self, *exc_info) -> None:
        self.remove()

    def _existing(self) -> set[str]:
        done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
        return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}

    def _write_hosts_files(self) -> None:
        lines = "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.hostnames, strict=True))
        try:
            hosts = Path("/etc/hosts").read_text()
        except OSError:
            hosts = "127.0.0.1 localhost\n"
        for namespace in self.namespaces:
            folder = Path("/etc/netns") / namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts + lines)


def _ip(*arguments: str) -> None:
    done = subprocess.run(["ip", *arguments], capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"ip {' '.join(arguments)} failed: {(done.stderr or done.stdout).strip()[-300:]}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] not in ("up", "down"):
        sys.exit("usage: python -m tests.two_hosts up|down [TAG]   (TAG: 0 unless given)")
    hosts = TwoHosts(sys.argv[2] if len(sys.argv) == 3 else 0)
    if sys.argv[1] == "down":
        hosts.remove()
        sys.exit(0)
    try:
        hosts.create()
    except Unavailable as error:
        sys.exit(f"the two hosts were not made: {error}")
    for host in (0, 1):
        settings = " ".join(f"{k}={v}" for k, v in hosts.environment(host).items())
        print(f"host {host} ({hosts.addresses[host]}): ip netns exec {hosts.namespaces[host]} env {settings} COMMAND")
    print(f"pull the cable: ip -n {hosts.namespaces[0]} link set {hosts.interfaces[0]} down  (up to plug it back)")
