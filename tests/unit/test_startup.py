import logging

from runner import startup


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
