"""One run folder for every torchrun rank: each rank runs the command line (and Hydra) itself."""

from __future__ import annotations

import time

from runner.config import ConfigError
from runner.engine.launch_environment import LaunchEnvironment


def agreed_run_dir(environment: LaunchEnvironment) -> list[str]:
    """Hydra overrides that put every torchrun rank in one run folder, written by rank 0 only.

    ``${now:}`` differs between processes that start a second apart, so the ranks agree through
    the elastic agent's own TCPStore: the first proposal wins. Without the agent's store, the
    rendezvous id (the same on every rank) names the folder.

    Raises:
        ConfigError: The launcher gives the ranks nothing to agree through.
    """
    stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
    if environment.agent_store:
        from datetime import timedelta

        import torch.distributed as dist

        store = dist.TCPStore(
            environment.master_addr, environment.master_port, is_master=False, timeout=timedelta(seconds=60)
        )
        stamp = store.compare_set("runner/run_dir_stamp", "", stamp).decode()
    else:
        if environment.run_id == "none":
            raise ConfigError(
                "Under this launcher the ranks cannot agree on a run folder; pass hydra.run.dir=... (the same on "
                "every rank) or torchrun --rdzv-id."
            )
        stamp = f"torchrun-{environment.run_id}"
    extra = [f"hydra.run.dir=outputs/{stamp}"]
    if environment.rank != 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    return extra
