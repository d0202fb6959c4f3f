"""patch_environment: upper-cased names, string values, the previous environment restored."""

import os

import pytest

from runner.engine.utils import patch_environment


def test_patch_environment_sets_upper_cased_strings_and_restores_the_previous_values(monkeypatch):
    monkeypatch.setenv("RUNNER_TEST_KEPT", "before")
    monkeypatch.delenv("RUNNER_TEST_NEW", raising=False)
    with patch_environment(runner_test_kept=1, RUNNER_TEST_NEW=2.5):
        assert (os.environ["RUNNER_TEST_KEPT"], os.environ["RUNNER_TEST_NEW"]) == ("1", "2.5")
    assert os.environ["RUNNER_TEST_KEPT"] == "before"
    assert "RUNNER_TEST_NEW" not in os.environ


def test_patch_environment_restores_when_the_block_raises(monkeypatch):
    monkeypatch.delenv("RUNNER_TEST_NEW", raising=False)
    with pytest.raises(RuntimeError), patch_environment(runner_test_new="x"):
        raise RuntimeError("boom")
    assert "RUNNER_TEST_NEW" not in os.environ


def test_flags_from_the_environment_read_as_accelerates(monkeypatch):
    from runner.engine.utils import parse_flag_from_env, str_to_bool

    monkeypatch.setenv("RUNNER_TEST_FLAG", "On")
    assert parse_flag_from_env("RUNNER_TEST_FLAG") is True
    monkeypatch.setenv("RUNNER_TEST_FLAG", "0")
    assert parse_flag_from_env("RUNNER_TEST_FLAG", default=True) is False
    monkeypatch.delenv("RUNNER_TEST_FLAG")
    assert parse_flag_from_env("RUNNER_TEST_FLAG", default=True) is True
    assert (str_to_bool("YES"), str_to_bool("f", to_bool=True)) == (1, False)
    with pytest.raises(ValueError, match=r"invalid truth value 'maybe'; use one of y, yes"):
        str_to_bool("maybe")
