"""A run whose disk fills during a save, on a real 30 MiB tmpfs (a checkpoint here is 14.4 MB): one sentence
naming the rank and the reason, exit code 1, no partial checkpoint left, the one before intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import mnist_args
from tests.unit.engine.checkpoint.tmpfs import tmpfs_runner


def run_on_full_disk(folder: str, *arguments: str) -> dict:
    """``python -m runner`` saving a checkpoint every 2 steps into ``folder`` (in a process of its own)."""
    from runner.engine.checkpoint.manifest import read_manifest

    run = Path(folder) / "run"
    tiny = [*mnist_args("test[:256]", "test[9900:]"), "tracker=none", "trainer.checkpoint_every_n_steps=2"]
    command = [sys.executable, "-m", "runner", *tiny, "trainer.max_steps=10", f"hydra.run.dir={run}", *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    checkpoints = run / "checkpoints"
    listing = sorted(p.name for p in checkpoints.iterdir())
    for name in listing:
        read_manifest(checkpoints / name)  # raises if a checkpoint is damaged
    return {"returncode": done.returncode, "stderr": done.stderr, "listing": listing}


@pytest.mark.parametrize("arguments", [[], ["parallel=ddp", "trainer.num_processes=2"]], ids=["one", "ddp"])
def test_a_full_disk_ends_the_run_in_one_sentence_and_keeps_the_checkpoint_before(tmp_path, arguments):
    with tmpfs_runner(tmp_path, size="30m") as on_tmpfs:
        result = on_tmpfs(f"{__name__}:run_on_full_disk", *arguments)
    saved = len(result["listing"])  # two fit
    assert saved >= 1 and result["listing"] == [f"checkpoint_{i}" for i in range(saved)], result["stderr"][-2000:]
    last = result["stderr"].strip().splitlines()[-1]
    assert result["returncode"] == 1, result["stderr"][-2000:]
    if not arguments:  # (several processes: torch's elastic agent also logs the failed worker's record)
        assert "Traceback" not in result["stderr"]
    assert last.startswith("runner: error: ") and f"Saving checkpoint_{saved} failed (rank " in last, last
    assert ": No space left on device: " in last and last.endswith(
        "the checkpoints saved before it are intact, so free the space (or fix the folder) and resume from the "
        "newest of them."
    ), last
