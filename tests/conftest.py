"""Every test process signs its runs with a key of its own, never the key in the user's home, and keeps
Hugging Face's caches in a folder of its own, offline. Tests that launch processes are marked ``slow``:
``python -m pytest -m "not slow"`` is the quick tier for the edit loop; the whole suite is what CI runs."""

import os
from pathlib import Path

import pytest

# The test processes run several training processes at once on few cores. OpenMP's idle threads spin by default
# (libgomp, torch's thread pool), taking the cores from the other runs; passive ones sleep. Read when libgomp loads
# (the first import of torch), so it is set here, before any test module imports torch, for every process the
# tests start as well. It changes how threads wait, never what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TESTS = Path(__file__).resolve().parent
# What starts whole runs, worker groups or benchmarks: e2e's `python -m runner`, distributed's gloo groups.
SLOW = {"e2e", "distributed", "test_bench.py"}
# The order test processes take the tests in: the longest first, so that none is left with a long one at the end.
FIRST = ("e2e", "test_bench.py", "distributed", "unit")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark the slow tests; keep the tests that share a module's fixture (a reference run) on one test process
    (``--dist loadgroup``: every other test goes to whichever process is free); put the longest tests first."""
    sharing = {_module(item) for item in items if _uses_a_module_fixture(item)}
    for item in items:
        if _area(item) in SLOW:
            item.add_marker(pytest.mark.slow)
        # A test may also ask for the module's fixture by name (request.getfixturevalue).
        if _module(item) in sharing and (_uses_a_module_fixture(item) or "request" in item.fixturenames):
            item.add_marker(pytest.mark.xdist_group(_module(item)))
    order = {area: rank for rank, area in enumerate(FIRST)}
    items.sort(key=lambda item: (order.get(_area(item), len(FIRST)), not item.get_closest_marker("xdist_group")))


def _area(item) -> str:
    """The folder (or file) of tests/ that holds the test."""
    path = Path(item.path)
    return path.relative_to(TESTS).parts[0] if path.is_relative_to(TESTS) else ""


def _module(item) -> str:
    return getattr(getattr(item, "module", None), "__name__", str(item.path))


def _uses_a_module_fixture(item) -> bool:
    definitions = getattr(item, "_fixtureinfo", None)  # pytest's record of the fixtures a test uses
    return definitions is not None and any(
        chain[-1].scope in ("module", "class", "package")
        for name, chain in definitions.name2fixturedefs.items()
        if chain and name in item.fixturenames
    )


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
