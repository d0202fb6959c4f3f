"""What a node of a multi-node launch knows when it loses the others (runner.launch.lost_nodes), and the settings
its launcher gives torch's agent and gloo (runner.launch.elastic). The whole of it runs on two hosts in
tests/e2e/test_two_hosts.py."""

import json
import sys
import tempfile

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import runner.engine.launchers
from runner.config.run_spec import LaunchShape, RunSpec
from runner.engine.launch_environment import LaunchEnvironment
from runner.engine.launchers import elastic_run
from runner.launch import elastic, lost_nodes
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


def test_a_rank_whose_collective_timed_out_on_several_nodes_ends_the_launch_naming_the_lost_node(monkeypatch, tmp_path):
    error_file = tmp_path / "attempt_0" / "0" / "error.json"
    error_file.parent.mkdir(parents=True)
    timed_out = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 6000ms for send operation"
    extra = {"py_callstack": "", "timestamp": "0"}
    error_file.write_text(json.dumps({"message": {"message": timed_out, "extraInfo": extra}}))

    def fails(*args, **kwargs):
        failure = ProcessFailure(local_rank=0, pid=1000, exitcode=1, error_file=str(error_file))
        raise ChildFailedError("run_worker_process", {0: failure})

    monkeypatch.setattr(runner.engine.launchers, "elastic_run", fails)
    monkeypatch.setattr(elastic.preload, "start", lambda: None)
    monkeypatch.setattr("socket.gethostname", lambda: "host-b")
    with pytest.raises(elastic.WorkerFailed) as failed:
        elastic._elastic_launch(_spec({**TRAINER, "max_restarts": 0}, tmp_path / "run", num_nodes=2))
    assert str(failed.value).startswith(
        "node 1 (host-b) lost node 0 (the rendezvous host trainer.rdzv_endpoint=10.1.2.3:29500): rank 0's collective "
        f"failed ({timed_out}) (trainer.rdzv_timeout=10); "
        "no checkpoint was completed;"
    )


def test_a_first_rendezvous_that_times_out_says_which_nodes_to_start(monkeypatch, tmp_path):
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    def times_out(*args, **kwargs):
        raise RendezvousTimeoutError

    monkeypatch.setattr(runner.engine.launchers, "elastic_run", times_out)
    monkeypatch.setattr(elastic.preload, "start", lambda: None)
    monkeypatch.setattr("socket.gethostname", lambda: "host-a")
    with pytest.raises(elastic.WorkerFailed) as failed:
        elastic._elastic_launch(_spec({**TRAINER, "node_rank": 0, "max_restarts": 0}, tmp_path, num_nodes=3))
    assert str(failed.value) == (
        "node 0 (host-a): not every node joined the rendezvous at trainer.rdzv_endpoint=10.1.2.3:29500 within "
        "trainer.rdzv_timeout=10 s; start all 3 nodes (trainer.node_rank=0 to 2) with the same trainer.rdzv_endpoint "
        "and project.project_dir, or give a larger trainer.rdzv_timeout."
    )


def _spec(trainer: dict, project_dir, *, num_nodes: int) -> RunSpec:
    """A settled run of one process per node on ``num_nodes`` nodes, as the launching process hands it on."""
    from omegaconf import OmegaConf

    config = OmegaConf.create({"trainer": trainer, "project": {"project_dir": str(project_dir)}})
    shape = LaunchShape(num_processes=1, num_nodes=num_nodes, node_rank=trainer["node_rank"],
                        environment=LaunchEnvironment())  # fmt: skip
    return RunSpec(config, (), project_dir, resume=None, verified=None, launch=shape)
