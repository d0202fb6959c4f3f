"""Every test process signs its runs with a key of its own, never the key in the user's home."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _signing_key_of_the_test_session(tmp_path_factory):
    previous = os.environ.get("RUNNER_HOME")
    os.environ["RUNNER_HOME"] = str(tmp_path_factory.mktemp("runner_home"))  # inherited by every command run
    yield
    if previous is None:
        os.environ.pop("RUNNER_HOME", None)
    else:
        os.environ["RUNNER_HOME"] = previous
