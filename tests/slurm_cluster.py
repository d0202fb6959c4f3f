"""A real Slurm cluster on this machine, for the tests and for contributors: one controller, one node, munge.

    python -m tests.slurm_cluster start /tmp/cluster     # prints the SLURM_CONF line to export
    SLURM_CONF=/tmp/cluster/slurm.conf sbatch --wrap hostname
    python -m tests.slurm_cluster stop /tmp/cluster

Four nodes are emulated, each a ``slurmd -N NAME`` on a port of its own (all on this machine's cores): in the
default partition ``debug``, this machine's own name and ``localhost``, two names that resolve, so a job may span
two nodes (``-N 2``, ``hydra.launcher.nodes=2``); in the partition ``unresolved``, ``n1`` and ``n2``, names that
resolve nowhere (the controller reaches them at 127.0.0.1), as on a cluster whose node names are not in DNS.

Debian's packages (slurmctld, slurmd, slurm-client, munge) are installed where they are missing. Nothing is
started through systemd and nothing outside the folder is written: munged listens on a socket in the folder, the
controller's state, the node's spool, the logs and the PID files are there too, and the daemons are stopped by
the PIDs they wrote. Slurm 22.05's defaults are tightened where tests would wait: a requeued job may start again
after about 10 s (``cred_expire=10``) rather than 121 s, and the scheduler looks every 2 s.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")


class ClusterUnavailable(RuntimeError):
    """The cluster cannot start on this machine; the message says why."""


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def install() -> None:
    """Install Debian's Slurm and munge packages if their programs are missing.

    Raises:
        ClusterUnavailable: Not root, no apt-get, or the packages could not be installed.
    """
    if all(shutil.which(program) for program in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterUnavailable("Slurm is not installed, and installing Debian's packages needs root and apt-get")
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
        env=environment, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise ClusterUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {done.stderr.strip()[-500:]}")


class SlurmCluster:
    """The cluster whose configuration, state and logs live in ``folder``."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder).absolute()
        self.conf = self.folder / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]  # slurmd's own name for this machine
        self.nodes = {"debug": [self.node, "localhost"], "unresolved": ["n1", "n2"]}  # partition -> node names

    @property
    def environment(self) -> dict[str, str]:
        """What a command needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Write the configuration, start munged, slurmctld and slurmd, and wait until the node is idle.

        Raises:
            ClusterUnavailable: Not root, the packages are missing and cannot be installed, or a daemon did not
                start (its log is named).
        """
        if os.geteuid() != 0:
            raise ClusterUnavailable("slurmd runs jobs as their users, so the test cluster needs root")
        install()
        for name in ("state", "spool"):
            (self.folder / name).mkdir(parents=True, exist_ok=True)
        names = [name for names in self.nodes.values() for name in names]
        controller, *ports = _free_ports(1 + len(names))
        self.conf.write_text(self._configuration(controller, dict(zip(names, ports, strict=True))))
        self._run(
            "munged", "--force", f"--socket={self.folder / 'munge.socket'}", "--key-file=/etc/munge/munge.key",
            f"--pid-file={self.folder / 'munged.pid'}", f"--log-file={self.folder / 'munged.log'}",
            f"--seed-file={self.folder / 'munge.seed'}",
        )  # fmt: skip
        self._run("slurmctld", "-c")  # -c: a fresh controller state, whatever the folder held
        for name in names:
            self._run("slurmd", "-c", "-N", name)
        deadline = time.monotonic() + timeout
        while set(self.node_state().split()) != {"idle"}:
            if time.monotonic() > deadline:
                self.stop()
                raise ClusterUnavailable(f"the node is {self.node_state()!r}, not idle; see {self.folder}/*.log")
            time.sleep(0.2)
        return self

    def stop(self) -> None:
        """Cancel every job and stop the daemons by their PIDs; the folder stays (its logs)."""
        if self.conf.exists() and self._pid("slurmctld") is not None and _alive(self._pid("slurmctld")):
            subprocess.run(["scancel", "--full", "--user", "root"], env=self._env(), capture_output=True)
            deadline = time.monotonic() + 30  # each job's processes end before the daemons that watch them
            while self._jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        # The nodes' daemons together, then the controller and munge, which they report to, together.
        self._terminate([f"slurmd-{name}" for names in self.nodes.values() for name in names])
        self._terminate(["slurmctld", "munged"])

    def _terminate(self, daemons: list[str]) -> None:
        """SIGTERM to each daemon at once; SIGKILL to any still alive 10 s later."""
        pids = []
        for daemon in daemons:
            pid = self._pid(daemon)
            try:
                if pid is not None:
                    os.kill(pid, signal.SIGTERM)
                    pids.append(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in filter(_alive, pids):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def _jobs(self) -> list[str]:
        done = subprocess.run(["squeue", "-h", "-o", "%i %T"], env=self._env(), capture_output=True, text=True)
        return [line for line in done.stdout.splitlines() if line.strip() and "COMPLET" not in line]

    def node_state(self) -> str:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self._env(), capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else f"unreachable ({done.stderr.strip()[-200:]})"

    def job_state(self, job_id: str) -> str:
        """A job's state as the controller knows it (slurmctld keeps ended jobs for MinJobAge=300 s)."""
        done = subprocess.run(
            ["scontrol", "show", "job", job_id, "-o"], env=self._env(), capture_output=True, text=True
        )
        fields = dict(field.split("=", 1) for field in done.stdout.split() if "=" in field)
        return fields.get("JobState", "UNKNOWN")

    def _configuration(self, controller: int, ports: dict[str, int]) -> str:
        folder = self.folder
        cpus = os.cpu_count() or 1
        memory = max(1024, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2 - 1024)
        nodes = "".join(
            f"NodeName={name} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory={memory} State=UNKNOWN\n"
            for name, port in ports.items()
        )
        partitions = "".join(
            f"PartitionName={partition} Nodes={','.join(names)} Default={'YES' if partition == 'debug' else 'NO'} "
            "MaxTime=INFINITE State=UP\n"
            for partition, names in self.nodes.items()
        )
        return f"""\
ClusterName=runnertests
SlurmctldHost={self.node}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={controller}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder / "munge.socket"},cred_expire=10
StateSaveLocation={folder / "state"}
SlurmdSpoolDir={folder / "spool" / "%n"}
SlurmctldPidFile={folder / "slurmctld.pid"}
SlurmdPidFile={folder / "slurmd-%n.pid"}
SlurmctldLogFile={folder / "slurmctld.log"}
SlurmdLogFile={folder / "slurmd-%n.log"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
ReturnToService=2
SchedulerParameters=sched_interval=2
KillWait=30
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
{nodes}{partitions}"""

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.environment}

    def _run(self, *command: str) -> None:
        done = subprocess.run(command, env=self._env(), capture_output=True, text=True)
        if done.returncode != 0:
            self.stop()
            raise ClusterUnavailable(f"{command[0]} did not start: {(done.stderr or done.stdout).strip()[-500:]}")

    def _pid(self, daemon: str) -> int | None:
        try:
            return int((self.folder / f"{daemon}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        sys.exit("usage: python -m tests.slurm_cluster start|stop FOLDER")
    cluster = SlurmCluster(sys.argv[2])
    if sys.argv[1] == "stop":
        cluster.stop()
    else:
        try:
            cluster.start()
        except ClusterUnavailable as error:
            sys.exit(f"the Slurm cluster did not start: {error}")
        print(f"export SLURM_CONF={cluster.conf}")
