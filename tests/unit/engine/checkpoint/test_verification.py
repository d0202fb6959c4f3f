"""Each byte of a checkpoint is hashed once per save and once per resume, with xxh3_128 (or sha256), and any
damage to any kind of file is refused before anything is loaded, named with its byte range."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.engine import (
    Accelerator,
    CheckpointError,
    FullyShardedDataParallelPlugin,
    ProjectConfiguration,
)
from runner.engine.checkpoint import manifest as manifests
from runner.engine.checkpoint.manifest import VerifiedCheckpoint, read_manifest
from runner.engine.checkpoint.manifest_schema import CHECKSUMS

_FIXED_SEED = 0


class Counter:
    """A registered object: it is saved as custom_checkpoint_0.pt."""

    def __init__(self) -> None:
        self.count = 7

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def prepared(*, checksum: str = "xxh3_128", accumulation: int = 1, fsdp: bool = False):
    """A model, AdamW, a StepLR and a registered object, prepared, after one optimizer step."""
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"]) if fsdp else None
    accelerator = Accelerator(
        gradient_accumulation_steps=accumulation,
        fsdp_plugin=plugin,
        project_config=ProjectConfiguration(checksum=checksum),
    )
    torch.manual_seed(_FIXED_SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(Counter())
    for _ in range(accumulation):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(2, 4)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return accelerator, model


def save(accelerator, folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's notes on one process
        accelerator.save_state(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One checkpoint of every kind of file: replicated (mid accumulation cycle, so with gradients) and FSDP's."""
    root = tmp_path_factory.mktemp("verification")
    mid_cycle, model = prepared(accumulation=2)
    with mid_cycle.accumulate(model):  # half a cycle: pending gradients are saved
        mid_cycle.backward(model(torch.randn(2, 4)).sum())
    sharded, _ = prepared(fsdp=True)
    return {"replicated": save(mid_cycle, root / "replicated"), "dcp": save(sharded, root / "dcp")}


def copy_of(checkpoint: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(checkpoint, tmp_path / checkpoint.name))


def counted_slices(monkeypatch) -> list[tuple[str, int, int]]:
    hashed: list[tuple[str, int, int]] = []
    digest = manifests.slice_digest

    def counting(path, offset, length, checksum):
        hashed.append((Path(path).name, offset, length))
        return digest(path, offset, length, checksum)

    monkeypatch.setattr(manifests, "slice_digest", counting)
    return hashed


def test_a_save_lists_every_file_with_xxh3_128_digests_of_its_slices(checkpoints):
    manifest = json.loads((checkpoints["replicated"] / "manifest.json").read_text())
    assert manifest["format"] == 5 and manifest["checksum"] == "xxh3_128"
    assert set(manifest["files"]) == {
        "model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pt", "random_states_0.pt",
        "gradients_0.safetensors",
    }  # fmt: skip
    for name, entry in manifest["files"].items():
        data = (checkpoints["replicated"] / name).read_bytes()
        assert entry == {"bytes": len(data), "digests": [CHECKSUMS["xxh3_128"][0](data).hexdigest()]}


def _every_file(kind: str) -> list[tuple[str, str]]:
    replicated = ["model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pt",
                  "random_states_0.pt", "gradients_0.safetensors"]  # fmt: skip
    dcp = ["model/.metadata", "model/__0_0.distcp", "optimizer/.metadata", "optimizer/__0_0.distcp"]
    return [("replicated", name) for name in replicated] if kind == "replicated" else [("dcp", name) for name in dcp]


@pytest.mark.parametrize(("kind", "name"), _every_file("replicated") + _every_file("dcp"))
def test_one_flipped_byte_in_any_file_is_refused_before_anything_is_loaded(checkpoints, tmp_path, kind, name):
    folder = copy_of(checkpoints[kind], tmp_path)
    path = folder / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    accelerator, model = prepared(fsdp=kind == "dcp", accumulation=2 if kind == "replicated" else 1)
    before = {key: value.clone() for key, value in accelerator.get_state_dict(model).items()}
    with pytest.raises(CheckpointError) as error:
        accelerator.load_state(folder)
    assert str(error.value) == (
        f"{path} does not match its xxh3_128 digest in the manifest (bytes 0-{len(data)}); the file is corrupted, so "
        "load a different checkpoint."
    )
    after = accelerator.get_state_dict(model)
    assert all(torch.equal(before[key], after[key]) for key in before)  # verified before anything was loaded


@pytest.mark.parametrize("change", ["truncate", "extend"])
def test_a_truncated_or_extended_file_is_refused_by_its_size(checkpoints, tmp_path, change):
    folder = copy_of(checkpoints["replicated"], tmp_path)
    path = folder / "optimizer.bin"
    size = path.stat().st_size
    data = path.read_bytes()
    path.write_bytes(data[:-3] if change == "truncate" else data + b"\0\0\0")
    accelerator, _ = prepared(accumulation=2)
    with pytest.raises(CheckpointError) as error:
        accelerator.load_state(folder)
    now = size - 3 if change == "truncate" else size + 3
    assert str(error.value) == (
        f"{path} has {now} bytes but the manifest says {size}; the file is truncated or was changed, so load a "
        "different checkpoint."
    )


def test_sha256_is_selectable_and_catches_a_flip(tmp_path):
    accelerator, _ = prepared(checksum="sha256")
    folder = save(accelerator, tmp_path / "ck")
    manifest = read_manifest(folder)
    assert manifest["checksum"] == "sha256"
    assert all(len(digest) == 64 for entry in manifest["files"].values() for digest in entry["digests"])
    path = folder / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as error:
        prepared()[0].load_state(folder)  # the digest the checkpoint records, whatever this run's setting
    assert str(error.value).startswith(f"{path} does not match its sha256 digest in the manifest (bytes 0-")


def test_an_unknown_checksum_is_one_sentence():
    with pytest.raises(ValueError) as error:
        ProjectConfiguration(checksum="md5")
    assert str(error.value) == "checksum='md5' is not a digest checkpoints record; use 'xxh3_128' or 'sha256'."


def test_a_save_and_a_load_each_hash_every_slice_once(tmp_path, monkeypatch):
    accelerator, _ = prepared()
    hashed = counted_slices(monkeypatch)
    folder = save(accelerator, tmp_path / "ck")
    slices = sorted((Path(piece.name).name, piece.offset, piece.length) for piece in _all_slices(folder))
    assert sorted(hashed) == slices  # each file hashed once, by the rank that wrote it: no read-back on commit
    hashed.clear()
    prepared()[0].load_state(folder)
    assert sorted(hashed) == slices


def _all_slices(folder: Path) -> list:
    return manifests.manifest_slices(read_manifest(folder, verify_checksums=False))


def test_a_save_the_launching_process_verified_is_not_hashed_again_once(tmp_path, monkeypatch):
    accelerator, model = prepared()
    folder = save(accelerator, tmp_path / "ck")
    verified = VerifiedCheckpoint.of(folder, read_manifest(folder))  # what `runner resume=...` hands the workers
    hashed = counted_slices(monkeypatch)
    fresh, _ = prepared()
    fresh.mark_verified(verified)
    fresh.load_state(folder)
    assert hashed == []
    fresh.load_state(folder)  # the mark is used once: a later load of the folder verifies it again
    assert len(hashed) == len(_all_slices(folder))


def test_the_mark_covers_only_the_save_it_was_made_for(tmp_path, monkeypatch):
    accelerator, _ = prepared()
    folder = save(accelerator, tmp_path / "ck")
    verified = VerifiedCheckpoint.of(folder, read_manifest(folder))
    accelerator.save_state(folder, metadata={"note": "saved again"})  # in place: another manifest digest
    hashed = counted_slices(monkeypatch)
    fresh, _ = prepared()
    fresh.mark_verified(verified)
    fresh.load_state(folder)
    assert len(hashed) == len(_all_slices(folder))


def test_a_file_that_cannot_be_read_while_hashed_is_one_sentence(checkpoints, monkeypatch):
    import errno

    def failing(path, offset, length, checksum):
        raise OSError(errno.EIO, "Input/output error", str(path))

    monkeypatch.setattr(manifests, "slice_digest", failing)
    folder = checkpoints["replicated"]
    with pytest.raises(CheckpointError) as error:
        read_manifest(folder)
    assert str(error.value).startswith(f"{folder} could not be read ([Errno 5] Input/output error: ")
    assert str(error.value).endswith("; load a different checkpoint, or fix the disk.")


def test_the_ranks_find_the_newest_intact_checkpoint_together_and_mark_it(tmp_path, monkeypatch):
    from runner.engine.checkpoint.loading import newest_verified_checkpoint

    accelerator, _ = prepared()
    for name in ("checkpoint_0", "checkpoint_1"):
        save(accelerator, tmp_path / name)
    damaged = tmp_path / "checkpoint_1" / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 1
    damaged.write_bytes(bytes(data))
    newest, skipped = newest_verified_checkpoint(tmp_path, accelerator.state)
    assert newest.folder == (tmp_path / "checkpoint_0").resolve()
    assert [(path.name, str(error).split(" (")[0]) for path, error in skipped] == [
        ("checkpoint_1", f"{damaged} does not match its xxh3_128 digest in the manifest")
    ]
    hashed = counted_slices(monkeypatch)
    fresh, _ = prepared()
    fresh.mark_verified(newest)
    fresh.load_state(newest.folder)
    assert hashed == []  # found verified: its load does not hash it again


def test_a_checkpoint_with_a_format_4_manifest_still_loads_verified(tmp_path, monkeypatch):
    from tests.unit.engine.checkpoint.test_manifest import as_format_4

    accelerator, model = prepared(checksum="sha256")
    folder = save(accelerator, tmp_path / "ck")
    as_format_4(folder)  # as the previous version wrote it: sha256 slices as sha256_chunks
    expected = {key: value.clone() for key, value in accelerator.get_state_dict(model).items()}
    hashed = counted_slices(monkeypatch)
    fresh, fresh_model = prepared()
    with torch.no_grad():
        for parameter in fresh_model.parameters():
            parameter.add_(1)
    fresh.load_state(folder)
    assert len(hashed) == len(_all_slices(folder))
    assert all(torch.equal(expected[key], value) for key, value in fresh.get_state_dict(fresh_model).items())
