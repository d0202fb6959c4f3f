"""Start the training processes: directly, through torch's elastic launcher, or by joining torchrun.

The launching process has already resolved the config (run folder included); workers receive it as
plain data, so every rank and every restart trains in the same folder with the same settings.
"""

from __future__ import annotations

import logging
import os
import re
import uuid
from typing import Any

logger = logging.getLogger("runner")


class WorkerFailed(RuntimeError):
    """A training process failed; the message names the rank and its error."""


def inside_launched_group() -> bool:
    """Whether this process is already a worker of torchrun / torch's elastic agent."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def resolve_num_processes(value: Any, *, cpu: bool) -> int:
    """``auto``: one process per visible GPU (1 without GPUs); otherwise the number given."""
    if value != "auto":
        return int(value)
    if cpu:
        return 1
    import torch

    return max(1, torch.cuda.device_count())


def launch(config: dict[str, Any], overrides: list[str]) -> float | None:
    """Run the training described by ``config`` and return rank 0's objective."""
    from runner.worker import run_worker

    trainer = config["trainer"]
    num_processes = resolve_num_processes(trainer["num_processes"], cpu=trainer["cpu"])
    num_nodes = trainer["num_nodes"]
    if inside_launched_group() or (num_processes == 1 and num_nodes == 1):
        return run_worker(config, overrides)
    return _elastic_launch(config, overrides, num_processes=num_processes, num_nodes=num_nodes)


def _elastic_launch(config: dict[str, Any], overrides: list[str], *, num_processes: int, num_nodes: int):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from runner.worker import run_worker

    trainer = config["trainer"]
    launch_config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=f"runner-{uuid.uuid4().hex[:12]}" if num_nodes == 1 else _multinode_run_id(config),
        rdzv_backend="c10d",
        # Port 0 lets the rendezvous pick a free port, so concurrent runs and sweep jobs never clash.
        rdzv_endpoint=trainer["rdzv_endpoint"] or "127.0.0.1:0",
        max_restarts=trainer["max_restarts"],
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(),
    )
    # Like torchrun: split the cores between the workers unless the user chose a thread count.
    set_threads = "OMP_NUM_THREADS" not in os.environ
    if set_threads:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_processes))
    logger.info(
        "Starting %d processes on this node (%d node(s)) with torch's elastic launcher", num_processes, num_nodes
    )
    try:
        results = elastic_launch(launch_config, run_worker)(config, overrides)
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        detail = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
        detail = re.sub(
            r"^(?:\w+\.)+(\w+: )", r"\1", detail
        )  # runner.engine.checkpoint.CheckpointError -> CheckpointError
        raise WorkerFailed(f"Worker rank {rank} failed: {detail}") from None
    finally:
        if set_threads:
            os.environ.pop("OMP_NUM_THREADS", None)
    return results.get(0)


def _multinode_run_id(config: dict[str, Any]) -> str:
    # Every node must present the same run id to the rendezvous; the run folder is shared by all.
    return "runner-" + uuid.uuid5(uuid.NAMESPACE_URL, config["project"]["project_dir"]).hex[:12]
