"""``runner launch script.py``: run a plain engine script on several processes, as ``accelerate launch`` does.

The processes are started by torch's elastic launcher (the engine behind ``torchrun``), through
:func:`runner.engine.launchers.elastic_run` with the Python interpreter as its entry point: each
worker runs ``python -u script.py args`` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT set. On one machine the rendezvous takes a free port (c10d on 127.0.0.1:0) unless
``--main_process_port`` names one; several machines meet at ``--main_process_ip:--main_process_port``
with this machine's rank given (a static rendezvous, as ``accelerate launch`` and ``torchrun
--node_rank`` do). A ``--main_process_port`` already taken on the machine that hosts the
rendezvous is refused before anything starts; SIGUSR1 stops the workers as SIGTERM does. The
script's ``Accelerator()`` reads the mixed precision and the CPU choice from the variables set here
for the workers, unless the script passes its own.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from runner.launch.flags import build_parser, parse_settings_flags, read_launch_config, split_at_script
from runner.launch.settings import DEFAULT_MULTI_MACHINE_PORT, LaunchError, LaunchSettings, gpu_count, resolve

# Several machines present the same run id to their static rendezvous; one machine gets a fresh one.
MULTI_MACHINE_RUN_ID = "runner-launch"


@dataclass(frozen=True)
class ScriptCommand:
    """``runner launch``'s command line, read and checked."""

    settings: LaunchSettings
    script: str  # a path, or a module with -m
    script_args: tuple[str, ...] = ()
    module: bool = False
    config_file: Path | None = None  # the file read, if any

    def worker_arguments(self) -> list[str]:
        """What each worker's Python runs: ``-u script.py args`` or ``-u -m module args``."""
        return ["-u", *(["-m"] if self.module else []), self.script, *self.script_args]


def read_script_command(argv: list[str]) -> ScriptCommand:
    """``runner launch``'s command line, with the config file's settings under the flags.

    Raises:
        LaunchError: A bad flag or value, no script, a script that is not there, or a bad config file.
    """
    parser = build_parser("launch")
    flags, rest = split_at_script(argv, parser)
    namespace, given = parse_settings_flags(parser, flags)
    if not rest:
        raise LaunchError("no script given: runner launch [flags] script.py [script arguments]")
    script, *script_args = rest
    if not namespace.module and not Path(script).is_file():
        raise LaunchError(f"the script {script} is not a file; give the path of the Python script (or -m module)")
    config_file, file_values = read_launch_config(namespace.config_file)
    settings = resolve(given, file_values=file_values, config_file=config_file)
    return ScriptCommand(settings, script, tuple(script_args), module=namespace.module, config_file=config_file)


def main(argv: list[str]) -> int:
    """``runner launch [flags] script.py [args]``; returns the exit code (the failed rank's, if one failed).

    Raises:
        LaunchError: A bad flag, value, script or config file, before anything starts.
    """
    return launch_script(read_script_command(argv))


def launch_script(command: ScriptCommand) -> int:
    """Start the workers and wait for them; returns the exit code (0, the failed rank's, or 128 + a signal's).

    Raises:
        LaunchError: The rendezvous port this machine would host is already in use.
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    from runner.engine.launchers import elastic_run
    from runner.launch.failures import root_cause

    settings = command.settings
    rendezvous = rendezvous_options(settings)
    check_hosted_port(settings)
    # torch's agent stops the workers on SIGTERM; SIGUSR1 (Slurm's warning before the time limit) means the same,
    # instead of ending this process alone and leaving the workers running.
    previous = signal.signal(signal.SIGUSR1, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    try:
        # elastic_run takes an executable as torch's elastic_launch does: its arguments go to the workers.
        elastic_run(
            sys.executable,
            tuple(command.worker_arguments()),
            num_processes=processes_per_machine(settings),
            environment=worker_environment(settings),
            max_restarts=settings.max_restarts,
            **rendezvous,
        )
    except ChildFailedError as error:
        rank, detail = root_cause(error.failures)
        failure = error.failures.get(rank)
        if detail.startswith("exit code"):
            code = exit_code(error.failures, rank)
            sentence = f"worker rank {rank} failed with exit code {code}"
        elif failure is None or failure.exitcode == -signal.SIGTERM:
            # Its error file names its error, but the agent stopped it on its way out, once a peer had failed on
            # the broken connection: its exit code is the agent's signal. A Python process that raises exits with 1.
            code, sentence = 1, f"worker rank {rank} failed ({detail})"
        else:
            code = exit_code(error.failures, rank)
            sentence = f"worker rank {rank} failed with exit code {code} ({detail})"
        print(f"runner launch: error: {sentence}; its output is above.", file=sys.stderr)
        return code
    except SignalException as error:  # this process got the signal; torch's agent has stopped the workers
        print(f"runner launch: stopped by {signal.Signals(error.sigval).name}, with every worker.", file=sys.stderr)
        return 128 + error.sigval
    except (RendezvousError, DistError) as error:  # DistError: a store that timed out or could not connect
        print(
            f"runner launch: error: the processes did not meet at {rendezvous['rdzv_endpoint']} ({error}); check "
            "--main_process_ip and --main_process_port, and that every machine was started.",
            file=sys.stderr,
        )
        return 1
    finally:
        signal.signal(signal.SIGUSR1, previous)
    return 0


def check_hosted_port(settings: LaunchSettings) -> None:
    """Refuse a ``--main_process_port`` already in use on the machine that hosts the rendezvous (machine 0).

    c10d would otherwise connect to whatever listens there and wait forever, or fail with EADDRINUSE.

    Raises:
        LaunchError: The port is taken.
    """
    port = settings.main_process_port
    if settings.machine_rank != 0 or port is None:
        return
    from runner.launch.preflight import check_port_free

    fix = ", or leave it out to take a free one" if settings.num_machines == 1 else " and give it to every machine"
    check_port_free(
        f"127.0.0.1:{port}",  # machine 0 hosts the store: the port of this machine, whatever address names it
        refusal=LaunchError(
            f"--main_process_port {port} is already in use on this machine (another job, or a launch that has not "
            f"exited); choose a free port{fix}"
        ),
    )


def exit_code(failures: dict, rank: int) -> int:
    """The failed rank's exit code as a shell reports it (128 + N for a signal)."""
    failure = failures.get(rank) or failures[min(failures)]
    return failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode


def processes_per_machine(settings: LaunchSettings) -> int:
    """``--num_processes`` counts every machine's, as in Accelerate; without it, one per GPU named or visible."""
    if settings.num_processes is not None:
        return settings.num_processes // settings.num_machines
    gpus = gpu_count(settings)
    if gpus is not None and not settings.use_cpu:
        return gpus
    from runner.config.run_spec import resolve_num_processes

    return resolve_num_processes("auto", cpu=settings.use_cpu)


def rendezvous_options(settings: LaunchSettings) -> dict:
    """elastic_run's rendezvous: a free local port on one machine, machine 0's address and port with several."""
    if settings.num_machines == 1:
        return {"rdzv_endpoint": f"127.0.0.1:{settings.main_process_port or 0}"}
    port = settings.main_process_port or DEFAULT_MULTI_MACHINE_PORT
    return {
        "rdzv_endpoint": f"{settings.main_process_ip}:{port}",
        "num_nodes": settings.num_machines,
        "node_rank": settings.machine_rank,
        "run_id": MULTI_MACHINE_RUN_ID,
    }


def worker_environment(settings: LaunchSettings) -> dict[str, str]:
    """What the workers' ``Accelerator()`` reads (and CUDA_VISIBLE_DEVICES for ``--gpu_ids``)."""
    # Here, not at the top: importing the engine package imports torch, which `runner launch --help` does not need.
    from runner.engine.constants import MIXED_PRECISION_ENV, USE_CPU_ENV

    environment = {MIXED_PRECISION_ENV: settings.mixed_precision, USE_CPU_ENV: "1" if settings.use_cpu else "0"}
    if settings.gpu_ids not in (None, "all"):
        environment["CUDA_VISIBLE_DEVICES"] = settings.gpu_ids
    return environment
