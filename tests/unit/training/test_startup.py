import json
import logging
import os
import subprocess
import sys
import time

from runner.training import startup


def test_phases_are_the_gaps_between_stamps_inherited_through_the_environment(monkeypatch):
    monkeypatch.setenv(startup.STARTUP_ENV, "spawned=100.0;python start and imports=100.25")
    times = iter([101.0, 103.5])
    monkeypatch.setattr(startup.time, "time", lambda: next(times))
    startup.stamp("check the command line")
    startup.stamp("first optimizer step")
    assert startup.stamps()[-1] == ("first optimizer step", 103.5)
    assert startup.summary() == (
        "Start-up: first optimizer step 3.50 s after the command (python start and imports 0.25 s, "
        "check the command line 0.75 s, first optimizer step 2.50 s)"
    )


def test_the_first_step_is_logged_once_per_run_and_not_after_a_restart(monkeypatch, caplog):
    monkeypatch.setenv(startup.STARTUP_ENV, "python start and imports=1.0")
    with caplog.at_level(logging.INFO, logger="runner"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        startup.log_first_step()
        assert caplog.messages == []
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        startup.log_first_step()
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("Start-up: first optimizer step")


def test_a_foreign_value_reports_nothing(monkeypatch):
    monkeypatch.setenv(startup.STARTUP_ENV, "not=a;number=x")
    assert startup.stamps() == [] and startup.summary() is None


def test_a_command_s_first_stamp_starts_the_record_at_the_process_s_own_start():
    script = ("import time; began = time.time(); from runner.training import startup; startup.stamp('imports'); "
              "import json; print(json.dumps([began, startup.stamps()]))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != startup.STARTUP_ENV}
    before = time.time()
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    began, found = json.loads(result.stdout)
    (first, started), (phase, ended) = found
    assert (first, phase) == ("command", "imports")
    # Before the script's first line ran (the interpreter's start), after this process asked for it (to /proc's ticks).
    assert before - 0.05 <= started <= began <= ended
