"""Every test process signs its runs with a key of its own, never the key in the user's home, and keeps
Hugging Face's caches in a folder of its own, offline. Tests that launch processes are marked ``slow``:
``python -m pytest -m "not slow"`` is the quick tier for the edit loop; the whole suite is what CI runs."""

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# What starts whole runs, worker groups or benchmarks: e2e's `python -m runner`, distributed's gloo groups.
SLOW = {"e2e", "distributed", "test_bench.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(item.path).relative_to(TESTS).parts[0] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="session")
def _signing_key_of_the_test_session(tmp_path_factory):
    previous = os.environ.get("RUNNER_HOME")
    os.environ["RUNNER_HOME"] = str(tmp_path_factory.mktemp("runner_home"))  # inherited by every command run
    yield
    if previous is None:
        os.environ.pop("RUNNER_HOME", None)
    else:
        os.environ["RUNNER_HOME"] = previous


@pytest.fixture(autouse=True, scope="session")
def _hugging_face_offline_in_a_folder_of_its_own(tmp_path_factory):
    # datasets caches every .map in HF_HOME; nothing may reach for the Hub (these machines have no network).
    settings = {"HF_HOME": str(tmp_path_factory.mktemp("hf_home")), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)  # inherited by every command run
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
