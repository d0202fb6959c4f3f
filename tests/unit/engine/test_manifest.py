import hashlib
import json

import pytest

from runner.engine.manifest import CHUNK_BYTES, CheckpointError, read_manifest, write_manifest


def test_files_are_hashed_by_slice_and_a_flip_is_located(tmp_path):
    checkpoint = tmp_path / "checkpoint_0"
    checkpoint.mkdir()
    big = checkpoint / "model.safetensors"
    big.write_bytes(bytes(range(256)) * ((CHUNK_BYTES + (8 << 20)) // 256))  # two slices: 32 MiB + 8 MiB
    (checkpoint / "empty.bin").write_bytes(b"")
    write_manifest(checkpoint, world_size=1, iteration=0, metadata={"step": 3})
    manifest = read_manifest(checkpoint)
    assert manifest["format"] == 3 and manifest["chunk_bytes"] == CHUNK_BYTES and manifest["step"] == 3
    assert [len(entry["sha256_chunks"]) for entry in manifest["files"].values()] == [1, 2]
    assert manifest["files"]["empty.bin"]["sha256_chunks"] == [hashlib.sha256(b"").hexdigest()]

    data = bytearray(big.read_bytes())
    data[CHUNK_BYTES + 5] ^= 1
    big.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        read_manifest(checkpoint)
    assert str(error.value) == (
        f"{big} does not match its sha256 in the manifest (bytes {CHUNK_BYTES}-{len(data)}); the file is corrupted, "
        "so load a different checkpoint."
    )
    assert read_manifest(checkpoint, verify_checksums=False)["step"] == 3  # sizes alone cannot see a flip


def test_a_manifest_with_whole_file_digests_still_verifies(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    files = {"model.safetensors": {"bytes": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}}
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 2, "step": 1, "files": files}))
    assert read_manifest(tmp_path)["step"] == 1
    (tmp_path / "model.safetensors").write_bytes(b"weighty")
    with pytest.raises(CheckpointError, match=r"model.safetensors does not match its sha256 in the manifest; the"):
        read_manifest(tmp_path)
