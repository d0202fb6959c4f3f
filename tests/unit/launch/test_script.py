"""What runner launch hands torch's elastic launcher: the interpreter and the script as the entry point, the
workers' environment (what their Accelerator() reads), the rendezvous, the processes per machine; and the exit code
and one sentence when a rank fails. The launcher itself is replaced here; tests/e2e/test_launch_script.py runs it."""

import os
import signal
import socket
import sys

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from runner.engine.constants import MIXED_PRECISION_ENV, USE_CPU_ENV
from runner.launch import script
from runner.launch.script import ScriptCommand
from runner.launch.settings import LaunchSettings


def test_the_workers_environment_carries_precision_cpu_and_gpus():
    assert script.worker_environment(LaunchSettings()) == {MIXED_PRECISION_ENV: "no", USE_CPU_ENV: "0"}
    environment = script.worker_environment(LaunchSettings(mixed_precision="bf16", use_cpu=True, gpu_ids="1,3"))
    assert environment == {MIXED_PRECISION_ENV: "bf16", USE_CPU_ENV: "1", "CUDA_VISIBLE_DEVICES": "1,3"}
    assert "CUDA_VISIBLE_DEVICES" not in script.worker_environment(LaunchSettings(gpu_ids="all"))


def test_one_machine_takes_a_free_local_port_unless_one_is_given():
    assert script.rendezvous_options(LaunchSettings()) == {"rdzv_endpoint": "127.0.0.1:0"}
    # An address in the file is machine 0's, for several machines; one machine always meets on itself.
    settings = LaunchSettings(main_process_ip="10.0.0.1", main_process_port=29501)
    assert script.rendezvous_options(settings) == {"rdzv_endpoint": "127.0.0.1:29501"}


def test_several_machines_meet_at_machine_0_with_this_machines_rank():
    settings = LaunchSettings(num_processes=8, num_machines=2, machine_rank=1, main_process_ip="host-a")
    assert script.rendezvous_options(settings) == {
        "rdzv_endpoint": "host-a:29500", "num_nodes": 2, "node_rank": 1, "run_id": script.MULTI_MACHINE_RUN_ID,
    }  # fmt: skip
    assert script.processes_per_machine(settings) == 4  # --num_processes counts every machine's, as in Accelerate


def test_without_num_processes_one_per_gpu_named_or_one_on_the_cpu():
    assert script.processes_per_machine(LaunchSettings(gpu_ids="0,1,2")) == 3
    assert script.processes_per_machine(LaunchSettings(gpu_ids="0,1,2", use_cpu=True)) == 1
    assert script.processes_per_machine(LaunchSettings(use_cpu=True)) == 1


def _launched(monkeypatch, raised=None):
    calls = []

    def elastic_run(entrypoint, args, **options):
        calls.append((entrypoint, args, options))
        if raised is not None:
            raise raised
        return {0: None, 1: None}

    monkeypatch.setattr("runner.engine.launchers.elastic_run", elastic_run)
    return calls


def test_the_entry_point_is_this_python_running_the_script(monkeypatch):
    calls = _launched(monkeypatch)
    command = ScriptCommand(LaunchSettings(num_processes=2, mixed_precision="fp16", max_restarts=1), "t.py", ("-x",))
    assert script.launch_script(command) == 0
    (entrypoint, args, options), = calls  # fmt: skip
    assert (entrypoint, args) == (sys.executable, ("-u", "t.py", "-x"))
    assert options == {
        "num_processes": 2, "environment": {MIXED_PRECISION_ENV: "fp16", USE_CPU_ENV: "0"}, "max_restarts": 1,
        "rdzv_endpoint": "127.0.0.1:0",
    }  # fmt: skip


def _failure(tmp_path, local_rank, exitcode):
    return ProcessFailure(
        local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, error_file=str(tmp_path / "no")
    )


@pytest.mark.parametrize(
    ("failures", "code", "sentence"),
    [
        ({1: (1, 3)}, 3, "worker rank 1 failed with exit code 3; its output is above."),
        ({0: (0, 1), 1: (1, 2)}, 1, "worker rank 0 failed with exit code 1; its output is above."),
        ({1: (1, -9)}, 137, "worker rank 1 failed with exit code 137 (Signal 9 (SIGKILL) received by PID 101); its "
                            "output is above."),
    ],
)  # fmt: skip
def test_a_failed_rank_is_its_exit_code_and_one_sentence(monkeypatch, capsys, tmp_path, failures, code, sentence):
    failures = {rank: _failure(tmp_path, local, exitcode) for rank, (local, exitcode) in failures.items()}
    _launched(monkeypatch, raised=ChildFailedError("python", failures))
    assert script.launch_script(ScriptCommand(LaunchSettings(num_processes=2), "t.py")) == code
    assert capsys.readouterr().err == f"runner launch: error: {sentence}\n"


def test_a_stop_signal_stops_with_128_plus_its_number(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _launched(monkeypatch, raised=SignalException("stop", sigval=15))
    assert script.launch_script(ScriptCommand(LaunchSettings(), "t.py")) == 143
    assert capsys.readouterr().err == "runner launch: stopped by SIGTERM, with every worker.\n"


def test_a_rendezvous_that_times_out_is_one_sentence(monkeypatch, capsys):
    from torch.distributed import DistNetworkError

    _launched(monkeypatch, raised=DistNetworkError("The client socket has timed out after 900000ms"))
    settings = LaunchSettings(num_processes=4, num_machines=2, machine_rank=1, main_process_ip="host-a")
    assert script.launch_script(ScriptCommand(settings, "t.py")) == 1
    assert capsys.readouterr().err == (
        "runner launch: error: the processes did not meet at host-a:29500 (The client socket has timed out after "
        "900000ms); check --main_process_ip and --main_process_port, and that every machine was started.\n"
    )


@pytest.mark.usefixtures("config_home")
@pytest.mark.parametrize("machines", [[], ["--num_machines", "2", "--main_process_ip", "host-a"]])
def test_a_main_process_port_in_use_here_is_exit_code_2_before_anything_starts(monkeypatch, capsys, tmp_path, machines):
    from runner.launch.commands import run_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    calls = _launched(monkeypatch)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert run_command("launch", ["--main_process_port", str(port), *machines, "t.py"]) == 2
    fix = ", or leave it out to take a free one" if not machines else " and give it to every machine"
    assert capsys.readouterr().err == (
        f"runner launch: error: --main_process_port {port} is already in use on this machine (another job, or a "
        f"launch that has not exited); choose a free port{fix}.\n"
    )
    assert calls == []


def test_sigusr1_stops_the_workers_as_sigterm_does(monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def agent_stops_on_sigterm(*_):  # what torch's agent does with SIGTERM
        raise SignalException("stop", sigval=signal.SIGTERM)

    def elastic_run(entrypoint, args, **options):
        os.kill(os.getpid(), signal.SIGUSR1)  # what Slurm sends before the time limit
        raise AssertionError("SIGUSR1 did not reach the agent as SIGTERM")

    monkeypatch.setattr("runner.engine.launchers.elastic_run", elastic_run)
    before = signal.getsignal(signal.SIGUSR1)
    previous_sigterm = signal.signal(signal.SIGTERM, agent_stops_on_sigterm)
    try:
        assert script.launch_script(ScriptCommand(LaunchSettings(), "t.py")) == 143
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    assert capsys.readouterr().err == "runner launch: stopped by SIGTERM, with every worker.\n"
    assert signal.getsignal(signal.SIGUSR1) is before  # restored after the launch
