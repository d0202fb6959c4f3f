"""save_state/load_state with ProjectConfiguration(save_on_each_node=True), simulated on one machine: 3 gloo
ranks on two "nodes", {0} and {1, 2}, each node with a project_dir of its own (rank 2 shares rank 1's)."""

import errno
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.engine import Accelerator, CheckpointError, ProjectConfiguration
from runner.engine.checkpoint.manifest import read_manifest
from tests.helpers import checkpointed_run, train_steps

NODE_OF_RANK = {0: 0, 1: 1, 2: 1}
SHARED = {"model.safetensors", "optimizer.bin", "scheduler.bin"}  # in every node's copy


def _on_node(base: str) -> str:
    """Make this worker rank 0 of node {0} or rank 0/1 of node {1, 2}; return its node's project_dir."""
    rank = int(os.environ["RANK"])
    os.environ["LOCAL_RANK"] = str(rank - min(r for r, node in NODE_OF_RANK.items() if node == NODE_OF_RANK[rank]))
    os.environ["LOCAL_WORLD_SIZE"] = str(sum(node == NODE_OF_RANK[rank] for node in NODE_OF_RANK.values()))
    return str(Path(base) / f"node{NODE_OF_RANK[rank]}")


def _run(base):
    return checkpointed_run(_on_node(base), save_on_each_node=True)


def _exp_avg(optimizer):
    return optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"].clone()


def _save_then_load_on_own_node(base):
    accelerator, model, optimizer, train_loader, scheduler = _run(base)
    torch.manual_seed(100 + accelerator.process_index)
    for _ in range(3):  # checkpoint_0..2; total_limit=2 keeps 1 and 2 on each node
        train_steps(accelerator, model, optimizer, train_loader, scheduler, 3)
        saved = accelerator.save_state()
    after_save = {"rand": torch.rand(3), "weights": accelerator.get_state_dict(model), "exp_avg": _exp_avg(optimizer)}

    fresh, model, optimizer, train_loader, scheduler = _run(base)
    fresh.load_state()  # the newest checkpoint of this node's own copy
    restored = {"rand": torch.rand(3), "weights": fresh.get_state_dict(model), "exp_avg": _exp_avg(optimizer)}
    return {
        "saved": saved,
        "rand": torch.equal(after_save["rand"], restored["rand"]),
        "weights": all(torch.equal(v, restored["weights"][k]) for k, v in after_save["weights"].items()),
        "exp_avg": torch.equal(after_save["exp_avg"], restored["exp_avg"]),
        "lr": scheduler.get_last_lr(),
        "next_iteration": fresh.save_iteration,
        "drawn": restored["rand"],
    }


def test_each_node_commits_and_resumes_from_its_own_copy(launch, tmp_path):
    results = launch(_save_then_load_on_own_node, str(tmp_path), nproc=3)
    for node, ranks in ((0, [0]), (1, [1, 2])):
        checkpoints = tmp_path / f"node{node}" / "checkpoints"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint_1", "checkpoint_2"]  # rotated, no staging
        folder = checkpoints / "checkpoint_2"
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["world_size"] == 3 and manifest["node_local_ranks"] == ranks
        files = SHARED | {f"random_states_{rank}.pt" for rank in ranks}
        assert set(manifest["files"]) == files
        assert {p.name for p in folder.iterdir()} == files | {"manifest.json"}
    for rank, result in enumerate(results):
        assert Path(result["saved"]) == tmp_path / f"node{NODE_OF_RANK[rank]}" / "checkpoints" / "checkpoint_2"
        assert result["rand"] and result["weights"] and result["exp_avg"]
        assert result["lr"] == [1e-2 * 0.5**13] and result["next_iteration"] == 3
    assert len({tuple(result["drawn"].tolist()) for result in results}) == 3  # each rank got its own stream back
    from safetensors.torch import load_file

    weights = [load_file(tmp_path / f"node{node}/checkpoints/checkpoint_2/model.safetensors") for node in (0, 1)]
    assert weights[0].keys() == weights[1].keys() and all(
        torch.equal(weights[0][k], weights[1][k]) for k in weights[0]
    )  # the replicated state, written on each node from its own replica


def _break(what, rank, accelerators):
    """Make one phase of the save fail on ``rank``, as a full disk (or a save hook) would."""

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if what == "write" and rank == 2:  # not a node's owner: one of the files it writes itself
        from runner.engine.checkpoint import staging as checkpoint_staging

        checkpoint_staging._save_object = no_space
    if what == "manifest" and rank == 1:  # node 1's owner, in phase (a)
        from runner.engine.checkpoint import manifest

        manifest.write_manifest = no_space
    if what == "rename" and rank == 1:  # node 1's owner, in phase (b): node 0 has renamed, and puts it back
        from runner.engine.checkpoint import node_local as node_local_checkpoints

        node_local_checkpoints.rename_into_place = no_space
    if what == "fsync" and rank == 1:  # node 1's owner, in phase (b), after its rename: it puts it back too
        from runner.engine.checkpoint import node_local as node_local_checkpoints

        synced, calls = node_local_checkpoints.fsync_path, []

        def rename_sync_fails(path):  # each save's rename syncs, then putting the old state back syncs again
            calls.append(path)
            if len(calls) % 2:
                no_space()
            synced(path)

        node_local_checkpoints.fsync_path = rename_sync_fails
    if what == "hook" and rank == 1:  # a save hook raising on one rank only, before any file is written

        def hook(models, weights, folder):
            raise ValueError("this hook fails on rank 1")

        for accelerator in accelerators:
            accelerator.register_save_state_pre_hook(hook)


def _one_node_fails(base, what):
    accelerator, *_ = _run(base)
    accelerator.save_state()
    accelerator.save_state()  # checkpoint_0 and 1 on both nodes: total_limit=2 would delete 0 after the next
    explicit = Accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
    explicit.prepare(nn.Linear(4, 4))
    explicit.save_state(Path(accelerator.project_dir) / "ck")  # an output_dir that already holds a checkpoint
    digest = read_manifest(Path(accelerator.project_dir) / "ck")["digest"]
    _break(what, accelerator.process_index, (accelerator, explicit))
    messages = []
    for save in (accelerator.save_state, lambda: explicit.save_state(Path(accelerator.project_dir) / "ck")):
        try:
            save()
        except CheckpointError as error:
            messages.append(str(error))
        except ValueError as error:
            messages.append(("ValueError", str(error)))
    return messages, digest


def _assert_nothing_committed(tmp_path, digests):
    assert digests[1] == digests[2] != digests[0]  # each node's ranks recorded the digest of their own copy
    for node, rank in ((0, 0), (1, 1)):
        folder = tmp_path / f"node{node}"
        assert sorted(p.name for p in folder.iterdir()) == ["checkpoints", "ck"]  # no ck.incomplete, no ck.previous
        assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
        for checkpoint in (folder / "checkpoints" / "checkpoint_0", folder / "checkpoints" / "checkpoint_1"):
            assert read_manifest(checkpoint)["step"] == 0
        assert read_manifest(folder / "ck")["digest"] == digests[rank]  # the checkpoint saved there before


@pytest.mark.parametrize(("what", "failed_rank"), [("write", 2), ("manifest", 1), ("rename", 1), ("fsync", 1)])
def test_a_failure_on_one_node_commits_nothing_and_deletes_nothing_on_any(launch, tmp_path, what, failed_rank):
    results = launch(_one_node_fails, str(tmp_path), what, nproc=3)
    messages = [result[0] for result in results]
    assert messages[0] == messages[1] == messages[2] and len(messages[0]) == 2
    automatic, explicit = messages[0]
    assert automatic.startswith(f"Saving checkpoint_2 failed (rank {failed_rank}: No space left on device")
    assert explicit.startswith(f"Saving ck failed (rank {failed_rank}: No space left on device")
    _assert_nothing_committed(tmp_path, [result[1] for result in results])


def test_a_save_hook_raising_on_one_rank_fails_every_rank_and_commits_nothing(launch, tmp_path):
    results = launch(_one_node_fails, str(tmp_path), "hook", nproc=3)
    assert results[1][0] == [("ValueError", "this hook fails on rank 1")] * 2  # its own exception
    assert results[0][0] == results[2][0]
    automatic, explicit = results[0][0]
    assert automatic.startswith("Saving checkpoint_2 failed (rank 1: ValueError: this hook fails on rank 1)")
    assert explicit.startswith("Saving ck failed (rank 1: ValueError: this hook fails on rank 1)")
    _assert_nothing_committed(tmp_path, [result[1] for result in results])


def _loads_that_disagree_or_fail(base):
    accelerator, *_ = _run(base)
    accelerator.save_state()
    accelerator.save_state()
    rank, project_dir = accelerator.process_index, Path(accelerator.project_dir)
    outcomes = {}

    def attempt(name, load):
        try:
            load()
            outcomes[name] = "loaded"
        except Exception as error:
            outcomes[name] = (type(error).__name__, str(error))

    own_node = project_dir / "checkpoints" / ("checkpoint_0" if rank == 1 else "checkpoint_1")
    attempt("explicit", lambda: accelerator.load_state(own_node))  # node 1's rank 1 resumes an older save
    node_0 = Path(base) / "node0" / "checkpoints" / "checkpoint_1"
    attempt("other_node", lambda: accelerator.load_state(node_0))

    def load_hook(models, folder):
        if rank == 2:
            raise RuntimeError("this load hook fails on rank 2")

    handle = accelerator.register_load_state_pre_hook(load_hook)
    attempt("load_hook", accelerator.load_state)
    handle.remove()
    flag_off = checkpointed_run(project_dir)[0]  # the ordinary load of one node's copy
    attempt("flag_off", lambda: flag_off.load_state(node_0))

    class FailsOnRank1:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            if rank == 1:
                raise RuntimeError("not this rank's state")

    registered = Accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
    registered.prepare(nn.Linear(4, 4))
    registered.register_for_checkpointing(FailsOnRank1())
    registered.save_state(project_dir / "registered")
    attempt("raises", lambda: registered.load_state(project_dir / "registered"))

    if rank == 1:  # node 1 lost its newest checkpoint
        shutil.rmtree(project_dir / "checkpoints" / "checkpoint_1")
    accelerator.wait_for_everyone()
    attempt("newest", lambda: _run(base)[0].load_state())
    if rank == 1:  # and then every checkpoint
        shutil.rmtree(project_dir / "checkpoints")
    accelerator.wait_for_everyone()
    attempt("none", lambda: _run(base)[0].load_state())
    return outcomes


def test_every_rank_refuses_alike_when_the_nodes_copies_disagree_or_one_fails(launch, tmp_path):
    results = launch(_loads_that_disagree_or_fail, str(tmp_path), nproc=3)
    for name in ("explicit", "newest"):
        assert results[0][name] == results[1][name] == results[2][name]
        kind, message = results[0][name]
        assert kind == "CheckpointError" and message.startswith("The nodes would resume from different checkpoints (")
    assert (
        "(rank 0: checkpoint_1 at step 0, rank 1: checkpoint_0 at step 0, rank 2: checkpoint_1 at step 0)"
        in (results[0]["explicit"][1])
    )
    assert "rank 1: checkpoint_0 at step 0, rank 2: checkpoint_0 at step 0)" in results[0]["newest"][1]

    node_0 = tmp_path / "node0" / "checkpoints" / "checkpoint_1"
    for rank in (1, 2):  # each raises its own sentence; rank 0, which could load, the first failed rank's
        assert results[rank]["other_node"] == (
            "CheckpointError",
            f"{node_0} is one node's copy of a checkpoint of 3 process(es), holding the files of ranks [0], and "
            f"rank {rank} of 3 needs its own; resume every node from its own copy, with the same world size and node "
            "layout.",
        )
    assert results[0]["other_node"] == (
        "CheckpointError",
        f"Rank 1 could not load the checkpoint (CheckpointError: {results[1]['other_node'][1]})",
    )

    assert results[2]["load_hook"] == ("RuntimeError", "this load hook fails on rank 2")
    assert (
        results[0]["load_hook"]
        == results[1]["load_hook"]
        == (
            "CheckpointError",
            "Rank 2 could not load the checkpoint (RuntimeError: this load hook fails on rank 2)",
        )
    )
    assert results[0]["flag_off"] == "loaded"  # node 0's copy holds rank 0's files
    for rank in (1, 2):
        assert results[rank]["flag_off"] == results[rank]["other_node"]  # the same sentence, not FileNotFoundError

    assert results[1]["raises"] == ("RuntimeError", "not this rank's state")  # its own exception, unchanged
    assert (
        results[0]["raises"]
        == results[2]["raises"]
        == (
            "CheckpointError",
            "Rank 1 could not load the checkpoint (RuntimeError: not this rank's state)",
        )
    )

    none = f"No complete checkpoint in {tmp_path / 'node1' / 'checkpoints'} to load."
    assert results[1]["none"] == results[2]["none"] == ("CheckpointNotFoundError", none)
    assert results[0]["none"] == (
        "CheckpointNotFoundError",
        f"Rank 1 could not find the checkpoint (CheckpointNotFoundError: {none})",
    )


def _refused(base):
    from runner.engine import FullyShardedDataParallelPlugin

    _on_node(base)
    project = ProjectConfiguration(save_on_each_node=True)
    messages = []
    fsdp = Accelerator(project_config=project, fsdp_plugin=FullyShardedDataParallelPlugin())
    for accelerator, options in ((fsdp, {}), (Accelerator(project_config=project), {"async_save": "commit"})):
        accelerator.prepare(nn.Linear(4, 4))
        try:
            accelerator.save_state(Path(base) / "ck", **options)
        except ValueError as error:
            messages.append(str(error))
    try:
        fsdp.load_state(Path(base) / "ck")
    except ValueError as error:
        messages.append(str(error))
    return messages, sorted(p.name for p in Path(base).iterdir())


def _automatic_onto_a_taken_number(base):
    accelerator, *_ = _run(base)
    accelerator.save_state()  # checkpoint_0 on both nodes
    if accelerator.process_index == 1:  # node 1 also holds a checkpoint_4 (its checkpoint_0, renamed)
        os.replace(
            Path(accelerator.project_dir) / "checkpoints" / "checkpoint_0",
            Path(accelerator.project_dir) / "checkpoints" / "checkpoint_4",
        )
    accelerator.wait_for_everyone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = accelerator.save_state(Path(base) / "ignored")
    return saved, read_manifest(Path(saved))["iteration"], accelerator.save_iteration, [str(w.message) for w in caught]


def test_an_automatic_save_onto_a_taken_number_takes_the_largest_on_every_node(launch, tmp_path):
    results = launch(_automatic_onto_a_taken_number, str(tmp_path), nproc=3)
    for rank, (saved, iteration, next_iteration, caught) in enumerate(results):
        assert Path(saved) == tmp_path / f"node{NODE_OF_RANK[rank]}" / "checkpoints" / "checkpoint_5"
        assert iteration == 5 and next_iteration == 6  # the manifest and the project agree with the folder's name
        assert "save_state(output_dir) is ignored under automatic_checkpoint_naming." in caught
    assert not (tmp_path / "ignored").exists()


def test_fsdp_and_a_background_commit_are_refused_with_save_on_each_node(launch, tmp_path):
    results = launch(_refused, str(tmp_path), nproc=3)
    assert results[0] == results[1] == results[2]
    (fsdp, asynchronous, fsdp_load), written = results[0]
    assert fsdp == (
        "save_state under FSDP cannot use ProjectConfiguration(save_on_each_node=True): rank 0 alone writes the "
        "sharded state's metadata (or the gathered state), so the other nodes' copies would lack it; put project_dir "
        "on a filesystem every node sees and leave save_on_each_node off."
    )
    assert fsdp_load == fsdp.replace("save_state under", "load_state under")
    assert asynchronous == (
        "save_state(async_save='commit') cannot be used with ProjectConfiguration(save_on_each_node=True): each "
        "node commits only once every node has written and renamed its copy, which needs every rank; pass "
        "async_save=False."
    )
    assert written == []  # refused before anything was written


def _on_a_shared_folder(base):
    _on_node(base)  # two node owners, ranks 0 and 1, but one folder every rank sees
    folder = Path(base) / "shared" / "ck"
    accelerator = Accelerator()
    accelerator.prepare(nn.Linear(4, 4))
    accelerator.save_state(folder)  # the ordinary save: every rank sees one folder
    before = sorted(p.name for p in folder.iterdir())
    each_node = Accelerator(project_config=ProjectConfiguration(save_on_each_node=True))
    each_node.prepare(nn.Linear(4, 4))
    try:
        each_node.save_state(folder)
    except ValueError as error:
        message = str(error)
    else:
        message = None
    each_node.wait_for_everyone()
    return message, before, sorted(p.name for p in folder.iterdir()), sorted(p.name for p in folder.parent.iterdir())


def test_save_on_each_node_on_a_folder_nodes_share_is_refused_and_loses_nothing(launch, tmp_path):
    results = launch(_on_a_shared_folder, str(tmp_path), nproc=3)
    assert (
        results[0][0]
        == results[1][0]
        == results[2][0]
        == (
            f"save_on_each_node=True, but the node owners [0, 1] all write into "
            f"{tmp_path / 'shared' / 'ck.incomplete'}: that folder is on a filesystem several nodes share; leave "
            "ProjectConfiguration(save_on_each_node=False) there (the checkpoints saved before are intact)."
        )
    )
    message, before, after, siblings = results[0]
    assert after == before and "manifest.json" in before  # the earlier save, untouched
    assert siblings == ["ck"]  # no staging folder left
