"""What a node of a multi-node launch knows when it loses the others (runner.launch.lost_nodes), and the settings
its launcher gives torch's agent and gloo (runner.launch.elastic). The whole of it runs on two hosts in
tests/e2e/test_two_hosts.py."""

import json
import sys
import tempfile

import pytest

from runner.engine.launchers import elastic_run
from runner.launch import lost_nodes
from runner.launch.elastic import _interface_of
from runner.launch.lost_nodes import FOLDER_ENV, NodeWatch

TRAINER = {"node_rank": 1, "rdzv_endpoint": "10.1.2.3:29500", "rdzv_timeout": 10}


@pytest.fixture(autouse=True)
def _launcher_folders_in_tmp_path(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_elastic_run_hands_the_rendezvous_timeout_to_the_c10d_rendezvous_as_its_join_timeout(monkeypatch):
    import torch.distributed.launcher.api as api

    seen = {}
    monkeypatch.setattr(api, "elastic_launch", lambda config, entrypoint: seen.setdefault("config", config) and dict)
    elastic_run(print, (), num_processes=1, rdzv_endpoint="127.0.0.1:0", rdzv_timeout=7, start_method="spawn")
    # LaunchConfig turns rdzv_timeout into "timeout", which only the static backend reads: c10d waited 600 s.
    assert seen["config"].rdzv_configs == {"timeout": 7, "join_timeout": 7}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the interface is looked up on Linux only")
def test_the_interface_that_holds_an_address_is_found_for_gloo():
    assert _interface_of("127.0.0.1") == "lo"
    assert _interface_of("192.0.2.1") is None  # TEST-NET-1: no interface here holds it


def test_the_launcher_waits_for_its_workers_only_after_one_failed_and_until_one_started_again(monkeypatch, tmp_path):
    watch = NodeWatch(TRAINER, str(tmp_path))
    monkeypatch.setenv(FOLDER_ENV, str(watch.folder))
    assert watch.environment == {FOLDER_ENV: str(watch.folder)}
    lost_nodes.worker_started()
    assert not watch._waits_after_failure()
    lost_nodes.worker_failed()
    assert watch._waits_after_failure()
    lost_nodes.worker_started()  # the agent restarted them
    assert not watch._waits_after_failure()
    with watch:
        pass
    assert not watch.folder.exists()  # the launcher's folder goes with the launch


def test_a_node_names_the_node_it_lost_the_checkpoint_to_continue_from_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "host-b")
    node1 = NodeWatch(TRAINER, str(tmp_path / "run"))
    (node1.folder / "nodes.json").write_text(json.dumps({"0": "host-a", "1": "host-b"}))
    assert node1.sentence("its collectives went unanswered") == (
        "node 1 (host-b) lost node 0 (host-a, the rendezvous host trainer.rdzv_endpoint=10.1.2.3:29500): its "
        "collectives went unanswered (trainer.rdzv_timeout=10); no checkpoint was completed; once the nodes reach "
        f"each other again, continue with `python -m runner resume={tmp_path / 'run'} trainer.node_rank=N` on each "
        "node N."
    )
    node0 = NodeWatch({**TRAINER, "node_rank": 0}, str(tmp_path / "run"))
    assert "lost the other nodes: " in node0.sentence("x")  # before the workers named the hosts
    (node0.folder / "nodes.json").write_text(json.dumps({"0": "host-a", "1": "host-b", "2": "host-c"}))
    assert "lost one or more of node 1 (host-b), node 2 (host-c): " in node0.sentence("x")
