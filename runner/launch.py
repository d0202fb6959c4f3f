"""Start the training processes: directly, through torch's elastic launcher, or by joining torchrun.

The launching process has already resolved the config (run folder included); workers receive it as
plain data, so every rank and every restart trains in the same folder with the same settings.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import uuid
from pathlib import Path
from typing import Any

from runner import preemption

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
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from runner.engine.launchers import elastic_run
    from runner.worker import run_worker_process

    trainer = config["trainer"]
    logger.info(
        "Starting %d processes on this node (%d node(s)) with torch's elastic launcher", num_processes, num_nodes
    )
    # torch's agent stops the workers gracefully on SIGTERM (they save and exit); SIGUSR1 means the same.
    previous = signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        results = elastic_run(
            run_worker_process,
            (config, overrides),
            num_processes=num_processes,
            # Port 0 lets the rendezvous pick a free port, so concurrent runs and sweep jobs never clash.
            rdzv_endpoint=trainer["rdzv_endpoint"] or "127.0.0.1:0",
            num_nodes=num_nodes,
            run_id=None if num_nodes == 1 else _multinode_run_id(config),
            max_restarts=trainer["max_restarts"],
            monitor_interval=0.1,
            rdzv_timeout=trainer["rdzv_timeout"],
        )
    except SignalException as error:  # this process got the signal; the workers have stopped and saved
        raise preemption.Preempted(signal.Signals(error.sigval).name, step=-1) from None
    except ChildFailedError as error:
        if all(failure.exitcode == preemption.EXIT_CODE for failure in error.failures.values()):
            raise preemption.Preempted("a stop signal to the workers", step=-1) from None
        raise WorkerFailed(describe_failure(error.failures)) from None
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return results.get(0)


# When one rank dies, its peers fail too, on the broken connection; those are not the cause.
_COLLATERAL = re.compile(
    r"Connection (closed|reset) by peer|remote worker|Broken pipe|communicator was aborted|SIGTERM"
)


def describe_failure(failures: dict) -> str:
    """One sentence for the root cause among the failed ranks.

    When a rank raises, its peers fail next on the broken connection, and the elastic agent may
    report one of those before the rank that raised has exited. So the error files torch's agent
    keeps for every local rank of the attempt are read too, and an error of a rank's own is
    preferred over a peer's broken connection.
    """
    candidates: dict[int, str] = {}
    for rank, failure in failures.items():
        text = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        candidates[rank] = text.strip() or f"exit code {failure.exitcode}"
        candidates.update(_sibling_errors(rank, failure))
    rank = min(candidates, key=lambda r: (bool(_COLLATERAL.search(candidates[r])), r not in failures, r))
    detail = candidates[rank].splitlines()[-1]
    # "runner.engine.checkpoint.CheckpointError: ..." reads better as "CheckpointError: ..."
    detail = re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", detail)
    return f"Worker rank {rank} failed: {detail}"


def _sibling_errors(rank: int, failure) -> dict[int, str]:
    """Messages in the error files of the other local ranks of ``failure``'s attempt, by global rank."""
    error_file = Path(str(failure.error_file))
    if not error_file.is_file() or not error_file.parent.name.isdigit():
        return {}
    found = {}
    for sibling in error_file.parent.parent.glob("*/error.json"):
        if not sibling.parent.name.isdigit() or sibling == error_file:
            continue
        try:
            message = json.loads(sibling.read_text())["message"]["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        found[rank - failure.local_rank + int(sibling.parent.name)] = str(message).strip()
    return found


def _multinode_run_id(config: dict[str, Any]) -> str:
    # Every node must present the same run id to the rendezvous: derive it from what every node was
    # given alike, the rendezvous address and the shared run folder (required by the runner's checks).
    key = f"{config['trainer']['rdzv_endpoint']}|{config['project']['project_dir']}"
    return "runner-" + uuid.uuid5(uuid.NAMESPACE_URL, key).hex[:12]
