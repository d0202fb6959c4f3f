"""A disk that fills during save_state, on a real 30 MiB tmpfs: one sentence, no partial folder left,
the checkpoints committed before still intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.engine.checkpoint.tmpfs import tmpfs_runner


@pytest.fixture
def on_tmpfs(tmp_path):
    with tmpfs_runner(tmp_path, size="30m") as run:
        yield run


def save_until_full(project_dir: str, optimizer_name: str) -> dict:
    """Save checkpoints of a 6 MB model into ``project_dir`` until a save fails (in a process of its own)."""
    from runner.engine import Accelerator, CheckpointError, ProjectConfiguration
    from runner.engine.checkpoint.manifest import read_manifest

    project = Path(project_dir)
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True))
    model = torch.nn.Linear(1250, 1200)  # 6 MB of weights; AdamW's two moments add 12 MB
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(2, 1250)).sum())
    optimizer.step()
    errors = []
    for _ in range(10):
        try:
            accelerator.save_state()
        except CheckpointError as error:
            errors.append(str(error))
            break
    checkpoints = project / "checkpoints"
    listing = sorted(p.name for p in checkpoints.iterdir())
    verified = [read_manifest(checkpoints / name)["iteration"] for name in listing]  # raises if one is damaged
    return {"errors": errors, "listing": listing, "verified": verified}


@pytest.mark.parametrize(
    ("optimizer_name", "failing_file"),
    [("AdamW", "optimizer.bin"), ("SGD", "model.safetensors")],  # torch.save's and safetensors' failure
)
def test_a_full_disk_fails_the_save_in_one_sentence_and_keeps_the_checkpoints_before(
    on_tmpfs, optimizer_name, failing_file
):
    result = on_tmpfs(f"{__name__}:save_until_full", optimizer_name)
    saved = len(result["listing"])
    assert saved >= 1 and result["listing"] == [f"checkpoint_{i}" for i in range(saved)]  # no .incomplete left
    assert result["verified"] == list(range(saved))
    [error] = result["errors"]
    staging = Path(error.split("No space left on device: ")[1].split(")")[0])
    assert staging.name == failing_file and staging.parent.name == f"checkpoint_{saved}.incomplete"
    assert error == (
        f"Saving checkpoint_{saved} failed (rank 0: No space left on device: {staging}); the checkpoints saved before "
        "it are intact, so free the space (or fix the folder) and resume from the newest of them."
    )
