"""What the program that started this process said about it, read once: torchrun, torch's elastic agent, srun.

torch.distributed's launchers speak through environment variables (``RANK``, ``WORLD_SIZE``,
``TORCHELASTIC_RUN_ID``, ...). This is their one reader: the command line, the launch and the workers take the
:class:`LaunchEnvironment` it returns as an argument, and an Accelerator builds its process's place in the job from
it (:func:`runner.engine.distributed.read_environment`). The variables themselves stay as the launcher set them,
for ``torch.distributed``'s own ``env://`` rendezvous. Importing this module imports nothing but the standard
library, so the command line reads it before torch is imported.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

# The counts a process of a launched group cannot start without reading correctly (read_environment refuses a value
# that is not one); the command line takes such a value as absent, and the engine then names it.
PROCESS_COUNTS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class LaunchEnvironment:
    rank: int | None = None  # RANK: this process's global rank, when a launcher started it
    world_size: int | None = None  # WORLD_SIZE
    run_id: str | None = None  # TORCHELASTIC_RUN_ID: set by torchrun and torch's elastic agent
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: how often the agent restarted the workers
    agent_store: bool = False  # TORCHELASTIC_USE_AGENT_STORE: the agent's TCPStore is at MASTER_ADDR:MASTER_PORT
    master_addr: str | None = None
    master_port: int | None = None
    threads: int | None = None  # OMP_NUM_THREADS: the CPU threads this process may use
    local_rank: int | None = None  # LOCAL_RANK: this process's rank on its node
    local_world_size: int | None = None  # LOCAL_WORLD_SIZE: the processes on its node
    # PROCESS_COUNTS set to something that is not a count, as ``NAME='text'``: read as absent above.
    malformed: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> LaunchEnvironment:
        malformed = []

        def number(name: str) -> int | None:
            text = environ.get(name, "")
            if text.strip().isdecimal():
                return int(text)
            if name in PROCESS_COUNTS and text != "":
                malformed.append(f"{name}={text!r}")
            return None

        return cls(
            rank=number("RANK"),
            world_size=number("WORLD_SIZE"),
            run_id=environ.get("TORCHELASTIC_RUN_ID"),
            restart_count=number("TORCHELASTIC_RESTART_COUNT") or 0,
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            master_addr=environ.get("MASTER_ADDR"),
            master_port=number("MASTER_PORT"),
            threads=number("OMP_NUM_THREADS"),
            local_rank=number("LOCAL_RANK"),
            local_world_size=number("LOCAL_WORLD_SIZE"),
            malformed=tuple(malformed),
        )

    @property
    def global_rank(self) -> int:
        """This process's rank; 0 when no launcher started it."""
        return self.rank or 0

    @property
    def under_torchrun(self) -> bool:
        """Whether torchrun (or torch's elastic agent) started this process as one of its ranks."""
        return self.run_id is not None and self.rank is not None

    @property
    def inside_launched_group(self) -> bool:
        """Whether this process is already one worker of a launched group (torchrun, the elastic agent, srun)."""
        return self.run_id is not None or (self.rank is not None and self.world_size is not None)
