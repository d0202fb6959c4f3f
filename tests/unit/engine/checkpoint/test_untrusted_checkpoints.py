"""A checkpoint folder is data: a crafted or damaged one runs no code, touches nothing outside itself,
and is refused in one sentence (or skipped by resume and rotation) instead of changing the run."""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.cli.checkpoints import describe
from runner.engine import Accelerator, CheckpointError, FullyShardedDataParallelPlugin, ProjectConfiguration
from runner.engine.checkpoint import newest_intact_checkpoint
from runner.engine.checkpoint.manifest import read_manifest
from tests.unit.engine.checkpoint.checkpoint_edits import code_running_pickle, rewrite_manifest


def prepared(*, fsdp: bool = False, project_dir=None, total_limit=None) -> Accelerator:
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"]) if fsdp else None
    config = ProjectConfiguration(
        project_dir, automatic_checkpoint_naming=project_dir is not None, total_limit=total_limit
    )
    accelerator = Accelerator(fsdp_plugin=plugin, project_config=config)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    accelerator.backward(model(torch.randn(2, 4)).sum())
    optimizer.step()  # AdamW state, and non-tensor values (lr, betas) that DCP stores as pickled bytes
    return accelerator


def saved(tmp_path, *, fsdp: bool = False):
    folder = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own notes on one process
        prepared(fsdp=fsdp).save_state(folder)
    return folder


def manifest_damaged(folder, problem):
    return f"{folder / 'manifest.json'}: {problem}; the manifest is damaged, so load a different checkpoint."


def test_the_crafted_pickle_runs_code_when_unpickled(tmp_path):
    marker = tmp_path / "marker"
    pickle.loads(code_running_pickle(marker))  # what every test below relies on never happening
    assert marker.exists()


def test_a_plain_checkpoint_relisted_as_dcp_never_unpickles_its_metadata(tmp_path):
    folder, marker = saved(tmp_path), tmp_path / "marker"
    for name in ("model", "optimizer"):
        (folder / name).mkdir()
        (folder / name / ".metadata").write_bytes(code_running_pickle(marker))
    rewrite_manifest(folder, drop=["model.safetensors"], relist=["model/.metadata"])
    with pytest.raises(CheckpointError) as error:
        prepared().load_state(folder)
    assert str(error.value) == manifest_damaged(
        folder, "files does not list model.safetensors, which its contents and state_format call for"
    )

    # The format changed too: every strategy reads DCP state (by name) through the reader that refuses the pickle.
    rewrite_manifest(
        folder, lambda m: m.update(state_format="dcp"), drop=["optimizer.bin"], relist=["optimizer/.metadata"]
    )
    for fsdp in (False, True):
        with pytest.raises(CheckpointError) as error:
            prepared(fsdp=fsdp).load_state(folder)
        assert str(error.value) == (
            f"{folder / 'model' / '.metadata'} is not DCP metadata: its pickle names io.open, which DCP metadata "
            "never holds; the file was altered, so load a different checkpoint."
        )
    assert not marker.exists()


def test_an_fsdp_checkpoint_with_a_crafted_metadata_pickle_runs_nothing(tmp_path):
    folder, marker = saved(tmp_path, fsdp=True), tmp_path / "marker"
    prepared(fsdp=True).load_state(folder)  # as saved, it loads
    (folder / "optimizer" / ".metadata").write_bytes(code_running_pickle(marker))
    rewrite_manifest(folder, relist=["optimizer/.metadata"])
    with pytest.raises(CheckpointError) as error:
        prepared(fsdp=True).load_state(folder)
    assert str(error.value) == (
        f"{folder / 'optimizer' / '.metadata'} is not DCP metadata: its pickle names io.open, which DCP metadata "
        "never holds; the file was altered, so load a different checkpoint."
    )
    assert not marker.exists()


def test_dcp_metadata_that_points_outside_the_listed_files_is_refused(tmp_path):
    folder = saved(tmp_path, fsdp=True)
    metadata = pickle.loads((folder / "model" / ".metadata").read_bytes())  # our own file: trusted here
    (tmp_path / "outside.distcp").write_bytes((folder / "model" / "__0_0.distcp").read_bytes())
    next(iter(metadata.storage_data.values())).relative_path = "../../outside.distcp"
    (folder / "model" / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(folder, relist=["model/.metadata"])
    with pytest.raises(CheckpointError) as error:
        prepared(fsdp=True).load_state(folder)
    assert str(error.value) == (
        f"{folder / 'model' / '.metadata'} points at '../../outside.distcp', which is not a file of this checkpoint; "
        "the file was altered, so load a different checkpoint."
    )


def test_an_fsdp_optimizer_value_that_is_a_crafted_pickle_runs_nothing(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from tests.unit.engine.checkpoint.checkpoint_edits import CreatesFile

    folder, marker = saved(tmp_path, fsdp=True), tmp_path / "marker"
    accelerator = prepared(fsdp=True)
    model, optimizer = accelerator._models[0], accelerator._optimizers[0].optimizer
    state = get_optimizer_state_dict(model, optimizer)
    state["param_groups"][0]["lr"] = CreatesFile(marker)  # DCP stores non-tensor values with torch.save
    shutil.rmtree(folder / "optimizer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer": state}, checkpoint_id=folder / "optimizer", no_dist=True)
    names = [p.relative_to(folder).as_posix() for p in (folder / "optimizer").iterdir()]
    manifest = json.loads((folder / "manifest.json").read_text())
    stale = [name for name in manifest["files"] if name.startswith("optimizer/")]
    rewrite_manifest(folder, drop=stale, relist=names)

    copy = shutil.copytree(folder, tmp_path / "copy")
    with pytest.raises(CheckpointError) as error:
        accelerator.load_state(folder)
    assert str(error.value) == (
        f"{folder / 'optimizer'} holds a value for optimizer.param_groups.0.lr that is not plain data; the checkpoint "
        "was altered, so load a different one."
    )
    assert not marker.exists()
    with warnings.catch_warnings():  # DCP's own planner would have run it
        warnings.simplefilter("ignore")
        dcp.load(
            {"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=copy / "optimizer", no_dist=True
        )
    assert marker.exists()


def test_names_outside_the_folder_are_refused_without_reading_them(tmp_path):
    folder = saved(tmp_path)
    secret = tmp_path / "outside.txt"
    secret.write_text("twelve bytes")
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in ("../outside.txt", str(secret)):
        entry = {"bytes": 0, "digests": ["0" * 32]}
        rewrite_manifest(folder, lambda m, name=name, entry=entry: m["files"].update({name: entry}))
        with pytest.raises(CheckpointError) as error:
            prepared().load_state(folder)
        assert str(error.value) == manifest_damaged(
            folder, f"files lists {name!r}, which is not a path inside the checkpoint folder"
        )
        # The outside file's size (12 bytes) is not reported: it was never opened. The temporary folder's own
        # name can hold "12" (pytest-12/), so only the rest of the sentence is searched.
        assert "12" not in str(error.value).replace(str(tmp_path), "")
        rewrite_manifest(folder, lambda m: m.update(files=manifest["files"]))
    (folder / "model.safetensors").rename(tmp_path / "model.safetensors")
    (folder / "model.safetensors").symlink_to(tmp_path / "model.safetensors")  # same bytes, through a link
    with pytest.raises(CheckpointError) as error:
        prepared().load_state(folder)
    assert str(error.value) == (
        f"{folder / 'model.safetensors'} is a symbolic link; a checkpoint holds only its own files, so load a "
        "different checkpoint."
    )


def test_weights_that_are_not_safetensors_but_match_a_rewritten_manifest_are_one_sentence(tmp_path):
    folder = saved(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)
    rewrite_manifest(folder, relist=["model.safetensors"])
    with pytest.raises(CheckpointError) as error:
        prepared().load_state(folder)
    assert str(error.value).startswith(f"{folder / 'model.safetensors'} is not a safetensors file (")
    assert str(error.value).endswith("); the checkpoint is damaged, so load a different checkpoint.")


def test_an_edited_manifest_is_refused_and_resume_falls_back_past_it(tmp_path):
    accelerator = prepared(project_dir=tmp_path)
    for _ in range(5):
        accelerator.save_state()
    checkpoints = tmp_path / "checkpoints"
    rewrite_manifest(checkpoints / "checkpoint_4", lambda m: m.update(step=1000), redigest=False)
    rewrite_manifest(checkpoints / "checkpoint_3", drop=["optimizer.bin"])  # re-digested, but lacks the optimizer
    rewrite_manifest(checkpoints / "checkpoint_2", lambda m: m.update(chunk_bytes=0))
    with pytest.raises(CheckpointError) as error:
        prepared().load_state(checkpoints / "checkpoint_4")
    digest = "its digest does not match its content (it was edited or damaged after the save)"
    assert str(error.value) == manifest_damaged(checkpoints / "checkpoint_4", digest)

    newest, skipped = newest_intact_checkpoint(checkpoints)
    assert newest == checkpoints / "checkpoint_1"
    assert [(path.name, str(error)) for path, error in skipped] == [
        ("checkpoint_4", manifest_damaged(checkpoints / "checkpoint_4", digest)),
        ("checkpoint_3", manifest_damaged(checkpoints / "checkpoint_3",
                                          "files does not list optimizer.bin, which its contents and state_format "
                                          "call for")),
        ("checkpoint_2",
         manifest_damaged(checkpoints / "checkpoint_2", "chunk_bytes is 0, not a positive multiple of 4096")),
    ]  # fmt: skip
    statuses = [record["status"] for record in describe(tmp_path)]
    assert statuses[2] == (
        "damaged: manifest.json: chunk_bytes is 0, not a positive multiple of 4096; the manifest is damaged, so load a "
        "different checkpoint."
    )
    assert statuses[:2] == ["intact", "intact"] and all(status.startswith("damaged") for status in statuses[2:])


def names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_rotation_counts_only_intact_checkpoints_and_never_deletes_through_a_link(tmp_path):
    accelerator = prepared(project_dir=tmp_path / "run", total_limit=2)
    accelerator.save_state()  # checkpoint_0
    checkpoints = tmp_path / "run" / "checkpoints"
    elsewhere = shutil.copytree(checkpoints / "checkpoint_0", tmp_path / "mine")  # a folder of the user's
    (elsewhere / "notes.txt").write_text("keep")
    (checkpoints / "checkpoint_1").symlink_to(elsewhere)
    accelerator.project_configuration.iteration = 2
    with pytest.warns(UserWarning, match="checkpoint_1: it is a symbolic link"):
        accelerator.save_state()  # checkpoint_2
    weights = checkpoints / "checkpoint_2" / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:-4])  # damaged
    with pytest.warns(UserWarning) as caught:
        accelerator.save_state()  # checkpoint_3: intact are 0 and 3, so nothing is deleted
        assert names(checkpoints) == ["checkpoint_0", "checkpoint_1", "checkpoint_2", "checkpoint_3"]
        accelerator.save_state()  # checkpoint_4: the oldest intact one, checkpoint_0, goes
    assert names(checkpoints) == ["checkpoint_1", "checkpoint_2", "checkpoint_3", "checkpoint_4"]
    assert names(elsewhere) == [
        "manifest.json",
        "model.safetensors",
        "notes.txt",
        "optimizer.bin",
        "random_states_0.pt",
    ]
    read_manifest(elsewhere)
    messages = {str(warning.message) for warning in caught}
    assert f"Ignoring {checkpoints / 'checkpoint_1'}: it is a symbolic link, not a checkpoint of this run." in messages
    assert any(message.startswith("Rotation keeps checkpoint_2 without counting it: ") for message in messages)

    with pytest.warns(UserWarning, match="checkpoint_1: it is a symbolic link"):
        newest, skipped = newest_intact_checkpoint(checkpoints)
    assert newest == checkpoints / "checkpoint_4" and skipped == []
    assert [record["status"] for record in describe(tmp_path / "run")][:2] == [
        "ignored: a symbolic link, not a checkpoint of this run",
        f"damaged: model.safetensors has {size - 4} bytes but the manifest says {size}; the file is truncated or was "
        "changed, so load a different checkpoint.",
    ]


def test_links_in_place_of_a_staging_folder_or_left_by_a_hook_are_never_followed(tmp_path):
    accelerator = prepared(project_dir=tmp_path / "run")
    checkpoints, mine = tmp_path / "run" / "checkpoints", tmp_path / "mine"
    mine.mkdir()
    (mine / "data.txt").write_text("keep")
    checkpoints.mkdir(parents=True)
    (checkpoints / "checkpoint_0.incomplete").symlink_to(mine)  # where a crashed save's folder would be
    accelerator.save_state()  # replaces the link; never empties the folder it points to
    assert names(checkpoints) == ["checkpoint_0"] and names(mine) == ["data.txt"]

    def link_into_the_checkpoint(models, weights, output_dir):
        (Path(output_dir) / "data.txt").symlink_to(mine / "data.txt")

    accelerator.register_save_state_pre_hook(link_into_the_checkpoint)
    with pytest.raises(CheckpointError) as error:
        accelerator.save_state()
    link = checkpoints / "checkpoint_1.incomplete" / "data.txt"
    assert str(error.value) == (
        f"Saving checkpoint_1 failed (rank 0: {link} is a symbolic link; a checkpoint holds only its own files, so "
        "write a copy there instead); the checkpoints saved before it are intact, so free the space (or fix the "
        "folder) and resume from the newest of them."
    )
    assert names(checkpoints) == ["checkpoint_0"] and (mine / "data.txt").read_text() == "keep"
