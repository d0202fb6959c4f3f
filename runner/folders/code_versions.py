"""Which code a run ran: the runner's version and git state, and that of every repository the config's code comes from.

:class:`CodeVersions` asks ``git`` in processes of their own, started at once and collected later (a run builds its
model and data meanwhile): the commit, and a digest of the uncommitted changes (``git diff HEAD --binary``, hashed
as it streams, in a process of its own, and the names of untracked files). A package installed into an environment
(``site-packages``) is named by its version among the record's packages instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GIT_SECONDS = 10  # what collecting the git state of the code may take, in all, before it is recorded as unknown

# Hashes what it reads, as it reads it: a large diff is never held in memory. Prints the digest, as sha256sum does.
_HASHER = (
    "import hashlib, sys\n"
    "digest = hashlib.sha256()\n"
    "for chunk in iter(lambda: sys.stdin.buffer.read(1 << 20), b''):\n"
    "    digest.update(chunk)\n"
    "print(digest.hexdigest())\n"
)
_EMPTY = hashlib.sha256(b"").hexdigest()  # the digest of no change


def _hasher() -> list[str]:
    """A command that hashes its input as it streams and prints the SHA-256 digest first: coreutils' sha256sum where
    it is (a millisecond), else a Python interpreter (tens of milliseconds)."""
    found = shutil.which("sha256sum")
    return [found] if found else [sys.executable, "-c", _HASHER]


class CodeVersions:
    """The runner's version and git state, and each repository the config's ``_target_``s and recipe come from:
    its commit and a digest of what differs from it. The ``git`` processes start here; :meth:`result` collects
    them, waiting at most :data:`GIT_SECONDS` in all."""

    def __init__(self, config: dict[str, Any]) -> None:
        import runner

        self.version = runner.__version__
        runner_dir = Path(runner.__file__).resolve().parent
        # An installed runner inside some other work tree (a virtual environment in a project) is that tree's only.
        self.runner = GitState(runner_dir) if not installed(runner_dir) else None
        self.packages: dict[str, GitState] = {}
        for package in sorted(code_packages(config)):
            folder = package_folder(package)
            if folder is not None and not folder.is_relative_to(runner_dir) and not installed(folder):
                self.packages[package] = GitState(folder)  # else built in, the runner's, or an installed package

    def answered(self) -> bool:
        """Whether every git process has ended (its result would not wait)."""
        queries = [self.runner, *self.packages.values()] if self.runner is not None else [*self.packages.values()]
        return all(process.poll() is not None for query in queries for process in query.processes)

    def result(self) -> dict[str, Any]:
        deadline = time.monotonic() + GIT_SECONDS
        repositories: dict[str, dict[str, Any]] = {}
        for package, query in self.packages.items():
            state = query.result(deadline)
            key = state.get("root") or state["path"]
            repositories.setdefault(key, {**state, "packages": []})["packages"].append(package)
        runner_state = self.runner.result(deadline) if self.runner is not None else {"path": "installed"}
        return {"runner": {"version": self.version, **runner_state}, "repositories": repositories}


class GitState:
    """``{"root", "commit", "dirty", "diff_sha256"}`` of the git work tree holding ``folder``, ``{"path"}`` outside
    one, and ``{"path", "unknown"}`` where git did not answer in time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.processes: list[subprocess.Popen] = []
        git = ["git", "-C", str(folder)]
        try:
            self.head = self._start([*git, "rev-parse", "--show-toplevel", "HEAD"])
            self.untracked = self._start([*git, "ls-files", "--others", "--exclude-standard"])
            diff = self._start([*git, "diff", "HEAD", "--binary", "--no-ext-diff"])
            self.diff = self._start(_hasher(), stdin=diff.stdout)
            diff.stdout.close()  # the hasher holds it now: git sees a closed pipe if the hasher ends first
        except OSError:  # no git on this machine
            self.stop()
            self.head = self.untracked = self.diff = None

    def _start(self, command: list[str], stdin: Any = subprocess.DEVNULL) -> subprocess.Popen:
        process = subprocess.Popen(command, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()

    def result(self, deadline: float) -> dict[str, Any]:
        if self.head is None:
            return {"path": str(self.folder)}
        outputs = []
        try:
            for process in (self.head, self.untracked, self.diff):
                out, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
                outputs.append(out.decode(errors="replace") if process.returncode == 0 else None)
        except subprocess.TimeoutExpired:
            self.stop()
            return {"path": str(self.folder), "unknown": f"git did not answer within {GIT_SECONDS} s"}
        finally:
            for process in self.processes:
                process.wait()
        head, untracked, hashed = outputs
        lines = (head or "").split()
        if len(lines) != 2:
            return {"path": str(self.folder)}
        digest = (hashed or "").split(" ")[0].strip()
        changed = bool(digest) and digest != _EMPTY
        dirty = changed or bool(untracked)
        if not dirty:
            return {"root": lines[0], "commit": lines[1], "dirty": False, "diff_sha256": None}
        whole = hashlib.sha256(f"{digest if changed else ''}\0{untracked or ''}".encode()).hexdigest()
        return {"root": lines[0], "commit": lines[1], "dirty": True, "diff_sha256": whole}


def code_packages(config: dict[str, Any]) -> set[str]:
    """The top-level packages the config's ``_target_``s, getter paths and recipe name (builtins left out)."""
    from runner.config import RECIPES
    from runner.folders.provenance import object_paths_in, targets_in

    names = [target for _, target in targets_in(config)] + [path for _, path in object_paths_in(config)]
    recipe = config.get("recipe")
    if isinstance(recipe, str) and recipe not in RECIPES:
        names.append(recipe)
    return {name.split(".")[0] for name in names if name and "." in name} - {"builtins"}


def package_folder(package: str) -> Path | None:
    """Where a top-level package or module lives, found without importing it; None for a built-in one."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve().parent if spec.origin and os.path.isabs(spec.origin) else None


def installed(folder: Path) -> bool:
    """Whether ``folder`` is inside an environment's installed packages (not a work tree installed editable)."""
    return any(part in ("site-packages", "dist-packages") for part in folder.parts)


def installed_packages() -> dict[str, str]:
    """Every installed distribution's version, by name: read from the names of the ``*.dist-info`` and
    ``*.egg-info`` folders on ``sys.path`` (``torch-2.13.0.dist-info``), as ``importlib.metadata`` finds them, the
    first on the path winning, without reading each one's metadata."""
    versions: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            stem, dot, kind = name.rpartition(".")
            if dot and kind in ("dist-info", "egg-info"):
                project, _, version = stem.partition("-")
                if project and version:
                    versions.setdefault(project.lower().replace("_", "-"), version.partition("-")[0])
    return dict(sorted(versions.items()))
