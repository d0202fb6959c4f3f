"""``python -m MODULE ARGS`` for the tests, each command forked from an interpreter that has already imported torch.

A fresh ``python -m runner`` spends seconds importing torch, torch._dynamo, torchmetrics, Hydra and the runner
before it reads its command line, and the end-to-end tests start hundreds of them. :func:`run_module` hands the
command to a server of this test process instead: an interpreter started once (this file, run as a script) that
imports those modules and then forks a child per command. The child becomes what ``python -m MODULE ARGS`` would
be: the command's working directory, environment (its ``PYTHONPATH`` on ``sys.path`` and ``OMP_NUM_THREADS``
threads), standard streams, ``sys.argv`` and ``__main__``; it runs the module as ``python -m`` does and exits as
an interpreter does (non-daemon threads joined, ``atexit`` handlers run, an uncaught exception printed with exit
code 1). The runner's own worker forkserver starts its workers the same way (``runner.engine.forkserver``), and
each child starts that forkserver by forking it from itself before the command runs, so a multi-process run's
workers start in a fraction of a second instead of after a fresh interpreter has imported torch.

What a child cannot be is an interpreter started from scratch: tests of the interpreter's start (``-X
importtime``, what ``--help`` imports) and of ``torchrun`` start a real one. Nor can it change what a library
read from the environment when the server imported it (Hugging Face's cache folders, libgomp's settings): those
are the test process's environment of the moment the server started, which the session's fixtures set first.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

# What a run imports before its first step (the launching process and, forked, its workers) and at its end (its
# curves.png), and what the Hugging Face presets add where the extras are installed (torchmetrics has imported
# transformers already, if it is).
PRELOAD = ("torch", "torch._dynamo", "torchmetrics", "hydra", "omegaconf", "runner.cli", "runner.cli.app",
           "runner.engine.accelerator", "runner.launch.worker", "runner.training.loop", "tensorboard",
           "safetensors.torch", "matplotlib.figure", "matplotlib.backends.backend_agg",
           "tensorboard.backend.event_processing.event_file_loader")  # fmt: skip
PRELOAD_IF_INSTALLED = ("transformers.models.gpt2.modeling_gpt2", "datasets", "peft")


class _Server:
    """The client side: one server process per test process, started on first use, stopped at exit."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.folder = Path()  # its socket and the commands' captured streams, made with the server

    @property
    def address(self) -> str:
        return str(self.folder / "socket")

    def ensure_running(self) -> None:
        with self.lock:
            if self.process is not None and self.process.poll() is None:
                return
            self.folder = Path(tempfile.mkdtemp(prefix="runner-preloaded-"))
            env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}
            self.process = subprocess.Popen(
                [sys.executable, __file__, self.address], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
            )
            ready = self.process.stdout.readline()
            if ready.strip() != b"ready":
                raise RuntimeError(f"the preloaded interpreter did not start (it said {ready!r})")
            atexit.register(self.stop)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.folder != Path():
            shutil.rmtree(self.folder, ignore_errors=True)


_SERVER = _Server()


class Launched:
    """A command the server forked, as a :class:`subprocess.Popen` with both streams piped would be seen: its
    ``pid`` (signals reach it, and its own children are its), ``poll``, ``wait``, ``communicate``, ``send_signal``,
    ``kill`` and ``returncode``."""

    def __init__(
        self, module: str, args: tuple[str, ...], *, cwd: Path | str, env: dict[str, str], host: Host | None = None
    ) -> None:
        _SERVER.ensure_running()
        self.args = ["python", "-m", module, *args]
        self.returncode: int | None = None
        self._streams = tempfile.TemporaryDirectory(dir=_SERVER.folder)
        self._out, self._err = Path(self._streams.name) / "stdout", Path(self._streams.name) / "stderr"
        request = {"module": module, "argv": list(args), "cwd": str(cwd), "env": env, "stdout": str(self._out),
                   "stderr": str(self._err), "host": host._asdict() if host else None}  # fmt: skip
        self._connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._connection.connect(_SERVER.address)
        self._connection.sendall(json.dumps(request).encode() + b"\n")
        self._replies = self._connection.makefile("rb", buffering=0)  # byte by byte: poll() sees what is unread
        self.pid: int = json.loads(self._replies.readline())["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            readable, _, _ = select.select([self._connection], [], [], 0)
            if readable:
                self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._connection.settimeout(timeout)
            try:
                reply = self._replies.readline()
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            if not reply:
                raise RuntimeError(f"the preloaded interpreter ended before the command {self.args} did")
            status = json.loads(reply)["status"]
            self.returncode = os.waitstatus_to_exitcode(status)
            self._connection.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the end; return stdout and stderr (TimeoutExpired with what they hold so far)."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired as expired:
            expired.output, expired.stderr = self._out.read_text(), self._err.read_text()
            raise
        streams = self._out.read_text(), self._err.read_text()
        self._streams.cleanup()
        return streams

    @property
    def stderr_path(self) -> Path:
        """Where the command's standard error goes, as it writes it (until :meth:`communicate` returns)."""
        return self._err

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Host(NamedTuple):
    """Where a command runs as ``ip netns exec NAMESPACE [unshare --uts sh -c 'hostname HOSTNAME && ...']`` would run
    it: in the network namespace (and its /etc/netns/NAMESPACE files over /etc), with a hostname of its own if one is
    given; the command is the leader of a session of its own."""

    namespace: str
    hostname: str | None = None


def start_module(module: str, *args: str, cwd: Path | str, env: dict[str, str], host: Host | None = None) -> Launched:
    """Start ``python -m module *args`` in ``cwd`` with exactly the environment ``env`` (on ``host``, where given);
    return at once."""
    return Launched(module, args, cwd=cwd, env=env, host=host)


def run_module(
    module: str, *args: str, cwd: Path | str, env: dict[str, str], timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``python -m module *args`` in ``cwd`` with exactly the environment ``env``, as ``subprocess.run(...,
    capture_output=True, text=True, timeout=timeout)`` would run it: the finished process, or TimeoutExpired
    once the command has been killed."""
    command = start_module(module, *args, cwd=cwd, env=env)
    try:
        stdout, stderr = command.communicate(timeout)
    except subprocess.TimeoutExpired:
        command.kill()
        command.communicate()
        raise
    return subprocess.CompletedProcess(command.args, command.returncode, stdout, stderr)


# The server: this file run as a script.


def _serve(address: str) -> dict:
    """Accept commands and fork a child for each; return the command in the child (never in the server)."""
    for name in PRELOAD:
        __import__(name)
    for name in PRELOAD_IF_INSTALLED:
        with contextlib.suppress(ImportError):
            __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    watched = selectors.DefaultSelector()
    watched.register(listener, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection its status goes to
    parent = os.getppid()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    while os.getppid() == parent:
        for _ in watched.select(timeout=0.05 if waiting else 1.0):
            connection, _ = listener.accept()
            line = connection.makefile("r").readline()
            if not line:  # the test process went away before it sent the command
                connection.close()
                continue
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                watched.close()
                listener.close()
                for other in waiting.values():
                    other.close()
                connection.close()
                return request
            waiting[pid] = connection
            _reply(connection, {"pid": pid})
        for pid in list(waiting):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                connection = waiting.pop(pid)
                _reply(connection, {"status": status})
                connection.close()
    sys.exit(0)  # the test process is gone


def _reply(connection: socket.socket, message: dict) -> None:
    # OSError: the test that asked has gone (killed, or timed out); the command still runs to its end.
    with contextlib.suppress(OSError):
        connection.sendall(json.dumps(message).encode() + b"\n")


def _become(request: dict, base_path: list[str]) -> None:
    """In the child: take the command's streams, folder, environment, ``sys.path`` and threads, then run it."""
    import io
    import runpy

    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
        opened = os.open(path, flags | os.O_CLOEXEC, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    if request["host"]:
        _enter(Host(**request["host"]))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False) if unbuffered else io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
        encoding="utf-8", write_through=unbuffered,
    )  # fmt: skip
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True,
        write_through=True,
    )  # fmt: skip
    # As the interpreter builds it: the working directory (``python -m``), then PYTHONPATH, then the rest.
    extra = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]
    sys.path[:] = [os.getcwd(), *extra, *base_path]
    import importlib

    importlib.invalidate_caches()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdecimal() and int(threads) > 0:
        # torch sized its thread pool when the server imported it; a fresh interpreter reads OMP_NUM_THREADS.
        sys.modules["torch"].set_num_threads(int(threads))
    _start_forkserver()
    sys.argv = [request["module"], *request["argv"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def _enter(host: Host) -> None:
    """In the child, once its streams are the command's (so that a failure here is in its stderr): what ``ip netns
    exec`` (and ``unshare --uts``, ``hostname``, ``setsid``) would have done to a fresh process. Needs root, as the
    namespaces do."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
    MS_BIND, MS_REC, MS_SLAVE = 0x1000, 0x4000, 0x80000

    def checked(result: int, what: str) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{what}: {os.strerror(error)}")

    os.setsid()
    namespace = os.open(f"/run/netns/{host.namespace}", os.O_RDONLY | os.O_CLOEXEC)
    checked(libc.setns(namespace, CLONE_NEWNET), f"setns to {host.namespace}")
    os.close(namespace)
    # A mount namespace of its own, whose mounts this machine's do not see, with the namespace's /etc files on top.
    checked(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    checked(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "make / a slave mount")
    own = Path("/etc/netns") / host.namespace
    for path in sorted(own.iterdir()) if own.is_dir() else ():
        target = f"/etc/{path.name}".encode()
        checked(libc.mount(str(path).encode(), target, b"none", MS_BIND, None), f"bind {path} over /etc")
    if host.hostname:
        checked(libc.unshare(CLONE_NEWUTS), "unshare the UTS namespace")
        socket.sethostname(host.hostname)


def _start_forkserver() -> None:
    """In the child: start the run's forkserver (:mod:`runner.launch.preload`) now, forked from here, so that a
    run starting workers finds it running instead of spawning an interpreter that imports torch for seconds.

    It is the server multiprocessing would start: a process with the run's modules imported, this command's
    environment (runner.engine.forkserver's snapshot of it taken there, as its first import would), folder,
    ``sys.path`` and standard streams, holding only its listening socket and the read end of the "alive" pipe,
    running :func:`multiprocessing.forkserver.main` until this command and its workers have all exited. A
    command that starts no workers leaves it idle.
    """
    from multiprocessing import connection, forkserver

    from runner.launch.preload import PRELOAD as RUN_PRELOAD

    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            keep = {0, 1, 2, listener.fileno(), alive_r}
            for fd in map(int, os.listdir("/proc/self/fd")):
                if fd not in keep:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            import runner.engine.forkserver as run_forkserver

            run_forkserver._ENVIRONMENT_AT_IMPORT = dict(os.environ)
            forkserver.main(listener.fileno(), alive_r, list(RUN_PRELOAD), sys_path=list(sys.path))
        finally:
            os._exit(0)
    listener.close()
    os.close(alive_r)
    server = forkserver._forkserver
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    server._preload_modules = list(RUN_PRELOAD)


if __name__ == "__main__":
    # The server's own folder and PYTHONPATH are not the command's: each child puts its own in front.
    server_paths = {os.path.dirname(os.path.abspath(__file__)), *os.environ.get("PYTHONPATH", "").split(os.pathsep)}
    base = [path for path in sys.path if path and path not in server_paths]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in pytest reaches the commands, not the server
    command = _serve(sys.argv[1])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _become(command, base)
