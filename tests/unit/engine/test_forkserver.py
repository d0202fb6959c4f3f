"""Workers forked from the preloaded server run in the launching process's environment of the launch; the server and
the launching process end without collecting garbage."""

import multiprocessing
import os
import pickle
import subprocess
import sys

from runner.engine import forkserver


def _environment() -> dict[str, str]:
    return dict(os.environ)


def test_a_forked_worker_takes_the_launch_environment_and_keeps_what_the_agent_set_for_its_rank(monkeypatch):
    server = {"PATH": "/bin", "STALE": "1", "SHARED": "server"}  # when the server started
    launched = {"PATH": "/bin", "SHARED": "launch", "RUNNER_STARTUP": "check=1.0"}  # at the launch, later
    agent = {"RANK": "1", "OMP_NUM_THREADS": "1", "PATH": "/agent/bin"}  # set in the worker for its rank
    monkeypatch.setattr(os, "environ", {**server, **agent})  # what a forked worker holds before it runs
    monkeypatch.setattr(forkserver, "_ENVIRONMENT_AT_IMPORT", server)  # the worker's copy of the module
    got = forkserver._run_in_launch_environment(_environment, launched)
    assert got == {"PATH": "/agent/bin", "SHARED": "launch", "RUNNER_STARTUP": "check=1.0", "RANK": "1",
                   "OMP_NUM_THREADS": "1"}  # fmt: skip


def test_the_entry_is_named_after_the_function_and_pickles_with_the_environment_of_the_call(monkeypatch):
    monkeypatch.setenv("RUNNER_TEST_LAUNCH", "at the call")
    entry = forkserver.entry(_environment)
    monkeypatch.setenv("RUNNER_TEST_LAUNCH", "changed after")
    assert entry.__name__ == "_environment"  # torch's agent names the job after it
    restored = pickle.loads(pickle.dumps(entry))  # how the agent hands it to the server
    assert restored.args[1]["RUNNER_TEST_LAUNCH"] == "at the call"


def test_a_forked_worker_starts_its_own_processes_as_a_fresh_process_would(monkeypatch):
    # The server's start method is forkserver, and a worker forked from it inherits it; its DataLoader workers
    # would then start from the server, each unpickling the dataset and importing its modules, every pass.
    default = multiprocessing.context._default_context
    monkeypatch.setattr(default, "_actual_context", multiprocessing.get_context("forkserver"))
    forkserver._run_in_launch_environment(_environment, dict(os.environ))
    assert multiprocessing.get_start_method() == ("forkserver" if sys.version_info >= (3, 14) else "fork")


# Registered first, so it runs after the others: whether the process was frozen when its interpreter began to end.
ENDS_WITHOUT_COLLECTING = """
import atexit, gc, multiprocessing, os
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
from runner.training.startup import skip_collection_at_exit
before = atexit._ncallbacks()
skip_collection_at_exit()
skip_collection_at_exit()
print("exit handlers added:", atexit._ncallbacks() - before)
from runner.engine import forkserver
forkserver.start(preload=())
server = multiprocessing.forkserver._forkserver._forkserver_pid
with multiprocessing.get_context("forkserver").Pool(1) as pool:
    in_server = pool.apply(os.getenv, (forkserver.SERVER_ENV,))
# Read once the server has answered: until it has exec'd Python, /proc shows the environment of this process.
with open(f"/proc/{server}/environ", "rb") as environ:
    print("server started marked:", b"RUNNER_FORKSERVER=1" in environ.read().split(b"\\0"))
print("marked here:", forkserver.SERVER_ENV in os.environ)
print("marked in the server:", in_server)
"""


# A launcher's worker process (a Slurm job's, joblib's) unpickles the task function, and ends as the launcher does.
LAUNCHER_WORKER = """
import atexit, gc, pickle
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
from runner.cli.app import HydraApp
pickle.loads(pickle.dumps(HydraApp()))
"""


def test_the_launching_process_and_the_server_end_without_collecting_garbage():
    # The server took the mark out of its environment where it registered its own gc.freeze; this process kept none.
    done = subprocess.run([sys.executable, "-c", ENDS_WITHOUT_COLLECTING], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "exit handlers added: 1", "server started marked: True", "marked here: False", "marked in the server: None",
        "frozen at exit: True",
    ]  # fmt: skip
    worker = subprocess.run([sys.executable, "-c", LAUNCHER_WORKER], capture_output=True, text=True, timeout=120)
    assert (worker.returncode, worker.stdout) == (0, "frozen at exit: True\n"), worker.stderr[-3000:]
