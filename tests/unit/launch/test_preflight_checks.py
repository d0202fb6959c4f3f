"""The machine is checked before a run writes or launches anything: its folder can be written, the rendezvous port
is free on the node that hosts it, and the other nodes wait for that host, each failure in one sentence."""

import contextlib
import os
import re
import socket
import threading
import time

import pytest

from runner.config import ConfigError
from runner.launch.preflight import check_rendezvous_port, check_resolves, check_writable, wait_for_rendezvous


@contextlib.contextmanager
def _listening(port=0):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", port))
        server.listen()
        yield server.getsockname()[1]


def _closed_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_writable_folder_is_created_and_left_empty(tmp_path):
    folder = tmp_path / "outputs" / "run"
    check_writable(folder, "project.project_dir")
    assert folder.is_dir()
    assert list(folder.iterdir()) == []


def test_a_folder_under_a_file_cannot_be_written(tmp_path):
    (tmp_path / "outputs").write_text("a file, not a folder")
    folder = tmp_path / "outputs" / "run"
    with pytest.raises(ConfigError) as error:
        check_writable(folder, "project.project_dir")
    assert str(error.value) == (
        f"project.project_dir={folder} cannot be written (Not a directory); choose a folder this user can write."
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="permission bits do not stop root from writing")
def test_a_read_only_folder_cannot_be_written(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    try:
        with pytest.raises(ConfigError) as error:
            check_writable(folder, "hydra.run.dir")
    finally:
        folder.chmod(0o755)
    assert str(error.value) == (
        f"hydra.run.dir={folder} cannot be written (Permission denied); choose a folder this user can write."
    )
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", socket.gethostname()])
def test_a_rendezvous_port_in_use_on_this_machine_is_refused(host):
    with _listening() as port:
        with pytest.raises(ConfigError) as error:
            check_rendezvous_port(f"{host}:{port}")
    assert str(error.value) == (
        f"trainer.rdzv_endpoint={host}:{port}: port {port} is already in use on this machine (another job, or a run "
        "that has not exited); choose a free port and give every node the same endpoint."
    )


def test_a_free_port_or_another_machines_port_is_accepted():
    check_rendezvous_port(f"127.0.0.1:{_closed_port()}")
    check_rendezvous_port("127.0.0.1:0")  # the rendezvous picks a free port
    with _listening() as port:
        check_rendezvous_port(f"192.0.2.1:{port}")  # TEST-NET-1: not this machine, its ports are not ours to check
        check_rendezvous_port("127.0.0.1")  # no port: torch's launcher reports that


def test_waiting_for_a_rendezvous_nobody_serves_times_out():
    endpoint = f"127.0.0.1:{_closed_port()}"
    start = time.monotonic()
    with pytest.raises(ConfigError) as error:
        wait_for_rendezvous(endpoint, timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 2.0
    assert str(error.value) == (
        f"trainer.rdzv_endpoint={endpoint}: nothing answered there within 0.3 s (trainer.rdzv_timeout); "
        "start node 0 (trainer.node_rank=0) with the same endpoint, or fix the address."
    )


def test_waiting_for_a_rendezvous_returns_once_something_listens():
    with _listening() as port:
        start = time.monotonic()
        wait_for_rendezvous(f"127.0.0.1:{port}", timeout=5)
        assert time.monotonic() - start < 0.5
    port = _closed_port()
    started = threading.Event()
    stop = threading.Event()

    def host_starts_late():
        time.sleep(0.2)
        with _listening(port):
            started.set()
            stop.wait(5)

    host = threading.Thread(target=host_starts_late)
    host.start()
    try:
        start = time.monotonic()
        wait_for_rendezvous(f"127.0.0.1:{port}", timeout=5)
        elapsed = time.monotonic() - start
    finally:
        stop.set()
        host.join()
    assert started.is_set()
    assert 0.2 <= elapsed < 2.0


def test_an_endpoint_without_a_port_is_refused_before_waiting():
    message = "trainer.rdzv_endpoint=node0 must be HOST:PORT, the address every node can reach."
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        wait_for_rendezvous("node0", timeout=60)


def test_a_rendezvous_host_that_does_not_resolve_is_one_sentence_at_once(monkeypatch):
    for endpoint in ("localhost:29500", "127.0.0.1:29500", "[::1]:29500"):
        check_resolves(endpoint)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError) as refused:
        check_resolves("n1.invalid:20004")
    assert str(refused.value).startswith(
        f"trainer.rdzv_endpoint=n1.invalid:20004: its host n1.invalid does not resolve on {socket.gethostname()} ("
    )
    assert str(refused.value).endswith(
        "); make that name resolve on every node (DNS or /etc/hosts), or give trainer.rdzv_endpoint=ADDRESS:PORT "
        "that every node can reach."
    )
    monkeypatch.setenv("SLURM_JOB_ID", "17")  # under Slurm the endpoint came from the job's node list
    with pytest.raises(ConfigError, match=r"its host n1.invalid \(the job's first node, from SLURM_JOB_NODELIST\) "):
        check_resolves("n1.invalid:20004")
