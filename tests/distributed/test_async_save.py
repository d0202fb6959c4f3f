"""save_state(async_save=True) on 2 gloo processes: every rank's snapshot, one commit, one outcome on every rank."""

import copy
import errno
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file

from runner.engine import Accelerator, CheckpointError, FullyShardedDataParallelPlugin
from runner.engine.checkpoint.manifest import read_manifest
from runner.engine.checkpoint.sharded_state import gather_full
from tests.helpers import assert_same_optimizer_state, checkpointed_run, small_model, train_steps


def _first_exp_avg(optimizer) -> torch.Tensor:
    return optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"]


def _gated(owner, name: str, release: threading.Event) -> list[bool]:
    """Make ``owner.name`` wait for ``release`` (at most 30 s) before it runs; returns the list of its calls."""
    calls, original = [], getattr(owner, name)

    def gated(*args, **kwargs):
        calls.append(True)
        assert release.wait(timeout=30), "the background write was never released"
        return original(*args, **kwargs)

    setattr(owner, name, gated)
    return calls


def _async_save_then_load(project_dir):
    from runner.engine.checkpoint import staging as checkpoint_staging

    accelerator, model, optimizer, train_loader, scheduler = checkpointed_run(project_dir)
    torch.manual_seed(100 + accelerator.process_index)  # each rank draws its own stream from here
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 3)
    accelerator.save_state(async_save=True)  # checkpoint_0
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 3)
    release = threading.Event()
    calls = _gated(checkpoint_staging, "save_safetensors", release)  # rank 0's model file waits for the changes below
    saved = accelerator.save_state(async_save=True)  # checkpoint_1, after checkpoint_0 is committed
    after_save = {"rand": torch.rand(3), "weights": accelerator.get_state_dict(model), "lr": scheduler.get_last_lr()}
    after_save["weights"] = {k: v.clone() for k, v in after_save["weights"].items()}
    exp_avg = _first_exp_avg(optimizer).clone()
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 3)  # the live state moves on
    release.set()
    accelerator.wait_for_checkpoint()

    fresh, model, optimizer, train_loader, scheduler = checkpointed_run(project_dir)
    fresh.load_state(saved)
    restored = {"rand": torch.rand(3), "weights": fresh.get_state_dict(model), "lr": scheduler.get_last_lr()}
    return {
        "saved": saved,
        "gated_writes": len(calls),
        "after_save": after_save,
        "restored": restored,
        "exp_avg": (exp_avg, _first_exp_avg(optimizer).clone()),
    }


def test_async_save_on_two_processes_restores_every_rank_as_it_was_at_the_save(launch, tmp_path):
    rank0, rank1 = launch(_async_save_then_load, str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    folder = tmp_path / "checkpoints" / "checkpoint_1"
    manifest = read_manifest(folder, verify_checksums=True)
    assert manifest["world_size"] == 2 and manifest["iteration"] == 1 and manifest["step"] == 6
    files = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pt", "random_states_1.pt"}
    assert set(manifest["files"]) == files
    assert {p.name for p in folder.iterdir()} == files | {"manifest.json"}
    assert Path(rank0["saved"]) == Path(rank1["saved"]) == folder
    assert (rank0["gated_writes"], rank1["gated_writes"]) == (1, 0)  # the model is written by rank 0 only
    for result in (rank0, rank1):
        assert torch.equal(result["after_save"]["rand"], result["restored"]["rand"])
        assert result["after_save"]["weights"].keys() == result["restored"]["weights"].keys()
        for key, value in result["after_save"]["weights"].items():
            assert torch.equal(value, result["restored"]["weights"][key]), key
        # 6 optimizer steps on 2 processes advance the schedule 12 times (Accelerate's convention).
        assert result["after_save"]["lr"] == result["restored"]["lr"] == [1e-2 * 0.5**6]
        assert torch.equal(*result["exp_avg"])
    assert not torch.equal(rank0["restored"]["rand"], rank1["restored"]["rand"])


def _plugin():
    return FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"])  # SHARDED_STATE_DICT


def _fsdp_step(accelerator, model, optimizer) -> None:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
    accelerator.backward(model(x).pow(2).sum())
    optimizer.step()
    optimizer.zero_grad()


def _fsdp_state(accelerator, model, optimizer) -> dict:
    """This rank's shards (weights and first moments), and the full states gathered on rank 0."""
    unwrapped = accelerator.unwrap_model(model)
    return {
        "shards": {name: p.to_local().detach().clone() for name, p in unwrapped.named_parameters()},
        "exp_avg": _first_exp_avg(optimizer).to_local().clone(),
        "weights": {k: v.clone() for k, v in accelerator.get_state_dict(model).items()},
        "optimizer": copy.deepcopy(gather_full([unwrapped], [optimizer])[1][0]),  # its step tensors are the live ones
    }


def _fsdp_async_save_then_load(directory):
    from torch.distributed.checkpoint import FileSystemWriter

    accelerator = Accelerator(fsdp_plugin=_plugin())
    model = small_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    torch.manual_seed(100 + accelerator.process_index)
    _fsdp_step(accelerator, model, optimizer)
    release = threading.Event()
    # DCP's upload thread writes the staged shards only after the live ones have changed below.
    calls = _gated(FileSystemWriter, "write_data", release)
    accelerator.save_state(directory, async_save=True)
    rand = torch.rand(3)
    at_save = _fsdp_state(accelerator, model, optimizer)
    _fsdp_step(accelerator, model, optimizer)
    changed = _fsdp_state(accelerator, model, optimizer)
    release.set()
    accelerator.wait_for_checkpoint()
    # a second save stages into the host storages of the first (its DCP stagers are kept), once that is written
    accelerator.save_state(directory + "_second", async_save=True)
    accelerator.end_training()

    fresh = Accelerator(fsdp_plugin=_plugin())
    model = small_model(seed=1)  # other initial weights: the checkpoint must overwrite them
    model, optimizer = fresh.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    fresh.load_state(directory + "_second")
    second = _fsdp_state(fresh, model, optimizer)
    fresh.load_state(directory)
    restored_rand = torch.rand(3)
    restored = _fsdp_state(fresh, model, optimizer)
    return {
        "gated_writes": len(calls),
        "rand": (rand, restored_rand),
        "at_save": at_save,
        "changed": changed,
        "restored": restored,
        "second": second,
    }


def test_fsdp_async_save_through_dcp_restores_the_shards_as_they_were_at_the_save(launch, tmp_path):
    rank0, rank1 = launch(_fsdp_async_save_then_load, str(tmp_path / "ck"))
    manifest = read_manifest(tmp_path / "ck", verify_checksums=True)
    assert manifest["state_format"] == "dcp" and manifest["world_size"] == 2
    for name in ("model/__0_0.distcp", "model/__1_0.distcp", "optimizer/.metadata", "random_states_1.pt"):
        assert name in manifest["files"], name
    assert not (tmp_path / "ck.incomplete").exists()
    for result in (rank0, rank1):
        assert result["gated_writes"] == 4  # the model's and the optimizer's DCP saves, twice
        assert torch.equal(*result["rand"])
        at_save, restored = result["at_save"], result["restored"]
        assert at_save["shards"].keys() == restored["shards"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
        for key, value in at_save["shards"].items():
            assert torch.equal(value, restored["shards"][key]), key
            assert torch.equal(result["changed"]["shards"][key], result["second"]["shards"][key]), key
            assert value.numel() == 0 or not torch.equal(value, result["second"]["shards"][key]), key  # a step later
        assert torch.equal(at_save["exp_avg"], restored["exp_avg"])
        assert torch.equal(result["changed"]["exp_avg"], result["second"]["exp_avg"])
    assert rank1["restored"]["weights"] == {}  # the full state dict is gathered to the main process only
    weights = rank0["at_save"]["weights"]
    assert weights.keys() == rank0["restored"]["weights"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for key, value in weights.items():
        assert torch.equal(value, rank0["restored"]["weights"][key]), key
        assert not torch.equal(value, rank0["changed"]["weights"][key]), key  # the live state did move on
    assert_same_optimizer_state(rank0["at_save"]["optimizer"], rank0["restored"]["optimizer"])


def _one_rank_runs_out_of_space_in_the_background(directory):
    from runner.engine.checkpoint import staging as checkpoint_staging

    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    accelerator.save_state(f"{directory}/before")
    write = checkpoint_staging._save_object
    if accelerator.process_index == 1:

        def no_space(obj, path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        checkpoint_staging._save_object = no_space  # rank 1 writes only its RNG state
    accelerator.save_state(f"{directory}/ck", async_save=True)  # returns: the failure comes in the background
    try:
        accelerator.wait_for_checkpoint()
    except CheckpointError as error:
        message = str(error)
    else:
        message = "committed"
    checkpoint_staging._save_object = write  # space freed: the next save works on both ranks
    with torch.no_grad():
        accelerator.unwrap_model(model).weight.fill_(3.0)
    accelerator.save_state(f"{directory}/after", async_save=True)
    accelerator.wait_for_checkpoint()
    return message


def test_a_background_write_failing_on_one_rank_fails_on_both_and_commits_nothing(launch, tmp_path):
    messages = launch(_one_rank_runs_out_of_space_in_the_background, str(tmp_path))
    staging = tmp_path / "ck.incomplete"
    expected = (
        f"Saving ck in the background failed (rank 1: No space left on device: {staging / 'random_states_1.pt'}); "
        "the checkpoints saved before it are intact, so free the space (or fix the folder) and resume from the "
        "newest of them."
    )
    assert messages == [expected, expected]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["after", "before"]  # no ck, no ck.incomplete
    for name in ("before", "after"):
        manifest = read_manifest(tmp_path / name, verify_checksums=True)
        assert {"random_states_0.pt", "random_states_1.pt"} <= set(manifest["files"])
    assert torch.equal(load_file(tmp_path / "after" / "model.safetensors")["weight"], torch.full((4, 4), 3.0))


def _failures_off_the_happy_path(project_dir):
    """A disk error while one rank hashes its share of a load, and a state the snapshot cannot copy on rank 0 only:
    every rank raises (the failed one its own error), none waits forever."""
    from runner.engine.checkpoint import manifest as manifests

    accelerator, model, optimizer, train_loader, scheduler = checkpointed_run(project_dir)
    train_steps(accelerator, model, optimizer, train_loader, scheduler, 2)
    saved = accelerator.save_state()
    rank, outcomes = accelerator.process_index, {}
    digest = manifests.slice_digest

    def failing(path, offset, length, checksum):
        if rank == 1:
            raise ValueError("a bug while hashing")
        return digest(path, offset, length, checksum)

    manifests.slice_digest = failing
    try:
        accelerator.load_state(saved)
    except Exception as error:
        outcomes["load"] = (type(error).__name__, str(error))
    manifests.slice_digest = digest

    class Sparse:
        def state_dict(self):
            return {"values": torch.eye(2).to_sparse()}

        def load_state_dict(self, state):
            pass

    accelerator.register_for_checkpointing(Sparse())  # only rank 0 copies the registered objects
    try:
        accelerator.save_state(async_save=True)
    except Exception as error:
        outcomes["snapshot"] = type(error).__name__
    return outcomes


def test_a_rank_failing_off_the_happy_path_fails_every_rank_without_a_hang(launch, tmp_path):
    rank0, rank1 = launch(_failures_off_the_happy_path, str(tmp_path))
    assert rank1["load"] == ("ValueError", "a bug while hashing")  # its own exception, with its traceback
    assert rank0["load"] == ("CheckpointError", "rank 1: ValueError: a bug while hashing")
    assert rank0["snapshot"] == "NotImplementedError" and rank1["snapshot"] == "CheckpointError"
    assert not list((tmp_path / "checkpoints").glob("*.incomplete"))
