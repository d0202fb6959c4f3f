import os

import pytest

from runner.launch import slurm


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("node7", ["node7"]),
        ("a[9-10],b[1]", ["a9", "a10", "b1"]),
        ("gpu[01-02]-ib", ["gpu01-ib", "gpu02-ib"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        ("a,b[3,5-6]", ["a", "b3", "b5", "b6"]),
        ("n[8-11]-x,login", ["n8-x", "n9-x", "n10-x", "n11-x", "login"]),
    ],
)
def test_slurm_host_lists_expand_in_order(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize(
    ("hostlist", "message"),
    [
        ("gpu[01-02", "The Slurm host list 'gpu[01-02' has an unbalanced bracket in 'gpu[01-02'."),
        ("gpu01]", "The Slurm host list 'gpu01]' has an unbalanced bracket in 'gpu01]'."),
        ("gpu[a-b]", "The Slurm host list 'gpu[a-b]' has 'a-b' in brackets; expected numbers and ranges."),
    ],
)
def test_a_host_list_slurm_would_not_write_is_one_sentence(hostlist, message):
    with pytest.raises(ValueError) as error:
        slurm.expand_hostlist(hostlist)
    assert str(error.value) == message


def test_the_first_host_is_scontrols_when_it_is_installed(monkeypatch, tmp_path):
    _job(monkeypatch, SLURM_JOB_NODELIST="rack[1-2]-node[01-02]")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert slurm.first_host() == "rack1-node01"  # no scontrol: the parser's
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "show hostnames rack[1-2]-node[01-02]" ] && echo r1n1 && echo r1n2\n'
    )
    scontrol.chmod(0o755)
    assert slurm.first_host() == "r1n1"


def _job(monkeypatch, **variables):
    """A private environment of a Slurm job step (whatever the code under test sets stays in it)."""
    launched = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    kept = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in launched}
    job = {"SLURM_JOB_ID": "1234", "SLURM_JOB_NODELIST": "gpu[03-04]", **variables}
    monkeypatch.setattr(os, "environ", {**kept, **job})


def test_one_task_per_node_makes_each_task_a_node_launcher(monkeypatch):
    _job(monkeypatch, SLURM_NTASKS="2", SLURM_NNODES="2", SLURM_PROCID="1", SLURM_NODEID="1")
    assert slurm.under_srun()
    assert slurm.command_line({"trainer.num_processes": "4"}) == [
        "hydra.run.dir=outputs/slurm-1234",
        "project.project_dir=outputs/slurm-1234",
        "hydra.output_subdir=null",
        "trainer.num_nodes=2",
        "trainer.node_rank=1",
        "trainer.rdzv_endpoint=gpu03:21234",
    ]
    assert "RANK" not in os.environ  # the workers get their ranks from the elastic launcher
    assert slurm.command_line({"trainer.rdzv_endpoint": "gpu03:29400", "hydra.run.dir": "runs/a"})[-2:] == [
        "trainer.num_nodes=2",
        "trainer.node_rank=1",
    ]


def test_one_task_per_process_makes_each_task_a_rank(monkeypatch):
    _job(monkeypatch, SLURM_NTASKS="8", SLURM_NNODES="2", SLURM_PROCID="5", SLURM_LOCALID="1", SLURM_NODEID="1")
    extra = slurm.command_line({})
    assert extra[:2] == ["hydra.run.dir=outputs/slurm-1234", "project.project_dir=outputs/slurm-1234"]
    assert extra[2:] == ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    environment = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    assert environment == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("gpu03", "21234")


def test_a_single_task_is_not_a_slurm_job_step(monkeypatch):
    _job(monkeypatch, SLURM_NTASKS="1", SLURM_PROCID="0")
    assert not slurm.under_srun()
