import json
import os

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
