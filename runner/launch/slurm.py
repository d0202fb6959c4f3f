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

import itertools
import os
import re
import shutil
import subprocess
from typing import Any


def _int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def under_srun() -> bool:
    """Whether this process is one of several tasks of a Slurm job step."""
    tasks = _int("SLURM_NTASKS") or _int("SLURM_NPROCS") or 1
    return "SLURM_PROCID" in os.environ and "SLURM_JOB_ID" in os.environ and tasks > 1


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list as host names, in Slurm's order.

    Items are separated by commas outside brackets; each bracket holds numbers and ranges (leading
    zeros set the width), and an item with several brackets names every combination, the first bracket
    varying slowest: ``gpu[01-02]-ib`` is gpu01-ib, gpu02-ib; ``rack[1-2]-node[01-02]`` is rack1-node01,
    rack1-node02, rack2-node01, rack2-node02; ``a,b[3,5-6]`` is a, b3, b5, b6.

    Raises:
        ValueError: A bracket is not closed, or holds something other than numbers and ranges.
    """
    hosts: list[str] = []
    for item in _top_level_items(hostlist):
        parts = re.split(r"(\[[^\[\]]*\])", item)
        if any("[" in part or "]" in part for part in parts if not part.startswith("[")):
            raise ValueError(f"The Slurm host list {hostlist!r} has an unbalanced bracket in {item!r}.")
        choices = [_bracket_values(part[1:-1], hostlist) if part.startswith("[") else [part] for part in parts if part]
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    return hosts


def _top_level_items(hostlist: str) -> list[str]:
    """``hostlist`` split at the commas outside brackets."""
    items, depth, current = [], 0, []
    for character in hostlist:
        depth += {"[": 1, "]": -1}.get(character, 0)
        if character == "," and depth == 0:
            items.append("".join(current))
            current = []
        else:
            current.append(character)
    items.append("".join(current))
    return [item.strip() for item in items if item.strip()]


def _bracket_values(ranges: str, hostlist: str) -> list[str]:
    values = []
    for part in ranges.split(","):
        start, _, stop = part.strip().partition("-")
        if not start.isdigit() or not (stop or start).isdigit():
            raise ValueError(
                f"The Slurm host list {hostlist!r} has {ranges!r} in brackets; expected numbers and ranges."
            )
        values += [f"{number:0{len(start)}d}" for number in range(int(start), int(stop or start) + 1)]
    return values


def first_host() -> str:
    """The job's first host: what ``scontrol show hostnames`` lists first, or :func:`expand_hostlist`'s without it."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1"
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            shown = subprocess.run(
                [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            shown = []
        if shown:
            return shown[0]
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
        given: The values of the overrides already on the command line, by key (see
            :func:`runner.config.overrides.values`); they win over Slurm's.
    """
    from runner.config.overrides import hydra_value

    job = os.environ["SLURM_JOB_ID"]
    extra = [] if "hydra.run.dir" in given else [f"hydra.run.dir=outputs/slurm-{job}"]
    if "project.project_dir" not in given:
        extra.append(f"project.project_dir={hydra_value(given.get('hydra.run.dir') or f'outputs/slurm-{job}')}")
    if set_rank_environment():
        if os.environ["RANK"] != "0":  # rank 0 alone writes Hydra's record and the log
            extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
        return extra
    if os.environ.get("SLURM_NODEID", "0") != "0":  # node 0 alone writes Hydra's record into the shared folder
        extra += ["hydra.output_subdir=null"]
    return extra + [f"{key}={value}" for key, value in node_launcher_settings().items() if key not in given]


# What sbatch says when it refuses a job, and the hydra.launcher keys (conf/hydra/launcher/slurm.yaml) that set it.
_REFUSALS = (
    ("generic resource", ("gpus_per_node", "gres")),
    ("gres", ("gpus_per_node", "gres")),
    ("partition", ("partition",)),
    ("account", ("account",)),
    ("qos", ("qos",)),
    ("time limit", ("timeout_min",)),
    ("memory", ("mem_gb",)),
    ("node configuration is not available", ("nodes", "tasks_per_node", "cpus_per_task", "mem_gb", "gpus_per_node")),
    ("cpu count", ("cpus_per_task", "tasks_per_node")),
)


def refused_submission(error: BaseException, launcher: Any) -> str | None:
    """One sentence for a job sbatch refused (submitit's ``FailedJobError``), naming the ``hydra.launcher`` keys
    behind it and their values; None for any other error."""
    if type(error).__name__ != "FailedJobError" or not type(error).__module__.startswith("submitit"):
        return None
    said = " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip()) or "no reason given"
    keys = next((keys for words, keys in _REFUSALS if words in said.lower()), ("partition", "nodes", "cpus_per_task"))
    given = ", ".join(f"hydra.launcher.{key}={launcher.get(key)}" for key in keys if launcher.get(key) is not None)
    given = given or f"hydra.launcher.{keys[0]}"
    gpus = " (on a cluster without GPUs, use hydra/launcher=slurm_cpu)" if "gpus_per_node" in keys[:1] else ""
    return (
        f"Slurm refused the job ({said}); set {given} to what the cluster offers (sinfo lists its partitions, "
        f"CPUs, memory and GPUs){gpus}."
    )
