import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from runner.config import ConfigError
from runner.launch.lock import LOCK_NAME, RunLock, is_locked


def test_the_lock_records_its_holder_is_reentrant_and_is_left_empty_when_released(tmp_path):
    run = tmp_path / "run"
    outer = RunLock(run).acquire()
    inner = RunLock(run).acquire()  # the launching process takes it again in main(): no deadlock
    holder = json.loads((run / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and is_locked(run)
    inner.release()
    assert is_locked(run)  # still held by the outer holder
    outer.release()
    assert (run / LOCK_NAME).read_text() == "" and not is_locked(run)


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    (tmp_path / LOCK_NAME).write_text('{"pid": 999999, "host": "gone", "since": 0}')
    with RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_is_left_as_it_was(tmp_path):
    yours = tmp_path / "notes.txt"
    yours.write_text("a file of yours\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(yours)
    with pytest.raises(ConfigError) as refused:
        RunLock(run).acquire()
    assert str(refused.value) == (
        f"{run / LOCK_NAME} is a symbolic link (to {yours}); a run folder holds no links, so remove it or copy the run "
        "with links resolved (cp -rL)."
    )
    assert yours.read_text() == "a file of yours\n"  # not truncated, not written
    assert not is_locked(run)  # a link is no lock of ours, and checking it takes nothing


def test_a_dangling_lock_link_is_refused_and_creates_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(tmp_path / "made-by-the-lock")  # opening it to create it would create this
    with pytest.raises(ConfigError, match=r"is a symbolic link \(to .*made-by-the-lock\)"):
        RunLock(run).acquire()
    assert not (tmp_path / "made-by-the-lock").exists()


def test_a_lock_that_is_a_hard_link_is_refused_and_its_other_name_is_left_as_it_was(tmp_path):
    yours = tmp_path / "notes.txt"
    yours.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    os.link(yours, run / LOCK_NAME)
    with pytest.raises(ConfigError) as error:
        RunLock(run).acquire()
    assert str(error.value) == (
        f"{run / LOCK_NAME} has other names (it is a hard link to a file elsewhere); a run folder holds no links, so "
        "remove it."
    )
    assert yours.read_text() == "keep me"


def test_a_forked_child_does_not_hold_the_lock_once_its_parent_is_gone(tmp_path):
    run = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from runner.launch.lock import RunLock, is_locked
        lock = RunLock({str(run)!r}).acquire()
        child = os.fork()
        if child == 0:  # the trackers' helper or a loader worker, finishing after the run died
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1), os.dup2(null, 2)  # the test reads the parent's output up to its end
            lock.release()  # the child's copy: the parent's lock stays held
            open({str(tmp_path / "released")!r}, "w").close()
            time.sleep(60)
            os._exit(0)
        while not os.path.exists({str(tmp_path / "released")!r}):
            time.sleep(0.01)
        print(child, is_locked(lock.path.parent), flush=True)
        os._exit(0)  # the run dies without releasing
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    child, held = result.stdout.split()
    try:
        assert held == "True"  # while the run lived
        os.kill(int(child), 0)  # still running
        assert not is_locked(run)
        with RunLock(run):  # the next run takes the folder at once
            assert is_locked(run)
    finally:
        os.kill(int(child), signal.SIGKILL)
