import hashlib
import json
import mmap
import os

import pytest
import xxhash

from runner.engine.checkpoint import manifest as manifests
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.manifest import CHUNK_BYTES, read_manifest, write_manifest
from runner.engine.checkpoint.manifest_schema import MANIFEST_FORMAT, check_metadata, manifest_digest
from tests.unit.engine.checkpoint.checkpoint_edits import rewrite_manifest

CONTENTS = {
    "models": 1, "optimizers": 0, "schedulers": 0, "custom_objects": 0, "dataloaders": 1, "scaler": False,
    "gradients": False,
}  # fmt: skip
POSITION = {
    "step": 10, "epoch": 0, "optimizer_steps": [], "accumulation_step": 0, "accumulation_steps": 1,
    "dataloaders": [{"epoch": 0, "samples_seen": 640, "seed": 1234}],
}  # fmt: skip


def small_checkpoint(folder, **metadata):
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "random_states_0.pt").write_bytes(b"rng")
    write_manifest(
        folder,
        world_size=1,
        iteration=0,
        state_format="safetensors",
        contents=CONTENTS,
        metadata={**POSITION, **metadata},
    )
    return folder


def damaged(folder, problem):
    return f"{folder / 'manifest.json'}: {problem}; the manifest is damaged, so load a different checkpoint."


@pytest.mark.parametrize(("checksum", "hasher"), [("xxh3_128", xxhash.xxh3_128), ("sha256", hashlib.sha256)])
def test_files_are_hashed_by_slice_and_a_flip_is_located(tmp_path, checksum, hasher):
    checkpoint = tmp_path / "checkpoint_0"
    checkpoint.mkdir()
    big = checkpoint / "model.safetensors"
    big.write_bytes(bytes(range(256)) * ((CHUNK_BYTES + (8 << 20)) // 256))  # two slices: 32 MiB + 8 MiB
    (checkpoint / "random_states_0.pt").write_bytes(b"")
    write_manifest(
        checkpoint, world_size=1, iteration=0, state_format="safetensors", contents=CONTENTS, metadata={"step": 3},
        checksum=checksum,
    )  # fmt: skip
    manifest = read_manifest(checkpoint)
    assert manifest["format"] == MANIFEST_FORMAT == 5 and manifest["chunk_bytes"] == CHUNK_BYTES
    assert manifest["checksum"] == checksum
    assert manifest["step"] == 3 and manifest["state_format"] == "safetensors" and manifest["contents"] == CONTENTS
    data = bytearray(big.read_bytes())
    slices = [hasher(data[:CHUNK_BYTES]).hexdigest(), hasher(data[CHUNK_BYTES:]).hexdigest()]
    assert manifest["files"]["model.safetensors"]["digests"] == slices
    assert manifest["files"]["random_states_0.pt"]["digests"] == [hasher(b"").hexdigest()]
    assert manifest["digest"] == manifest_digest(manifest)

    data[CHUNK_BYTES + 5] ^= 1
    big.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        read_manifest(checkpoint)
    assert str(error.value) == (
        f"{big} does not match its {checksum} digest in the manifest (bytes {CHUNK_BYTES}-{len(data)}); the file is "
        "corrupted, so load a different checkpoint."
    )
    assert read_manifest(checkpoint, verify_checksums=False)["step"] == 3  # sizes alone cannot see a flip


def as_format_4(folder):
    """Rewrite a sha256 manifest as the previous version wrote it: format 4, slices listed as sha256_chunks."""

    def edit(manifest):
        assert manifest.pop("checksum") == "sha256"
        manifest["format"] = 4
        for entry in manifest["files"].values():
            entry["sha256_chunks"] = entry.pop("digests")

    rewrite_manifest(folder, edit)


def test_a_format_4_manifest_of_sha256_slices_still_verifies_and_locates_a_flip(tmp_path):
    folder = tmp_path / "checkpoint_0"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "random_states_0.pt").write_bytes(b"rng")
    write_manifest(
        folder, world_size=1, iteration=0, state_format="safetensors", contents=CONTENTS, metadata=POSITION,
        checksum="sha256",
    )  # fmt: skip
    as_format_4(folder)
    manifest = read_manifest(folder)
    assert manifest["format"] == 4 and "checksum" not in manifest
    assert manifest["files"]["model.safetensors"]["sha256_chunks"] == [hashlib.sha256(b"weights").hexdigest()]
    (folder / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder)
    assert str(error.value) == (
        f"{folder / 'model.safetensors'} does not match its sha256 digest in the manifest (bytes 0-7); the file is "
        "corrupted, so load a different checkpoint."
    )


def test_the_digest_covers_every_key_the_engine_and_the_caller_wrote(tmp_path):
    folder = small_checkpoint(tmp_path / "checkpoint_0", config_sha256="ab" * 32)
    original = (folder / "manifest.json").read_text()
    for edit in (
        lambda m: m["dataloaders"][0].update(samples_seen=641),
        lambda m: m["dataloaders"][0].update(samples_seen=10**9),
        lambda m: m.update(step=1000),
        lambda m: m.update(world_size=2),
        lambda m: m.update(config_sha256="cd" * 32),  # a key of the runner's, not the engine's
    ):
        (folder / "manifest.json").write_text(original)
        rewrite_manifest(folder, edit, redigest=False)
        with pytest.raises(CheckpointError) as error:
            read_manifest(folder, verify_checksums=False)
        assert str(error.value) == damaged(
            folder, "its digest does not match its content (it was edited or damaged after the save)"
        )
    (folder / "manifest.json").write_text(original)
    assert read_manifest(folder)["dataloaders"][0]["samples_seen"] == 640


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda m: m.update(step="ten"), "step is 'ten', not a non-negative integer or null"),
        (lambda m: m.update(step=-1), "step is -1, not a non-negative integer or null"),
        (lambda m: m.update(step=True), "step is True, not a non-negative integer or null"),
        (lambda m: m.update(chunk_bytes=0),
         f"chunk_bytes is 0, not a positive multiple of {mmap.ALLOCATIONGRANULARITY}"),
        (lambda m: m.update(chunk_bytes=1000),  # slices are memory-mapped: their offsets must be mappable
         f"chunk_bytes is 1000, not a positive multiple of {mmap.ALLOCATIONGRANULARITY}"),
        (lambda m: m.update(world_size=0), "world_size is 0, not a positive integer"),
        (lambda m: m.update(world_size=1.5), "world_size is 1.5, not a positive integer"),
        (lambda m: m.update(iteration=-2), "iteration is -2, not a non-negative integer or null"),
        (lambda m: m.update(epoch="0"), "epoch is '0', not a non-negative integer or null"),
        (lambda m: m.update(optimizer_steps=[1, -1]),
         "optimizer_steps is [1, -1], not a list of non-negative integers"),
        (lambda m: m.update(accumulation_step=None), "accumulation_step is None, not a non-negative integer"),
        (lambda m: m.update(accumulation_steps=0), "accumulation_steps is 0, not a positive integer"),
        (lambda m: m.update(dataloaders={"epoch": 0}), "dataloaders is {'epoch': 0}, not a list of objects"),
        (lambda m: m.update(dataloaders=[[0, 640]]), "dataloaders is [[0, 640]], not a list of objects"),
        (lambda m: m["dataloaders"][0].update(samples_seen=-640),
         "dataloaders[0].samples_seen is -640, not a non-negative integer"),
        (lambda m: m["dataloaders"][0].pop("epoch"), "dataloaders[0].epoch is missing"),
        (lambda m: m["dataloaders"][0].update(seed="x"), "dataloaders[0].seed is 'x', not an integer"),
        (lambda m: m["dataloaders"][0].update(batches_seen=-2),
         "dataloaders[0].batches_seen is -2, not a non-negative integer"),
        (lambda m: m["dataloaders"][0].update(generators="AAAA"),
         "dataloaders[0].generators is 'AAAA', not a list of strings"),
        (lambda m: m["dataloaders"][0].update(generators=[], draw_seed=1.5),
         "dataloaders[0].draw_seed is 1.5, not an integer or null"),
        (lambda m: m["dataloaders"][0].update(generators=[], replay="yes"),
         "dataloaders[0].replay is 'yes', not true or false"),
        (lambda m: m.update(state_format="pickle"), "state_format is 'pickle', not 'safetensors' or 'dcp'"),
        (lambda m: m.pop("contents"), "contents is missing"),
        (lambda m: m["contents"].update(optimizers="1"), "contents.optimizers is '1', not a non-negative integer"),
        (lambda m: m["contents"].update(scaler=0), "contents.scaler is 0, not true or false"),
        (lambda m: m.update(files=[]), "files is [], not an object"),
        (lambda m: m["files"]["model.safetensors"].update(bytes="7"),
         "files['model.safetensors'].bytes is '7', not a non-negative integer"),
        (lambda m: m["files"]["model.safetensors"].update(digests=["beef"]),
         "files['model.safetensors'].digests is ['beef'], not a list of xxh3_128 hex digests"),
        (lambda m: m["files"]["model.safetensors"].update(digests=["0" * 64]),  # a sha256's length
         f"files['model.safetensors'].digests is ['{'0' * 55}..., not a list of xxh3_128 hex digests"),
        (lambda m: m["files"]["model.safetensors"].update(digests=[]),
         "files['model.safetensors'].digests has 0 digests, not 1 for 7 bytes"),
        (lambda m: m["files"]["model.safetensors"].update(sha256_chunks=["0" * 64]) or m["files"]["model.safetensors"]
         .pop("digests"), "files['model.safetensors'].digests is None, not a list of xxh3_128 hex digests"),
        (lambda m: m.update(checksum="md5"), "checksum is 'md5', not 'xxh3_128' or 'sha256'"),
        (lambda m: m.pop("checksum"), "checksum is missing"),
        (lambda m: m.update(created=20240101), "created is 20240101, not a string"),
        (lambda m: m.update(format="4"), "format is '4', not 5"),
        (lambda m: m.update(format=6), "format is 6, not 5"),
    ],
)  # fmt: skip
def test_every_field_is_checked_for_its_type_and_range(tmp_path, edit, problem):
    folder = small_checkpoint(tmp_path / "checkpoint_0")
    rewrite_manifest(folder, edit)  # with a matching digest: the field itself is refused
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder, verify_checksums=False)
    assert str(error.value) == damaged(folder, problem)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda m: m["contents"].update(scaler=True), "files does not list scaler.pt"),
        (
            lambda m: m.update(optimizer_steps=[0]) or m["contents"].update(optimizers=1),
            "files does not list optimizer.bin",
        ),
        (lambda m: m["contents"].update(models=2), "files does not list model_1.safetensors"),
        (lambda m: m.update(world_size=2), "files does not list random_states_1.pt"),
        (lambda m: m.update(files={}), "files does not list model.safetensors"),
        (lambda m: m.update(state_format="dcp"), "files does not list model/.metadata"),
        (
            lambda m: m.update(accumulation_step=1, accumulation_steps=2) or m["contents"].update(gradients=True),
            "files does not list gradients_0.safetensors",
        ),
        (lambda m: m["contents"].update(schedulers=1), "files does not list scheduler.bin"),
        (lambda m: m["contents"].update(custom_objects=1), "files does not list custom_checkpoint_0.pt"),
    ],
)
def test_a_listing_that_lacks_what_the_contents_call_for_is_damaged(tmp_path, edit, problem):
    folder = small_checkpoint(tmp_path / "checkpoint_0")
    rewrite_manifest(folder, edit)
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder, verify_checksums=False)
    assert str(error.value) == damaged(folder, f"{problem}, which its contents and state_format call for")


def test_gradients_are_recorded_exactly_for_a_save_in_the_middle_of_a_cycle(tmp_path):
    folder = small_checkpoint(tmp_path / "checkpoint_0")
    rewrite_manifest(folder, lambda m: m.update(accumulation_step=3, accumulation_steps=4))
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder)
    assert str(error.value) == damaged(
        folder, "contents.gradients is false, but accumulation_step 3 of 4 says otherwise"
    )


def test_a_listing_that_drops_the_loaders_or_their_steps_is_damaged(tmp_path):
    folder = small_checkpoint(tmp_path / "checkpoint_0")
    original = (folder / "manifest.json").read_text()
    rewrite_manifest(folder, lambda m: m.update(dataloaders=[]))
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder)
    assert str(error.value) == damaged(folder, "dataloaders lists 0 position(s), not contents.dataloaders")
    (folder / "manifest.json").write_text(original)
    rewrite_manifest(folder, lambda m: m.update(optimizer_steps=[4]))
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder)
    assert str(error.value) == damaged(folder, "optimizer_steps lists 1 count(s), not contents.optimizers")


@pytest.mark.parametrize(
    "name",
    ["../../outside.txt", "../checkpoint_1/model.safetensors", "/etc/hostname", "a/../../outside.txt", "./x", "a//b",
     "", "manifest.json", "a\\..\\b"],
)  # fmt: skip
def test_names_outside_the_folder_are_refused_before_anything_is_touched(tmp_path, monkeypatch, name):
    folder = small_checkpoint(tmp_path / "checkpoint_0")
    (tmp_path / "outside.txt").write_text("not the checkpoint's")
    rewrite_manifest(folder, lambda m: m["files"].update({name: {"bytes": 3, "digests": ["0" * 32]}}))
    touched = []
    lstat = os.lstat
    monkeypatch.setattr(os, "lstat", lambda path, *args, **kwargs: touched.append(path) or lstat(path, *args, **kwargs))
    monkeypatch.setattr(manifests, "slice_digest", lambda path, *args: touched.append(path))
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder)
    assert str(error.value) == damaged(
        folder, f"files lists {name!r}, which is not a path inside the checkpoint folder"
    )
    assert touched == []


def test_a_listed_symlink_or_a_name_through_one_is_refused_before_it_is_hashed(tmp_path, monkeypatch):
    folder = small_checkpoint(tmp_path / "checkpoint_0")
    outside = tmp_path / "secrets"
    outside.mkdir()
    (outside / "key.txt").write_text("0123456789")
    (folder / "linked").symlink_to(outside)
    (folder / "config.yaml").symlink_to(outside / "key.txt")
    original = (folder / "manifest.json").read_text()
    hashed = []
    monkeypatch.setattr(manifests, "slice_digest", lambda path, *args: hashed.append(path))
    for name, sentence in (
        ("linked/key.txt", f"{folder / 'linked/key.txt'} goes through the symbolic link {folder / 'linked'}"),
        ("config.yaml", f"{folder / 'config.yaml'} is a symbolic link"),
    ):
        (folder / "manifest.json").write_text(original)
        entry = {name: {"bytes": 10, "digests": ["0" * 32]}}
        rewrite_manifest(folder, lambda m, entry=entry: m["files"].update(entry))
        with pytest.raises(CheckpointError) as error:
            read_manifest(folder)
        assert str(error.value) == f"{sentence}; a checkpoint holds only its own files, so load a different checkpoint."
        assert "10 bytes" not in str(error.value) and hashed == []


def test_a_manifest_of_an_earlier_format_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    for old in (
        {"format": 2, "step": 1, "files": {"model.safetensors": {"bytes": 7, "sha256": "0" * 64}}},
        {"format": 3, "chunk_bytes": CHUNK_BYTES, "world_size": 1, "files": {}},
    ):
        (tmp_path / "manifest.json").write_text(json.dumps(old))
        with pytest.raises(CheckpointError) as error:
            read_manifest(tmp_path)
        assert str(error.value) == (
            f"{tmp_path / 'manifest.json'}: format is {old['format']}, not 5: it was written by an earlier version "
            "and carries no digest of its own, so load a checkpoint saved by this version or start a new run."
        )


def test_a_manifest_that_is_not_json_is_one_sentence(tmp_path):
    folder = small_checkpoint(tmp_path / "checkpoint_0")
    (folder / "manifest.json").write_text('{"format": 4,')
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder)
    assert str(error.value) == damaged(
        folder, "it is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 14 (char 13))"
    )
    (folder / "manifest.json").write_text("[4]")
    with pytest.raises(CheckpointError, match=r"manifest.json: it is not a JSON object; the manifest is damaged"):
        read_manifest(folder)


def test_metadata_that_the_manifest_would_refuse_is_refused_at_save(tmp_path):
    with pytest.raises(ValueError) as error:
        check_metadata({"files": {}})
    assert str(error.value) == "save_state(metadata=...) sets 'files', which the manifest records itself; rename it."
    with pytest.raises(ValueError) as error:
        check_metadata({"step": "ten"})
    assert str(error.value) == (
        "save_state(metadata=...): step is 'ten', not a non-negative integer or null; pass a value of that type."
    )
    with pytest.raises(ValueError, match=r"save_state\(metadata=...\) is not JSON \(Object of type set"):
        check_metadata({"tags": {"a"}})
    check_metadata({**POSITION, "config_sha256": "ab" * 32, "loss": 0.5})


def node_copy(folder, *, ranks):
    """One node's copy of a checkpoint of 3 processes (save_on_each_node): the RNG states of ``ranks`` only."""
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    for rank in ranks:
        (folder / f"random_states_{rank}.pt").write_bytes(b"rng")
    write_manifest(
        folder,
        world_size=3,
        iteration=0,
        state_format="safetensors",
        contents=CONTENTS,
        metadata=POSITION,
        node_local_ranks=ranks,
    )
    return folder


def test_a_node_copy_lists_its_own_ranks_files_only(tmp_path):
    manifest = read_manifest(node_copy(tmp_path / "checkpoint_0", ranks=[1, 2]))
    assert manifest["node_local_ranks"] == [1, 2]
    assert set(manifest["files"]) == {"model.safetensors", "random_states_1.pt", "random_states_2.pt"}
    assert "node_local_ranks" not in read_manifest(small_checkpoint(tmp_path / "shared"))  # a shared folder's


NOT_RANKS = "not a non-empty ascending list of distinct ranks"


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda m: m.update(node_local_ranks=1), f"node_local_ranks is 1, {NOT_RANKS}"),
        (lambda m: m.update(node_local_ranks=[]), f"node_local_ranks is [], {NOT_RANKS}"),
        (lambda m: m.update(node_local_ranks=[2, 1]), f"node_local_ranks is [2, 1], {NOT_RANKS}"),
        (lambda m: m.update(node_local_ranks=[1, 1]), f"node_local_ranks is [1, 1], {NOT_RANKS}"),
        (lambda m: m.update(node_local_ranks=["1"]), f"node_local_ranks is ['1'], {NOT_RANKS}"),
        (lambda m: m.update(node_local_ranks=[1, 3]), "node_local_ranks lists rank 3, outside world_size 3"),
        (lambda m: m.update(node_local_ranks=[0, 1]),
         "files does not list random_states_0.pt, which its contents and state_format call for"),
    ],
)  # fmt: skip
def test_node_local_ranks_is_checked_for_its_type_range_and_files(tmp_path, edit, problem):
    folder = node_copy(tmp_path / "checkpoint_0", ranks=[1])
    rewrite_manifest(folder, edit)
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder, verify_checksums=False)
    assert str(error.value) == damaged(folder, problem)


def test_save_state_metadata_cannot_set_node_local_ranks():
    with pytest.raises(ValueError) as error:
        check_metadata({"node_local_ranks": [0]})
    assert str(error.value) == (
        "save_state(metadata=...) sets 'node_local_ranks', which the manifest records itself; rename it."
    )
