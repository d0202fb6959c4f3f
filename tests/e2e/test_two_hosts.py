"""One run on two hosts (tests/two_hosts.py: two network namespaces joined by a veth pair): node 0 on 10.213.0.1
hosts the rendezvous, node 1 on 10.213.0.2 joins it, and both write one run folder (the filesystem is shared: the
shared folder a multi-node run needs). Three runs, each proving several promises:

- DDP on hosts whose hostname resolves to loopback (as /etc/hosts on many machines has it), with nothing set: a link
  down for 3 s only delays the run, which ends exactly as two processes on one host do;
- FSDP on hosts with hostnames of their own (as a cluster's DNS has them): a worker killed on host 1 restarts the
  workers of both hosts, and the run ends exactly as two processes on one host do;
- a link down for good: both hosts end within about twice trainer.rdzv_timeout, each in one sentence naming the
  host it lost, the newest intact checkpoint and how to continue.

Each node is ``python -m runner`` forked from the tests' preloaded interpreter (tests/preloaded.py) into its host's
network namespace, with that host's /etc/hosts and, where the test says so, its hostname: what ``ip netns exec``
and ``unshare --uts`` would make of a fresh interpreter, without its seconds of imports. Both nodes start together
(node 1 waits for node 0's rendezvous, trainer.rdzv_timeout).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runner.cli.checkpoints import describe
from runner.launch.lost_nodes import MARGIN_S
from tests.e2e.conftest import metrics, mnist_args, run_cli
from tests.preloaded import Host, start_module
from tests.two_hosts import TwoHosts, Unavailable

ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
# 30 steps, a checkpoint every 10: the faults below strike after step 20, with two checkpoints saved.
RUN = [*mnist_args("test[:1000]", "test[9800:]"), "trainer.max_steps=30", "trainer.checkpoint_every_n_steps=10"]
_PORTS = itertools.count(29500)  # a port per run: node 0 refuses an endpoint whose port is still taken


@pytest.fixture(scope="module")
def hosts():
    try:
        made = TwoHosts(names=True).create()
    except Unavailable as error:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the two hosts were not made: {error}")
        pytest.skip(f"no two hosts here: {error}")
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(parallel)``: RUN as two processes on this host (made once per strategy, when first asked for;
    max_restarts and rdzv_timeout, which the runs on two hosts add, change nothing the run computes)."""
    made: dict[str, Path] = {}

    def run(parallel: str) -> Path:
        if parallel not in made:
            folder = tmp_path_factory.mktemp(f"one_host_{parallel}")
            done = run_cli(f"parallel={parallel}", "trainer.num_processes=2", *RUN, f"hydra.run.dir={folder / 'run'}",
                           cwd=folder, env={"OMP_NUM_THREADS": "1"})  # fmt: skip
            assert done.returncode == 0, done.stderr[-3000:]
            made[parallel] = folder / "run"
        return made[parallel]

    return run


@pytest.fixture
def launch(hosts, tmp_path):
    """``launch(args, ...)`` starts both nodes; whatever is left of them is killed afterwards, the link is up."""
    started: list[TwoNodes] = []

    def start(args: list[str], **options) -> TwoNodes:
        started.append(TwoNodes(hosts, tmp_path / f"job{len(started)}", args, **options))
        return started[-1]

    yield start
    for nodes in started:
        nodes.kill()
    hosts.link_up()


class TwoNodes:
    """Node 0 on host 0 and node 1 on host 1, started at once (node 1 waits for node 0's rendezvous), each in a
    session of its own: its launcher, forkserver, workers and their helpers are one process group."""

    def __init__(self, hosts: TwoHosts, folder: Path, args: list[str], *, own_hostnames: bool = True) -> None:
        folder.mkdir(parents=True)
        self.hosts, self.folder, self.project = hosts, folder, folder / "project"
        self.endpoint = f"{hosts.addresses[0]}:{next(_PORTS)}"
        self.processes = []
        for rank in (0, 1):
            command = [*args, "trainer.num_nodes=2", f"trainer.node_rank={rank}",
                       "trainer.num_processes=1", f"trainer.rdzv_endpoint={self.endpoint}",
                       f"project.project_dir={self.project}", f"hydra.run.dir={folder / f'node{rank}'}"]  # fmt: skip
            host = Host(hosts.namespaces[rank], hosts.hostnames[rank] if own_hostnames else None)
            self.processes.append(start_module("runner", *command, cwd=folder, env={**os.environ, **ENV}, host=host))
        self.started = time.monotonic()

    def wait_for_step(self, step: int, timeout: float = 90) -> None:
        """Until rank 0 logged its training metrics at ``step`` (both nodes running)."""
        log, deadline = self.project / "run.log", time.monotonic() + timeout
        while not re.search(rf"step {step}/\d+ \| train/loss", log.read_text() if log.exists() else ""):
            assert all(p.poll() is None for p in self.processes), f"a node ended before step {step}: {self.tails()}"
            assert time.monotonic() < deadline, f"step {step} not reached within {timeout:g} s: {self.tails()}"
            time.sleep(0.05)

    def finish(self, timeout: float) -> list[int | None]:
        """Both exit codes, once both nodes ended or ``timeout`` seconds passed (then None for a node that hangs, and
        every process of both nodes is killed)."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in self.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = [p.poll() for p in self.processes]
        self.kill()
        return codes

    def kill(self) -> None:
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)  # its session: nothing of the node is left behind
            except ProcessLookupError:
                pass
            process.wait()

    def workers(self, rank: int) -> list[int]:
        """Node ``rank``'s training processes: the children of its launcher's forkserver (as in test_faults)."""

        def children(pid: int) -> list[int]:
            found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True)
            return sorted(map(int, found.stdout.split()))

        return [worker for server in children(self.processes[rank].pid) for worker in children(server)]

    def last_line(self, rank: int) -> str:
        lines = self.processes[rank].stderr_path.read_text().strip().splitlines()
        return lines[-1] if lines else ""

    def tails(self) -> str:
        return " | ".join(
            f"node {rank}: " + " / ".join(self.processes[rank].stderr_path.read_text().strip().splitlines()[-3:])
            for rank in (0, 1)
        )

    def listening(self) -> bool:
        """Whether something on host 0 listens on the endpoint's port (node 0's rendezvous store): read in node 0's
        namespace, through its launcher's /proc view of the network."""
        port = f":{int(self.endpoint.rpartition(':')[2]):04X}"
        for table in ("tcp", "tcp6"):
            try:
                rows = Path(f"/proc/{self.processes[0].pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                return False
            if any(row.split()[1].endswith(port) and row.split()[3] == "0A" for row in rows):  # 0A: LISTEN
                return True
        return False


def _assert_same_run(got: Path, expected: Path) -> None:
    assert metrics(got) == metrics(expected)
    want, have = load_file(expected / "model" / "model.safetensors"), load_file(got / "model" / "model.safetensors")
    assert want.keys() == have.keys() and all(torch.equal(want[name], have[name]) for name in want)


def _assert_intact(project: Path) -> list[dict]:
    records = describe(project)
    assert all(record["status"] == "intact" for record in records), records  # half-written ones do not count
    return records


def test_ddp_on_two_hosts_rides_out_a_link_down_for_seconds_and_ends_as_on_one_host(launch, reference, hosts):
    # The hostname resolves to 127.0.0.1 on both hosts (as /etc/hosts on many machines has it) and nothing is set:
    # node 0 hosts the rendezvous all the same, each node is reached at its address on the route to the endpoint,
    # and gloo binds that address's interface.
    nodes = launch(["parallel=ddp", *RUN, "trainer.max_restarts=1", "trainer.rdzv_timeout=30"], own_hostnames=False)
    nodes.wait_for_step(20)
    assert nodes.listening(), f"node 0 does not host the rendezvous at {nodes.endpoint}"
    hosts.link_down()
    time.sleep(3)
    hosts.link_up()
    # TCP retransmits what the collectives sent meanwhile: gloo never sees the gap, nothing restarts.
    codes = nodes.finish(timeout=60)
    assert codes == [0, 0], nodes.tails()
    assert "Restart" not in (nodes.project / "run.log").read_text()
    manifest = (nodes.project / "checkpoints" / "checkpoint_0" / "manifest.json").read_text()
    assert '"world_size": 2' in manifest and metrics(nodes.project)["step"] == 30
    assert [record["step"] for record in _assert_intact(nodes.project)] == [10, 20, 30]
    _assert_same_run(nodes.project, reference("ddp"))


def test_fsdp_on_two_hosts_restarts_both_after_a_worker_is_killed_and_ends_as_on_one_host(launch, reference):
    timeout = 10
    nodes = launch(["parallel=fsdp", *RUN, "trainer.max_restarts=1", f"trainer.rdzv_timeout={timeout}"])
    nodes.wait_for_step(20)
    workers = nodes.workers(1)
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    killed = time.monotonic()
    # Node 1's agent restarts its workers; node 0's restarts for the membership change without counting it, and its
    # workers resume all the same (they agree on the highest restart count).
    codes = nodes.finish(timeout=timeout + 40)
    assert None not in codes, f"a host still hangs {time.monotonic() - killed:.0f} s after the kill: {nodes.tails()}"
    assert codes == [0, 0], nodes.tails()
    assert "Restart 1: resuming from" in (nodes.project / "run.log").read_text()
    _assert_intact(nodes.project)
    _assert_same_run(nodes.project, reference("fsdp"))


def test_a_link_down_for_good_ends_both_hosts_in_one_sentence_naming_the_lost_host(launch, hosts):
    timeout = 6  # small, for the test's length: a collective waits at most this, then the new rendezvous as long
    nodes = launch(["parallel=ddp", *RUN, "trainer.max_restarts=1", f"trainer.rdzv_timeout={timeout}"])
    nodes.wait_for_step(20)
    hosts.link_down()
    down = time.monotonic()
    # Node 0 gives up the new round of the rendezvous after the timeout; node 1, blocked in a call to node 0's
    # store, is ended by its launcher's watch (runner.launch.lost_nodes) after the timeout and its margin.
    codes = nodes.finish(timeout=2 * timeout + MARGIN_S + 10)
    assert None not in codes, f"a host still hangs {time.monotonic() - down:.0f} s after the link went down"
    records = _assert_intact(nodes.project)
    newest = records[-1]["name"]
    for rank, other in ((0, 1), (1, 0)):
        assert codes[rank] == 1, nodes.tails()
        line = nodes.last_line(rank)
        assert line.startswith(f"runner: error: node {rank} ({hosts.hostnames[rank]}) lost node {other} "), line
        assert hosts.hostnames[other] in line, line
        assert f"{newest} is the run's newest intact checkpoint" in line, line
        assert f"resume={nodes.project} trainer.node_rank=N" in line, line
