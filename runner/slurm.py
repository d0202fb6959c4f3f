"""Runs started by Slurm's ``srun``: read the job's shape from SLURM_* variables.

Two layouts are understood, both from ``srun python -m runner ...``:

- **One task per node** (``--ntasks-per-node=1``): each task is a node's launcher. It gets
  ``trainer.num_nodes`` (SLURM_NNODES), ``trainer.node_rank`` (SLURM_NODEID) and
  ``trainer.rdzv_endpoint`` (the job's first host, on a port derived from the job id) unless the
  command line sets them, and starts ``trainer.num_processes`` workers through torch's elastic
  launcher, as on any multi-node run.
- **One task per process** (``--ntasks-per-node`` = processes per node): each task is one rank.
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set from
  SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the tasks per node and the first host, so the process
  joins the job's group the way a torchrun worker does.

Either way every task uses the run folder ``outputs/slurm-<job id>`` unless one is given, so a
requeued job continues in its own folder (``resume=outputs/slurm-<job id>``).
"""

from __future__ import annotations

import os
import re


def _int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def under_srun() -> bool:
    """Whether this process is one of several tasks of a Slurm job step."""
    tasks = _int("SLURM_NTASKS") or _int("SLURM_NPROCS") or 1
    return "SLURM_PROCID" in os.environ and "SLURM_JOB_ID" in os.environ and tasks > 1


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (``gpu[01-03,07],login1``) as host names, in order."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", hostlist):
        prefix, ranges = match.group(1), match.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            start, _, stop = part.partition("-")
            for number in range(int(start), int(stop or start) + 1):
                hosts.append(f"{prefix}{number:0{len(start)}d}")
    return hosts


def first_host() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1"
    return expand_hostlist(nodelist)[0]


def job_port() -> int:
    """A port every task of the job computes alike (from the job id), in 20000-39999."""
    return 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000


def _shape() -> tuple[int, int]:
    tasks = _int("SLURM_NTASKS") or _int("SLURM_NPROCS") or 1
    nodes = _int("SLURM_NNODES") or _int("SLURM_JOB_NUM_NODES") or 1
    return tasks, nodes


def node_launcher_settings() -> dict[str, str]:
    """With one task per node: the trainer keys that make this task its node's launcher (else empty)."""
    tasks, nodes = _shape()
    if tasks != nodes:
        return {}
    return {
        "trainer.num_nodes": str(nodes),
        "trainer.node_rank": os.environ.get("SLURM_NODEID", "0"),
        "trainer.rdzv_endpoint": f"{first_host()}:{job_port()}",
    }


def set_rank_environment() -> bool:
    """With one task per process: set this task's rank variables (as torchrun would); False otherwise."""
    tasks, nodes = _shape()
    if tasks == nodes:
        return False
    os.environ.update(
        RANK=os.environ["SLURM_PROCID"],
        WORLD_SIZE=str(tasks),
        LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
        LOCAL_WORLD_SIZE=str(tasks // nodes),
        MASTER_ADDR=first_host(),
        MASTER_PORT=str(job_port()),
    )
    return True


def command_line(given: dict[str, str]) -> list[str]:
    """Overrides (and, for one task per process, environment variables) that place this task in the job.

    Args:
        given: ``key=value`` overrides already on the command line; they win over Slurm's values.
    """
    job = os.environ["SLURM_JOB_ID"]
    extra = [] if "hydra.run.dir" in given else [f"hydra.run.dir=outputs/slurm-{job}"]
    if "project.project_dir" not in given:
        extra.append(f"project.project_dir={given.get('hydra.run.dir', f'outputs/slurm-{job}')}")
    if set_rank_environment():
        if os.environ["RANK"] != "0":  # rank 0 alone writes Hydra's record and the log
            extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
        return extra
    if os.environ.get("SLURM_NODEID", "0") != "0":  # node 0 alone writes Hydra's record into the shared folder
        extra += ["hydra.output_subdir=null"]
    return extra + [f"{key}={value}" for key, value in node_launcher_settings().items() if key not in given]
