"""The launch config file of these tests is in a folder of their own, never the user's ~/.config/runner/launch.yaml."""

import pytest


@pytest.fixture()
def config_home(tmp_path, monkeypatch):
    """An empty XDG_CONFIG_HOME (no RUNNER_CONFIG_FILE); the default launch config file is <it>/runner/launch.yaml."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv("RUNNER_CONFIG_FILE", raising=False)
    return home
