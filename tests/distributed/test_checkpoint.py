"""save_state/load_state on 2 gloo processes: one committed folder, every rank's RNG restored."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.engine import Accelerator, CheckpointError, ProjectConfiguration
from tests.helpers import checkpointed_run, train_steps
from tests.unit.engine.checkpoint.tmpfs import tmpfs_runner


def _save_then_load(project_dir):
    accelerator, model, optimizer, train_loader, scheduler = checkpointed_run(project_dir)
    torch.manual_seed(100 + accelerator.process_index)  # each rank draws its own stream from here
    for _ in range(3):  # checkpoint_0..2; total_limit=2 keeps 1 and 2
        train_steps(accelerator, model, optimizer, train_loader, scheduler, 3)
        saved = accelerator.save_state()
    after_save = {"rand": torch.rand(3), "weights": accelerator.get_state_dict(model), "lr": scheduler.get_last_lr()}
    exp_avg = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"].clone()

    fresh, model, optimizer, train_loader, scheduler = checkpointed_run(project_dir)
    fresh.load_state(saved)
    restored = {"rand": torch.rand(3), "weights": fresh.get_state_dict(model), "lr": scheduler.get_last_lr()}
    restored_exp_avg = optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]
    return {
        "saved": saved,
        "after_save": after_save,
        "restored": restored,
        "exp_avg_equal": torch.equal(exp_avg, restored_exp_avg),
        "next_iteration": fresh.save_iteration,
    }


def test_save_and_load_state_on_two_processes(launch, tmp_path):
    rank0, rank1 = launch(_save_then_load, str(tmp_path))
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint_1", "checkpoint_2"]
    folder = tmp_path / "checkpoints" / "checkpoint_2"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["iteration"] == 2
    # One folder every rank sees (save_on_each_node off): every rank's files, nothing else, no node_local_ranks.
    files = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pt", "random_states_1.pt"}
    assert set(manifest["files"]) == files and "node_local_ranks" not in manifest
    assert {p.name for p in folder.iterdir()} == files | {"manifest.json"}
    assert Path(rank0["saved"]) == folder
    for result in (rank0, rank1):
        # Each rank's RNG stream continues exactly where it was saved.
        assert torch.equal(result["after_save"]["rand"], result["restored"]["rand"])
        for key, value in result["after_save"]["weights"].items():
            assert torch.equal(value, result["restored"]["weights"][key])
        # 9 optimizer steps on 2 processes advance the schedule 18 times (Accelerate's convention).
        assert result["after_save"]["lr"] == result["restored"]["lr"] == [1e-2 * 0.5**9]
        assert result["exp_avg_equal"]
        assert result["next_iteration"] == 3
    # The ranks drew different streams, so restoring per-rank states mattered.
    assert not torch.equal(rank0["restored"]["rand"], rank1["restored"]["rand"])


def _async_saves(project_dir):
    accelerator, model, optimizer, train_loader, scheduler = checkpointed_run(project_dir)
    for _ in range(3):
        train_steps(accelerator, model, optimizer, train_loader, scheduler, 2)
        accelerator.save_state(async_save="commit")
    expected = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 2)  # move away from the saved weights
    accelerator.load_state()  # every rank waits for rank 0's last commit, then loads it
    return all(torch.equal(expected[k], v) for k, v in accelerator.get_state_dict(model).items())


def test_background_commits_on_two_processes(launch, tmp_path):
    assert launch(_async_saves, str(tmp_path)) == [True, True]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]


def _failed_background_commit(project_dir):
    import runner.engine.checkpoint.manifest as manifest_module

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    manifest_module.write_manifest = disk_full
    accelerator, *_ = checkpointed_run(project_dir)
    accelerator.save_state(async_save="commit")
    try:
        accelerator.wait_for_checkpoint()
    except Exception as error:  # every rank must hear of rank 0's failure, or the next collective hangs
        return str(error)
    return None


def test_a_failed_background_commit_is_raised_on_every_rank(launch, tmp_path):
    errors = launch(_failed_background_commit, str(tmp_path))
    assert errors[0] == errors[1] and "Committing the last checkpoint failed: OSError" in errors[0]


def _one_rank_runs_out_of_space(directory):
    import errno

    from runner.engine.checkpoint import staging as checkpoint_staging

    accelerator = Accelerator()
    accelerator.prepare(nn.Linear(4, 4))
    if accelerator.process_index == 1:

        def no_space(obj, path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        checkpoint_staging._save_object = no_space
    try:
        accelerator.save_state(directory)
    except CheckpointError as error:
        return str(error)
    return "saved"


def test_a_failed_write_on_one_rank_fails_the_save_on_every_rank_without_hanging(launch, tmp_path):
    messages = launch(_one_rank_runs_out_of_space, str(tmp_path / "ck"))
    assert messages[0] == messages[1]
    assert messages[0].startswith("Saving ck failed (rank 1: No space left on device: ")
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.incomplete").exists()


def _save_until_full(project_dir):
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir, automatic_checkpoint_naming=True))
    model = nn.Linear(1250, 1200)  # 6 MB of weights; AdamW's two moments add 12 MB
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.backward(model(torch.randn(2, 1250)).sum())
    optimizer.step()
    for saves in range(10):
        try:
            accelerator.save_state()
        except CheckpointError as error:  # every rank hears of rank 0's failure, and raises alike
            return {"saves": saves, "error": str(error)}
    return {"saves": 10, "error": None}


def save_on_two_processes_until_full(project_dir: str) -> dict:
    """Runs in a process of its own, whose ``project_dir`` is a small tmpfs (see tests.unit.engine.checkpoint.tmpfs)."""
    from runner.engine.checkpoint.manifest import read_manifest
    from tests.distributed.conftest import launch_workers

    results = launch_workers(_save_until_full, project_dir)
    checkpoints = Path(project_dir) / "checkpoints"
    listing = sorted(p.name for p in checkpoints.iterdir())
    verified = [read_manifest(checkpoints / name)["world_size"] for name in listing]
    return {"results": results, "listing": listing, "verified": verified}


@pytest.fixture
def on_tmpfs(tmp_path):
    with tmpfs_runner(tmp_path, size="30m") as run:
        yield run


def test_a_full_disk_fails_the_save_on_both_processes_and_keeps_the_checkpoints_before(on_tmpfs):
    outcome = on_tmpfs(f"{__name__}:save_on_two_processes_until_full")
    rank0, rank1 = outcome["results"]
    saved = rank0["saves"]
    assert saved >= 1 and rank1 == rank0
    assert outcome["listing"] == [f"checkpoint_{i}" for i in range(saved)] and outcome["verified"] == [2] * saved
    staging = Path(rank0["error"].split("No space left on device: ")[1].split(")")[0])
    assert staging.name == "optimizer.bin" and staging.parent.name == f"checkpoint_{saved}.incomplete"
    assert rank0["error"] == (
        f"Saving checkpoint_{saved} failed (rank 0: No space left on device: {staging}); the checkpoints saved before "
        "it are intact, so free the space (or fix the folder) and resume from the newest of them."
    )


def _hashed_once(project_dir):
    from runner.engine.checkpoint import manifest as manifests

    hashed = []
    digest = manifests.slice_digest

    def counting(path, offset, length, checksum):
        hashed.append((Path(path).name, offset, length))
        return digest(path, offset, length, checksum)

    manifests.slice_digest = counting
    accelerator, model, optimizer, train_loader, scheduler = checkpointed_run(project_dir)
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 2)
    saved = Path(accelerator.save_state())
    on_save, hashed[:] = list(hashed), []
    fresh, *_ = checkpointed_run(project_dir)
    fresh.load_state(saved)
    return {"save": on_save, "load": list(hashed), "saved": str(saved)}


def test_every_slice_is_hashed_once_in_all_on_save_and_on_load(launch, tmp_path):
    from runner.engine.checkpoint.manifest import manifest_slices, read_manifest

    rank0, rank1 = launch(_hashed_once, str(tmp_path))
    manifest = read_manifest(Path(rank0["saved"]), verify_checksums=False)
    every = sorted((Path(piece.name).name, piece.offset, piece.length) for piece in manifest_slices(manifest))
    for verb in ("save", "load"):
        # Each rank hashes a disjoint share, together every slice once: the shared files are not hashed twice.
        assert sorted(map(tuple, rank0[verb] + rank1[verb])) == every
    # On save each rank hashes what it wrote; on load each rank its own RNG state, and a share of the rest.
    assert [name for name, *_ in rank1["save"]] == ["random_states_1.pt"]
    assert ("random_states_1.pt", 0, (Path(rank0["saved"]) / "random_states_1.pt").stat().st_size) in map(
        tuple, rank1["load"]
    )
    assert all(name != "random_states_1.pt" for name, *_ in rank0["load"])
    assert rank0["load"] and rank1["load"]


def _save_to_a_folder_per_rank(folder):
    accelerator = Accelerator()
    accelerator.prepare(torch.nn.Linear(2, 2))
    try:
        accelerator.save_state(f"{folder}/rank{accelerator.process_index}")
    except ValueError as error:
        return str(error)
    return None


def test_a_different_save_folder_on_each_rank_is_one_sentence_on_every_rank(launch, tmp_path):
    refusals = launch(_save_to_a_folder_per_rank, str(tmp_path))
    expected = (
        f"save_state got a different output_dir on each process (rank 0: '{tmp_path}/rank0', rank 1: "
        f"'{tmp_path}/rank1'); every process writes its part of one checkpoint into the same folder, so pass the "
        "same output_dir on every rank (a folder all nodes see, or ProjectConfiguration(save_on_each_node=True) "
        "for each node's disk)."
    )
    assert refusals == [expected, expected]
    assert list(tmp_path.iterdir()) == []  # nothing written
