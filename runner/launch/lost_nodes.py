"""A run on several nodes that loses one: every node ends, within a bound, in one sentence naming what was lost.

A lost node (its link down for good, the machine gone) stops the others in two places. The ranks wait in a
collective: the process group's timeout (``trainer.rdzv_timeout`` on several nodes, see
:func:`runner.launch.worker.build_accelerator`) fails them. Then each node's torch agent restarts its workers and
waits in a new round of the rendezvous for the lost node: node 0, which hosts the rendezvous, gives up after
``trainer.rdzv_timeout`` (``RendezvousTimeoutError``); a node cut off from node 0 blocks in a call to node 0's store,
which torch's TCPStore client does not bound after its first timeout (the kernel's TCP retransmissions end it after
about 15 minutes). :class:`NodeWatch` bounds that: once a worker of this node failed and none started again within
``trainer.rdzv_timeout`` plus a margin, the launcher writes the sentence and ends the process.

The workers tell their launcher through a folder of its own (:data:`FOLDER_ENV`, on this machine): ``started`` and
``failed`` are touched by every worker as it starts and as it fails, and ``nodes.json`` holds every node's host
name, gathered by the ranks once their group is up, so that node 0 can name the node it lost.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger("runner")

FOLDER_ENV = "RUNNER_NODE_WATCH_DIR"
# A healthy agent starts the workers again within the rendezvous timeout after a failure; this is what it may
# take beyond it (torch's 5 s to leave a timed-out round, keep-alive expiry, forking the workers).
MARGIN_S = 15


def worker_started() -> None:
    """In a worker: tell this node's launcher, where it watches (a launch on several nodes), that its workers run."""
    _touch("started")


def worker_failed() -> None:
    """In a worker: tell this node's launcher, where it watches, that a worker failed."""
    _touch("failed")


def record_hosts(node_rank: int) -> None:
    """In every worker, once the process group is up: where the launchers watch (on every node alike), every node's
    host name by its ``trainer.node_rank`` (a collective), written by each node's local rank 0 for its launcher."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder:
        return
    from runner.engine.ops import gather_object

    hosts = dict(gather_object([(node_rank, socket.gethostname())]))
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        staged = Path(folder) / "nodes.json.tmp"
        staged.write_text(json.dumps({str(rank): host for rank, host in sorted(hosts.items())}))
        staged.replace(Path(folder) / "nodes.json")


def _touch(name: str) -> None:
    folder = os.environ.get(FOLDER_ENV)
    if folder:
        try:
            (Path(folder) / name).write_text(str(time.time_ns()))
        except OSError:  # the launcher is gone: nothing to tell
            pass


class NodeWatch:
    """This node's part of a launch on several nodes: the folder its workers report to, the sentence it ends with
    when it lost the others, and (as a context manager) the watch that ends the launcher when torch's agent would
    wait for a lost node without bound."""

    def __init__(self, trainer: Any, project_dir: str) -> None:
        self.node_rank = int(trainer["node_rank"])
        self.endpoint = str(trainer["rdzv_endpoint"])
        self.timeout = int(trainer["rdzv_timeout"])
        self.project_dir = project_dir
        self.folder = Path(tempfile.mkdtemp(prefix="runner-node-"))
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="runner-node-watch", daemon=True)

    @property
    def environment(self) -> dict[str, str]:
        return {FOLDER_ENV: str(self.folder)}

    def __enter__(self) -> NodeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()
        shutil.rmtree(self.folder, ignore_errors=True)

    def _watch(self) -> None:
        waiting_since = None
        while not self._done.wait(1.0):
            if not self._waits_after_failure():
                waiting_since = None
                continue
            waiting_since = waiting_since or time.monotonic()
            if time.monotonic() - waiting_since > self.timeout + MARGIN_S:
                self._give_up(time.monotonic() - waiting_since)

    def _waits_after_failure(self) -> bool:
        """Whether a worker failed and none started since."""
        failed, started = self._stamp("failed"), self._stamp("started")
        return failed is not None and (started is None or started < failed)

    def _stamp(self, name: str) -> int | None:
        try:
            return int((self.folder / name).read_text())
        except (OSError, ValueError):
            return None

    def _give_up(self, waited: float) -> None:
        """End this launcher now: its main thread is blocked in torch's agent, in a call to a store that no longer
        answers, and cannot be interrupted. The workers have ended; every checkpoint is committed or not at all."""
        waited_for = f"this node's workers failed and no new round of the rendezvous began within {waited:.0f} s"
        message = self.sentence(waited_for)
        logger.error(message)
        _stop_helpers()
        print(f"runner: error: {message}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)

    @property
    def workers_started(self) -> bool:
        """Whether this node's workers started at least once (the nodes met)."""
        return self._stamp("started") is not None

    def never_met(self, num_nodes: int) -> str:
        """One sentence for a first rendezvous that did not gather every node in time."""
        return (
            f"node {self.node_rank} ({socket.gethostname()}): not every node joined the rendezvous at "
            f"trainer.rdzv_endpoint={self.endpoint} within trainer.rdzv_timeout={self.timeout} s; start all "
            f"{num_nodes} nodes (trainer.node_rank=0 to {num_nodes - 1}) with the same trainer.rdzv_endpoint and "
            "project.project_dir, or give a larger trainer.rdzv_timeout."
        )

    def sentence(self, what: str) -> str:
        """One sentence: which node this is, which it lost and how, the run's newest intact checkpoint and how to
        continue from it."""
        from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint

        newest, _ = newest_intact_checkpoint(checkpoints_dir(self.project_dir), verify_checksums=False)
        saved = f"{newest.name} is the run's newest intact checkpoint" if newest else "no checkpoint was completed"
        return (
            f"node {self.node_rank} ({socket.gethostname()}) lost {self._lost()}: {what} "
            f"(trainer.rdzv_timeout={self.timeout}); {saved}; once the nodes reach each other again, continue with "
            f"`python -m runner resume={self.project_dir} trainer.node_rank=N` on each node N."
        )

    def _lost(self) -> str:
        """The nodes this one cannot reach: node 0, the rendezvous host, from any other; the others from node 0."""
        try:
            hosts = json.loads((self.folder / "nodes.json").read_text())
        except (OSError, ValueError):
            hosts = {}
        if self.node_rank != 0:
            named = hosts.get("0")
            return f"node 0 ({named + ', ' if named else ''}the rendezvous host trainer.rdzv_endpoint={self.endpoint})"
        others = [f"node {rank} ({host})" for rank, host in hosts.items() if rank != "0"]
        if not others:
            return "the other nodes"
        return others[0] if len(others) == 1 else "one or more of " + ", ".join(others)


def _stop_helpers(wait_s: float = 5.0) -> None:
    """End this launcher's helper processes before it ends: the forkserver, then multiprocessing's resource tracker,
    each asked by closing the pipe it watches (as their own ``_stop`` does, but waiting a bounded time). The tracker
    reports what the agent left behind as it ends; that comes before the launcher's sentence, not after it."""
    from multiprocessing import forkserver, resource_tracker

    helpers = (
        (forkserver._forkserver, "_forkserver_alive_fd", "_forkserver_pid"),
        (resource_tracker._resource_tracker, "_fd", "_pid"),
    )
    for helper, fd_name, pid_name in helpers:
        fd, pid = getattr(helper, fd_name, None), getattr(helper, pid_name, None)
        if fd is None or pid is None:
            continue
        try:
            os.close(fd)
            setattr(helper, fd_name, None)
            deadline = time.monotonic() + wait_s
            while os.waitpid(pid, os.WNOHANG) == (0, 0) and time.monotonic() < deadline:
                time.sleep(0.05)
        except OSError:  # already gone
            pass
