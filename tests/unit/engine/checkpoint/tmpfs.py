"""Run a test's function in a fresh process whose folder is a small real tmpfs, to fill a disk for real.

As root the tmpfs is mounted (and unmounted after); otherwise the process runs inside a user and
mount namespace (``unshare -rm``), where the mount exists only for it. Without either, the test is
skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]  # the repository: tests/unit/engine/checkpoint/tmpfs.py
_CALL = "import importlib, json, sys; module, name = sys.argv[1].split(':'); " + (
    "print(json.dumps(getattr(importlib.import_module(module), name)(*sys.argv[2:])))"
)
_MOUNT_FAILED = 97


@contextlib.contextmanager
def tmpfs_runner(tmp_path: Path, *, size: str = "30m") -> Iterator[Callable[..., object]]:
    """Yield ``run("package.module:function", *args)``: calls ``function(folder, *args)`` in a new Python
    whose ``folder`` is an empty tmpfs of ``size``, and returns what it returned (JSON)."""
    mounted: list[Path] = []

    def run(target: str, *args: str, timeout: float = 300) -> object:
        folder = tmp_path / f"tmpfs_{len(mounted)}"
        folder.mkdir()
        command = [sys.executable, "-c", _CALL, target, str(folder), *args]
        if os.geteuid() == 0 and _mount(folder, size):
            mounted.append(folder)
        else:
            command = _in_namespace(folder, size, command)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        env = {key: value for key, value in env.items() if key not in ("RANK", "WORLD_SIZE")}
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        if result.returncode == _MOUNT_FAILED:
            pytest.skip(f"cannot mount a tmpfs in a user namespace here: {result.stderr.strip()}")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.splitlines()[-1])

    try:
        yield run
    finally:
        for folder in mounted:
            subprocess.run(["umount", str(folder)], check=False)


def _mount(folder: Path, size: str) -> bool:
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return mount.returncode == 0


def _in_namespace(folder: Path, size: str, command: list[str]) -> list[str]:
    if shutil.which("unshare") is None:
        pytest.skip("filling a real disk needs root (to mount a tmpfs) or util-linux's unshare")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"filling a real disk needs root or user namespaces: {probe.stderr.strip()}")
    mount_then_run = f'mount -t tmpfs -o size="$1" tmpfs "$2" || exit {_MOUNT_FAILED}; shift 2; exec "$@"'
    return ["unshare", "-rm", "sh", "-c", mount_then_run, "sh", size, str(folder), *command]
