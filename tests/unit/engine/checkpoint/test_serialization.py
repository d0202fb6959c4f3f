"""runner/engine/checkpoint/serialization.py: sizes, single and sharded weights files, tied weights, loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.checkpoint.serialization import (
    load_checkpoint_in_model,
    load_safetensors,
    load_state_dict_files,
    parse_size,
    safetensors_shapes,
    save_model_files,
    save_safetensors,
)
from runner.engine.checkpoint.torch_files import torch_load, torch_save
from runner.engine.constants import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME


class Stack(nn.Module):
    """Several Linear layers: 4 x (16*16 + 16) float32 = 4 x 1088 bytes."""

    def __init__(self, depth: int = 4, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))


class Counter(nn.Module):
    """A float weight and an integer buffer, to see which tensors a dtype cast touches."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection's weight."""

    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight


def _nbytes(state_dict) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype, key
        assert torch.equal(loaded[key], tensor.detach()), key


def _weight_files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file())


# ---------------------------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        ("10GB", 10 * 10**9),
        ("1GB", 10**9),
        ("500MiB", 500 * 2**20),
        ("3KB", 3000),
        ("2KiB", 2048),
        ("1TB", 10**12),
        ("1GiB", 2**30),
        ("7B", 7),
        ("1.5GB", 1_500_000_000),
        (" 4 kb ", 4000),
        ("10gib", 10 * 2**30),
        (1234, 1234),
        (0, 0),
    ],
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("bad", ["ten GB", "10XB", "GB", "10 G B", "", "-5MB"])
def test_parse_size_bad_string_names_it(bad):
    with pytest.raises(ValueError, match="is not a size") as info:
        parse_size(bad)
    assert f"max_shard_size={bad!r}" in str(info.value)


def test_parse_size_bare_ib_unit_is_a_value_error():
    with pytest.raises(ValueError, match="'10iB'"):
        parse_size("10iB")


# ---------------------------------------------------------------------------------------------- single file


def test_single_file_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = Stack()
    written = save_model_files(model.state_dict(), tmp_path)

    assert written == [tmp_path / SAFE_WEIGHTS_NAME, tmp_path / SAFE_WEIGHTS_INDEX_NAME]
    assert _weight_files(tmp_path) == [SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME]
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())  # the record of what this save wrote
    assert set(index["weight_map"].values()) == {SAFE_WEIGHTS_NAME} and sorted(index["weight_map"]) == sorted(
        model.state_dict()
    )

    torch.manual_seed(1)
    fresh = Stack()
    assert not torch.equal(fresh.layers[0].weight, model.layers[0].weight)
    result = load_checkpoint_in_model(fresh, tmp_path)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    _assert_same(fresh.state_dict(), model.state_dict())


def test_load_from_file_path_directly(tmp_path):
    model = Stack(depth=2)
    save_model_files(model.state_dict(), tmp_path)
    _assert_same(load_state_dict_files(tmp_path / SAFE_WEIGHTS_NAME), model.state_dict())


# ---------------------------------------------------------------------------------------------- sharded


def test_sharded_save_writes_shards_and_index(tmp_path):
    torch.manual_seed(0)
    model = Stack(depth=4)
    state_dict = model.state_dict()
    # Each layer is 1088 bytes; 2500 bytes fit two layers per shard.
    written = save_model_files(state_dict, tmp_path, max_shard_size=2500)

    shards = [f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)]
    assert [p.name for p in written] == [*shards, SAFE_WEIGHTS_INDEX_NAME]
    assert _weight_files(tmp_path) == sorted([*shards, SAFE_WEIGHTS_INDEX_NAME])

    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == _nbytes(state_dict) == 4 * 1088
    assert sorted(index["weight_map"]) == sorted(state_dict)
    assert set(index["weight_map"].values()) == set(shards)
    # Every key is really inside the shard the index names.
    for key, shard in index["weight_map"].items():
        with safe_open(str(tmp_path / shard), framework="pt") as f:
            assert key in f.keys(), (key, shard)

    torch.manual_seed(1)
    fresh = Stack(depth=4)
    load_checkpoint_in_model(fresh, tmp_path, strict=True)
    _assert_same(fresh.state_dict(), state_dict)
    # The index json itself is a valid checkpoint path.
    _assert_same(load_state_dict_files(tmp_path / SAFE_WEIGHTS_INDEX_NAME), state_dict)


def test_sharded_save_with_kb_string_size(tmp_path):
    model = Stack(depth=6)
    written = save_model_files(model.state_dict(), tmp_path, max_shard_size="2KB")
    # 2000 bytes hold one 1088-byte layer each: six shards plus the index.
    assert len(written) == 7
    assert written[0].name == "model-00001-of-00006.safetensors"
    assert written[5].name == "model-00006-of-00006.safetensors"
    _assert_same(load_state_dict_files(tmp_path), model.state_dict())


def test_resave_with_fewer_shards_removes_stale_ones(tmp_path):
    model = Stack(depth=6)
    save_model_files(model.state_dict(), tmp_path, max_shard_size=1100)  # one layer per shard
    assert len(list(tmp_path.glob("model-*-of-00006.safetensors"))) == 6
    (tmp_path / "notes.txt").write_text("keep me")

    torch.manual_seed(3)
    newer = Stack(depth=6)
    save_model_files(newer.state_dict(), tmp_path, max_shard_size=3300)  # three layers per shard
    shards = [f"model-{i:05d}-of-00002.safetensors" for i in (1, 2)]
    assert _weight_files(tmp_path) == sorted([*shards, SAFE_WEIGHTS_INDEX_NAME, "notes.txt"])
    _assert_same(load_state_dict_files(tmp_path), newer.state_dict())

    # Back to one file: shards and index go too.
    save_model_files(model.state_dict(), tmp_path)
    assert _weight_files(tmp_path) == sorted([SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "notes.txt"])
    _assert_same(load_state_dict_files(tmp_path), model.state_dict())


def test_switching_format_removes_the_other_format(tmp_path):
    model = Stack(depth=2)
    save_model_files(model.state_dict(), tmp_path)
    save_model_files(model.state_dict(), tmp_path, safe_serialization=False)
    assert _weight_files(tmp_path) == [WEIGHTS_NAME, WEIGHTS_INDEX_NAME]
    save_model_files(model.state_dict(), tmp_path, max_shard_size=1100)
    assert _weight_files(tmp_path) == sorted(
        ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", SAFE_WEIGHTS_INDEX_NAME]
    )


# ---------------------------------------------------------------------------------------------- tied weights


def test_tied_weights_stored_once_and_restored(tmp_path):
    torch.manual_seed(0)
    model = TiedLM()
    state_dict = model.state_dict()
    assert state_dict["embed.weight"].data_ptr() == state_dict["head.weight"].data_ptr()

    written = save_model_files(state_dict, tmp_path)
    assert written == [tmp_path / SAFE_WEIGHTS_NAME, tmp_path / SAFE_WEIGHTS_INDEX_NAME]

    with safe_open(str(tmp_path / SAFE_WEIGHTS_NAME), framework="pt") as f:
        stored = sorted(f.keys())
    # The shared tensor is written once, under one of its two names.
    assert len(stored) == len(state_dict) - 1
    assert len({"embed.weight", "head.weight"} & set(stored)) == 1
    assert {"hidden.weight", "hidden.bias"} <= set(stored)
    unique_bytes = _nbytes({k: v for k, v in state_dict.items() if k != "head.weight"})
    assert (tmp_path / SAFE_WEIGHTS_NAME).stat().st_size < unique_bytes + 32 * 8 * 4  # not twice the table

    loaded = load_state_dict_files(tmp_path)
    _assert_same(loaded, state_dict)

    torch.manual_seed(1)
    fresh = TiedLM()
    load_checkpoint_in_model(fresh, tmp_path, strict=True)
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert torch.equal(fresh.head.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight


def test_only_the_tensors_asked_for_are_read_and_shapes_come_from_the_header(tmp_path):
    torch.manual_seed(0)
    state_dict = TiedLM().state_dict()
    save_safetensors(state_dict, tmp_path / "w.safetensors")
    assert safetensors_shapes(tmp_path / "w.safetensors") == {name: tuple(t.shape) for name, t in state_dict.items()}
    asked = load_safetensors(tmp_path / "w.safetensors", names=["head.weight", "hidden.bias"])
    assert sorted(asked) == ["embed.weight", "head.weight", "hidden.bias"]  # the alias brings the tensor it names
    assert torch.equal(asked["head.weight"], state_dict["embed.weight"]) and "hidden.weight" not in asked


@pytest.mark.parametrize(
    ("aliases", "problem"),
    [
        ('{"head.weight": "gone"}', "maps 'head.weight' to 'gone', a tensor the file does not hold"),
        ('{"hidden.bias": "embed.weight"}', "maps 'hidden.bias', a tensor the file holds itself, to 'embed.weight'"),
        ('{"head.weight": null}', "is not a JSON object of tensor names (name -> stored name)"),
        ('"head.weight"', "is not a JSON object of tensor names (name -> stored name)"),
        ("not json", "is not a JSON object of tensor names (name -> stored name)"),
    ],
)
def test_aliases_that_name_no_tensor_of_the_file_are_one_sentence(tmp_path, aliases, problem):
    path = tmp_path / "w.safetensors"
    tensors = {"embed.weight": torch.ones(4, 2), "hidden.bias": torch.zeros(2)}
    save_file(tensors, path, metadata={"format": "pt", "aliases": aliases})
    for read in (load_safetensors, safetensors_shapes, load_state_dict_files):
        with pytest.raises(CheckpointError) as refused:
            read(path)
        assert str(refused.value) == (
            f"{path}: its aliases metadata {problem}; the file is damaged, so write it again or load a different one."
        )


def test_the_same_weights_always_give_the_same_bytes(tmp_path):
    # safetensors orders a file's metadata entries (ours: format and aliases) at random from one save to the
    # next; each save sorts them, so the file is the same bytes every time, one file or sharded.
    torch.manual_seed(0)
    state_dict = TiedLM().state_dict()
    for shard_size in ("10GB", "2KB"):  # one file; shards and an index
        files = []
        for copy_number in range(8):
            folder = tmp_path / f"{shard_size}-{copy_number}"
            written = save_model_files(state_dict, folder, max_shard_size=shard_size)
            files.append({path.name: path.read_bytes() for path in written})
        assert all(each == files[0] for each in files[1:])
        for name, content in files[0].items():
            if name.endswith(".safetensors"):
                length = int.from_bytes(content[:8], "little")
                header = json.loads(content[8 : 8 + length])
                assert list(header)[0] == "__metadata__" and list(header["__metadata__"]) == ["aliases", "format"]
    _assert_same(load_state_dict_files(tmp_path / "10GB-7"), state_dict)
    _assert_same(load_state_dict_files(tmp_path / "2KB-7"), state_dict)


def test_tied_weights_sharded_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = TiedLM(vocab=64, dim=16)  # embed: 4096 bytes; hidden: 1088 bytes
    state_dict = model.state_dict()
    written = save_model_files(state_dict, tmp_path, max_shard_size=4096)
    assert [p.name for p in written][-1] == SAFE_WEIGHTS_INDEX_NAME
    assert len(written) == 3

    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(state_dict)
    assert index["weight_map"]["head.weight"] == index["weight_map"]["embed.weight"]
    assert index["metadata"]["total_size"] == 64 * 16 * 4 + 1088

    _assert_same(load_state_dict_files(tmp_path), state_dict)


def test_tied_weights_bin_sharded_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = TiedLM(vocab=64, dim=16)
    state_dict = model.state_dict()
    written = save_model_files(state_dict, tmp_path, max_shard_size=4096, safe_serialization=False)
    assert [p.name for p in written] == [
        "pytorch_model-00001-of-00002.bin",
        "pytorch_model-00002-of-00002.bin",
        "pytorch_model.bin.index.json",
    ]
    _assert_same(load_state_dict_files(tmp_path), state_dict)


# ---------------------------------------------------------------------------------------------- .bin


def test_pickle_format_roundtrip(tmp_path):
    torch.manual_seed(0)
    model = Counter()
    written = save_model_files(model.state_dict(), tmp_path, safe_serialization=False)
    assert written == [tmp_path / WEIGHTS_NAME, tmp_path / WEIGHTS_INDEX_NAME]
    assert _weight_files(tmp_path) == [WEIGHTS_NAME, WEIGHTS_INDEX_NAME]

    torch.manual_seed(1)
    fresh = Counter()
    fresh.steps.zero_()
    load_checkpoint_in_model(fresh, tmp_path, strict=True)
    _assert_same(fresh.state_dict(), model.state_dict())


# ---------------------------------------------------------------------------------------------- loading


def test_load_from_folder_without_weights_names_the_folder(tmp_path):
    empty = tmp_path / "nothing_here"
    empty.mkdir()
    (empty / "readme.txt").write_text("no weights")
    with pytest.raises(FileNotFoundError) as info:
        load_state_dict_files(empty)
    assert str(empty) in str(info.value)
    assert SAFE_WEIGHTS_NAME in str(info.value)


def test_load_missing_file_raises(tmp_path):
    missing = tmp_path / "gone.safetensors"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_state_dict_files(missing)


def test_load_with_dtype_casts_float_tensors_only(tmp_path):
    torch.manual_seed(0)
    model = Counter()
    save_model_files(model.state_dict(), tmp_path)

    fresh = Counter().to(torch.bfloat16)
    load_checkpoint_in_model(fresh, tmp_path, dtype=torch.bfloat16)
    assert fresh.linear.weight.dtype == torch.bfloat16
    assert torch.equal(fresh.linear.weight, model.linear.weight.to(torch.bfloat16))
    assert torch.equal(fresh.linear.bias, model.linear.bias.to(torch.bfloat16))
    assert fresh.steps.dtype == torch.int64
    assert torch.equal(fresh.steps, torch.arange(5))


def test_dtype_cast_values_are_the_rounded_ones(tmp_path, monkeypatch):
    model = Counter()
    with torch.no_grad():
        model.linear.weight.fill_(1.0 + 2**-12)  # not representable in bfloat16: rounds to 1.0
    save_model_files(model.state_dict(), tmp_path)

    received = {}
    fresh = Counter()

    def capture(state_dict, strict=False):
        received.update(state_dict)
        return nn.Module.load_state_dict(fresh, state_dict, strict=strict)

    monkeypatch.setattr(fresh, "load_state_dict", capture)
    load_checkpoint_in_model(fresh, tmp_path, dtype=torch.bfloat16)
    assert received["linear.weight"].dtype == torch.bfloat16
    assert received["linear.bias"].dtype == torch.bfloat16
    assert received["steps"].dtype == torch.int64
    # Cast before load_state_dict copies into the float32 module: the value went through bfloat16.
    assert torch.all(fresh.linear.weight == 1.0)


def test_strict_load_with_mismatching_model_raises(tmp_path):
    save_model_files(Stack(depth=2).state_dict(), tmp_path)

    with pytest.raises(RuntimeError, match="Unexpected key"):
        load_checkpoint_in_model(Stack(depth=1), tmp_path, strict=True)
    with pytest.raises(RuntimeError, match="Missing key"):
        load_checkpoint_in_model(Stack(depth=3), tmp_path, strict=True)

    # Not strict: the extra keys are reported, not raised.
    result = load_checkpoint_in_model(Stack(depth=1), tmp_path)
    assert sorted(result.unexpected_keys) == ["layers.1.bias", "layers.1.weight"]


def test_shape_mismatch_raises_even_when_not_strict(tmp_path):
    save_model_files(Stack(depth=1, width=16).state_dict(), tmp_path)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_checkpoint_in_model(Stack(depth=1, width=8), tmp_path)


def test_save_into_a_file_path_raises(tmp_path):
    target = tmp_path / "weights"
    target.write_text("a file")
    with pytest.raises(ValueError, match="is a file"):
        save_model_files(Stack(depth=1).state_dict(), target)


# ---------------------------------------------------------------------------------------------- only our own files


def test_resaving_leaves_weights_it_did_not_write(tmp_path):
    (tmp_path / WEIGHTS_NAME).write_bytes(b"the user's")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"the user's shard")
    foreign = {"metadata": {"total_size": 1}, "weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / WEIGHTS_INDEX_NAME).write_text(json.dumps(foreign))  # an index of someone else's: not a record of ours
    model = Stack(depth=2)
    save_model_files(model.state_dict(), tmp_path)
    assert _weight_files(tmp_path) == sorted(
        [
            SAFE_WEIGHTS_NAME,
            SAFE_WEIGHTS_INDEX_NAME,
            WEIGHTS_NAME,
            WEIGHTS_INDEX_NAME,
            "model-00001-of-00002.safetensors",
        ]
    )
    assert (tmp_path / WEIGHTS_NAME).read_bytes() == b"the user's"
    assert (tmp_path / "model-00001-of-00002.safetensors").read_bytes() == b"the user's shard"
    _assert_same(load_state_dict_files(tmp_path), model.state_dict())


def test_only_our_own_names_that_our_index_records_are_removed(tmp_path):
    save_model_files(Stack(depth=2).state_dict(), tmp_path, max_shard_size=1100)
    index = json.loads((tmp_path / SAFE_WEIGHTS_INDEX_NAME).read_text())
    index["weight_map"].update({"x": "notes.txt", "y": "../outside.safetensors", "z": "sub/model.safetensors"})
    (tmp_path / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    (tmp_path / "notes.txt").write_text("keep")
    (tmp_path.parent / "outside.safetensors").write_text("keep")
    save_model_files(Stack(depth=2).state_dict(), tmp_path)
    assert _weight_files(tmp_path) == sorted([SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "notes.txt"])
    assert (tmp_path.parent / "outside.safetensors").read_text() == "keep"


def test_a_symlinked_save_directory_is_refused(tmp_path):
    users = tmp_path / "users_models"
    users.mkdir()
    (users / WEIGHTS_NAME).write_bytes(b"theirs")
    (tmp_path / "model").symlink_to(users)
    with pytest.raises(ValueError) as error:
        save_model_files(Stack(depth=1).state_dict(), tmp_path / "model")
    assert str(error.value) == (
        f"save_model writes only into a real folder, but {tmp_path / 'model'} is a symbolic link; pass the folder "
        "it points to, or another path."
    )
    assert _weight_files(users) == [WEIGHTS_NAME] and (users / WEIGHTS_NAME).read_bytes() == b"theirs"


def test_links_in_the_folder_are_replaced_or_left_never_written_or_deleted_through(tmp_path):
    folder, outside = tmp_path / "model", tmp_path / "outside"
    outside.mkdir()
    for name in ("weights", "partial", "shard"):
        (outside / name).write_bytes(b"theirs")
    save_model_files(Stack(depth=2).state_dict(), folder, max_shard_size=1100)  # two shards of ours
    (folder / "model-00002-of-00002.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").symlink_to(outside / "shard")  # recorded, but now a link
    (folder / SAFE_WEIGHTS_NAME).symlink_to(outside / "weights")
    (folder / f"{SAFE_WEIGHTS_NAME}.tmp").symlink_to(outside / "partial")
    model = Stack(depth=2)
    save_model_files(model.state_dict(), folder)
    assert [(outside / name).read_bytes() for name in ("weights", "partial", "shard")] == [b"theirs"] * 3
    assert not (folder / SAFE_WEIGHTS_NAME).is_symlink() and not (folder / f"{SAFE_WEIGHTS_NAME}.tmp").exists()
    assert (folder / "model-00002-of-00002.safetensors").is_symlink()  # not ours to delete any more
    _assert_same(load_state_dict_files(folder), model.state_dict())


def test_weights_of_someone_else_that_would_be_loaded_instead_are_refused(tmp_path):
    (tmp_path / SAFE_WEIGHTS_NAME).write_bytes(b"the user's")
    with pytest.raises(ValueError) as error:
        save_model_files(Stack(depth=1).state_dict(), tmp_path, safe_serialization=False)
    assert str(error.value) == (
        f"{tmp_path / SAFE_WEIGHTS_NAME} was not written by save_model, and loading {tmp_path} would read it instead "
        "of the new weights; move it away, or save to another folder."
    )
    assert _weight_files(tmp_path) == [SAFE_WEIGHTS_NAME]


def test_checkpoint_saves_skip_the_zip_crc32_and_load_back_exactly_in_memory_of_their_own(tmp_path):
    import zipfile

    base = torch.arange(6.0)
    obj = {"base": base, "view": base[2:4], "step": torch.tensor(3), "lr": 0.1}
    torch_save(obj, tmp_path / "with.bin")
    torch_save(obj, tmp_path / "without.bin", crc32=False)
    assert torch.serialization.get_crc32_options() is True  # switched off only during the save
    assert zipfile.ZipFile(tmp_path / "with.bin").testzip() is None
    assert zipfile.ZipFile(tmp_path / "without.bin").testzip() is not None  # zip tools see no CRC32

    loaded = torch_load(tmp_path / "without.bin")
    assert loaded["lr"] == 0.1 and torch.equal(loaded["step"], torch.tensor(3))
    assert torch.equal(loaded["base"], base) and torch.equal(loaded["view"], base[2:4])
    loaded["base"][2] = 9.0
    assert loaded["view"][0] == 9.0  # views of one tensor still share its memory
    with open(tmp_path / "without.bin", "r+b") as file:  # the file changed in place: the load kept its own copy
        file.write(bytes((tmp_path / "without.bin").stat().st_size))
    assert torch.equal(loaded["base"], torch.tensor([0.0, 1.0, 9.0, 3.0, 4.0, 5.0]))


def test_torch_save_empties_only_a_file_that_holds_something(tmp_path, monkeypatch):
    import os

    truncated = []
    real_ftruncate = os.ftruncate
    monkeypatch.setattr(os, "ftruncate", lambda fd, length: (truncated.append(length), real_ftruncate(fd, length)))
    obj = {"step": torch.tensor(3)}
    torch_save(obj, tmp_path / "new.bin")
    (tmp_path / "empty.bin").touch()
    torch_save(obj, tmp_path / "empty.bin")
    assert truncated == []  # a truncated file, even an empty one, is flushed on close by ext4: a stall
    (tmp_path / "longer.bin").write_bytes(b"x" * 10**6)
    torch_save(obj, tmp_path / "longer.bin")
    assert truncated == [0]
    assert (tmp_path / "longer.bin").read_bytes() == (tmp_path / "new.bin").read_bytes()
    assert torch.equal(torch_load(tmp_path / "longer.bin")["step"], torch.tensor(3))
    (tmp_path / "link.bin").symlink_to(tmp_path / "new.bin")
    with pytest.raises(OSError, match="link.bin"):
        torch_save(obj, tmp_path / "link.bin")
