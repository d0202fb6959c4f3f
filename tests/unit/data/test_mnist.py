import gzip
import hashlib
import random
import socket
import struct
import urllib.request
from pathlib import Path

import pytest
import torch

import runner.data
from runner.data import mnist_files
from runner.data.mnist import MEAN, MNIST, STD, read_idx
from runner.data.mnist_files import download_mnist
from tests.helpers import http_mirror
from tests.shared_data import MNIST as REAL_MNIST

TRAIN_IMAGES, TRAIN_LABELS = mnist_files.MNIST_FILES["train"]
TEST_IMAGES, TEST_LABELS = mnist_files.MNIST_FILES["test"]
ALL_FILES = (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)


def idx_bytes(dtype_code: int, shape: tuple[int, ...], body: bytes) -> bytes:
    """An IDX file: magic 0x00 0x00 dtype ndim, big-endian uint32 dims, then the data."""
    return bytes([0, 0, dtype_code, len(shape)]) + struct.pack(f">{len(shape)}I", *shape) + body


def write(path: Path, data: bytes, *, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def mnist_contents(n: int, seed: int) -> tuple[bytes, bytes, bytes, list[int]]:
    """Raw IDX images and labels of ``n`` random digits, the pixel bytes and the labels."""
    rng = random.Random(seed)
    pixels = rng.randbytes(n * 28 * 28)
    labels = [rng.randrange(10) for _ in range(n)]
    return idx_bytes(0x08, (n, 28, 28), pixels), idx_bytes(0x08, (n,), bytes(labels)), pixels, labels


CONTENTS = {"train": mnist_contents(5, seed=1), "test": mnist_contents(4, seed=2)}


def file_contents(name: str) -> bytes:
    """The raw (un-gzipped) IDX contents of the generated MNIST file ``name``."""
    split = "train" if name.startswith("train") else "test"
    images, labels, _, _ = CONTENTS[split]
    return images if "images" in name else labels


def write_mnist(root: Path, names=ALL_FILES, *, gz: bool = True) -> None:
    for name in names:
        write(root / (name if gz else name.removesuffix(".gz")), file_contents(name), gz=gz)


def expected_images(split: str) -> torch.Tensor:
    _, _, pixels, _ = CONTENTS[split]
    raw = torch.frombuffer(bytearray(pixels), dtype=torch.uint8).reshape(-1, 1, 28, 28)
    return (raw.float() / 255.0 - MEAN) / STD


# ---------------------------------------------------------------------------------------------------- read_idx


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_uint8_images(tmp_path, gz):
    body = bytes(range(12))
    path = write(tmp_path / ("images.gz" if gz else "images"), idx_bytes(0x08, (3, 2, 2), body), gz=gz)
    tensor = read_idx(path)
    assert tensor.dtype == torch.uint8
    assert tensor.shape == (3, 2, 2)
    assert tensor.flatten().tolist() == list(range(12))
    assert tensor[2].tolist() == [[8, 9], [10, 11]]


def test_read_idx_uint8_labels(tmp_path):
    path = write(tmp_path / "labels", idx_bytes(0x08, (3,), bytes([7, 2, 9])), gz=False)
    tensor = read_idx(path)
    assert tensor.dtype == torch.uint8
    assert tensor.tolist() == [7, 2, 9]


def test_read_idx_int32_is_big_endian(tmp_path):
    values = [1, -2, 0x01020304, -(2**31), 2**31 - 1, 256]
    path = write(tmp_path / "ints.gz", idx_bytes(0x0C, (2, 3), struct.pack(">6i", *values)), gz=True)
    tensor = read_idx(path)
    assert tensor.dtype == torch.int32
    assert tensor.shape == (2, 3)
    assert tensor.flatten().tolist() == values


def test_read_idx_float32_is_big_endian(tmp_path):
    path = write(tmp_path / "floats", idx_bytes(0x0D, (3,), struct.pack(">3f", 1.5, -2.25, 1024.0)), gz=False)
    tensor = read_idx(path)
    assert tensor.dtype == torch.float32
    assert tensor.tolist() == [1.5, -2.25, 1024.0]


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_truncated_body(tmp_path, gz):
    path = write(tmp_path / ("short.gz" if gz else "short"), idx_bytes(0x08, (3, 2, 2), bytes(11)), gz=gz)
    with pytest.raises(ValueError) as error:
        read_idx(path)
    assert str(path) in str(error.value)
    assert "truncated" in str(error.value)


def test_read_idx_too_long_body(tmp_path):
    path = write(tmp_path / "long", idx_bytes(0x08, (3,), bytes(4)), gz=False)
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path)


def test_read_idx_truncated_header(tmp_path):
    path = write(tmp_path / "header", bytes([0, 0, 0x08, 3]) + struct.pack(">I", 3) + b"\x00", gz=False)
    with pytest.raises(ValueError) as error:
        read_idx(path)
    assert str(path) in str(error.value)
    assert "truncated" in str(error.value)


def test_read_idx_empty_array(tmp_path):
    path = write(tmp_path / "empty", idx_bytes(0x08, (0, 28, 28), b""), gz=False)
    tensor = read_idx(path)
    assert tensor.shape == (0, 28, 28)


@pytest.mark.parametrize(
    "data",
    [
        b"\x1f\x8b\x08\x03" + bytes(8),  # not zero-led
        bytes([0, 0, 0x07, 1]) + struct.pack(">I", 1) + b"\x00",  # unknown dtype code
        bytes([0, 0]),  # shorter than the magic number
    ],
)
def test_read_idx_bad_magic(tmp_path, data):
    path = write(tmp_path / "bad", data, gz=False)
    with pytest.raises(ValueError) as error:
        read_idx(path)
    assert "not an IDX file" in str(error.value)
    assert str(path) in str(error.value)


# ---------------------------------------------------------------------------------------------------- MNIST


def check_split(dataset, split: str, index: slice = slice(None)) -> None:
    images = expected_images(split)[index]
    labels = CONTENTS[split][3][index]
    assert len(dataset) == len(labels)
    assert dataset.images.shape == (len(labels), 1, 28, 28)
    assert dataset.images.dtype == torch.float32
    assert dataset.labels.dtype == torch.int64
    assert dataset.labels.tolist() == labels
    torch.testing.assert_close(dataset.images, images)
    image, label = dataset[len(labels) - 1]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert label.dtype == torch.int64 and label.item() == labels[-1]


def test_mnist_loads_both_splits(tmp_path):
    write_mnist(tmp_path)
    check_split(MNIST(tmp_path, split="train"), "train")
    check_split(MNIST(tmp_path, split="test"), "test")


def test_mnist_normalises_with_mean_and_std(tmp_path):
    write(tmp_path / TEST_IMAGES, idx_bytes(0x08, (2, 28, 28), bytes(784) + bytes([255]) * 784), gz=True)
    write(tmp_path / TEST_LABELS, idx_bytes(0x08, (2,), bytes([3, 4])), gz=True)
    dataset = MNIST(tmp_path, split="test")
    assert torch.allclose(dataset[0][0], torch.full((1, 28, 28), -MEAN / STD))
    assert torch.allclose(dataset[1][0], torch.full((1, 28, 28), (1 - MEAN) / STD))
    assert dataset.labels.tolist() == [3, 4]


@pytest.mark.parametrize(
    ("split", "index"),
    [
        ("test[1:3]", slice(1, 3)),
        ("train[-2:]", slice(-2, None)),
        ("train[:40%]", slice(0, 2)),
        ("test[2:]", slice(2, None)),
    ],
)
def test_mnist_slices(tmp_path, split, index):
    write_mnist(tmp_path)
    check_split(MNIST(tmp_path, split=split), split.split("[")[0], index)


def test_mnist_finds_raw_files(tmp_path):
    write_mnist(tmp_path, gz=False)
    assert not list(tmp_path.glob("*.gz"))
    check_split(MNIST(tmp_path, split="train"), "train")
    check_split(MNIST(tmp_path, split="test"), "test")


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_finds_files_in_torchvision_layout(tmp_path, gz):
    write_mnist(tmp_path / "MNIST" / "raw", gz=gz)
    check_split(MNIST(tmp_path, split="test"), "test")
    check_split(MNIST(tmp_path, split="train[1:4]"), "train", slice(1, 4))


@pytest.mark.parametrize("split", ["test[4:]", "test[3:1]", "train[:0]", "test[:10%]"])
def test_mnist_empty_slice(tmp_path, split):
    write_mnist(tmp_path)
    with pytest.raises(ValueError) as error:
        MNIST(tmp_path, split=split)
    assert split in str(error.value)
    assert "selects no MNIST images" in str(error.value)


def test_mnist_unknown_split_name(tmp_path):
    write_mnist(tmp_path)
    with pytest.raises(ValueError) as error:
        MNIST(tmp_path, split="val")
    message = str(error.value)
    assert "'val'" in message and "'train'" in message and "'test'" in message


def test_mnist_malformed_split(tmp_path):
    write_mnist(tmp_path)
    with pytest.raises(ValueError, match="is not a split"):
        MNIST(tmp_path, split="test[")


def test_mnist_image_label_count_mismatch(tmp_path):
    write(tmp_path / TEST_IMAGES, CONTENTS["test"][0], gz=True)
    write(tmp_path / TEST_LABELS, CONTENTS["train"][1], gz=True)
    with pytest.raises(ValueError, match="has 4 images but .* has 5 labels"):
        MNIST(tmp_path, split="test")


def test_mnist_missing_files_without_download(tmp_path):
    write_mnist(tmp_path, names=(TEST_IMAGES, TEST_LABELS, TRAIN_IMAGES))
    with pytest.raises(FileNotFoundError) as error:
        MNIST(tmp_path, split="train", download=False)
    message = str(error.value)
    assert TRAIN_LABELS in message and TRAIN_IMAGES not in message
    assert str(tmp_path) in message
    assert "data.download=true" in message

    with pytest.raises(FileNotFoundError) as error:
        MNIST(tmp_path / "empty", split="test")
    assert TEST_IMAGES in str(error.value) and TEST_LABELS in str(error.value)
    assert "data.download=true" in str(error.value)


# ---------------------------------------------------------------------------------------------------- real files


@pytest.fixture(scope="module")
def real_test_split():
    if not all((REAL_MNIST / name).is_file() for name in (TEST_IMAGES, TEST_LABELS)):
        pytest.skip(f"the MNIST test files are not in {REAL_MNIST}")
    return MNIST(REAL_MNIST, split="test")


def test_real_test_split(real_test_split):
    dataset = real_test_split
    assert len(dataset) == 10000
    assert dataset.labels[0].item() == 7
    assert dataset.labels.min().item() >= 0 and dataset.labels.max().item() <= 9
    assert set(dataset.labels.tolist()) == set(range(10))
    assert abs(dataset.images.mean().item()) < 0.05
    assert abs(dataset.images.std().item() - 1) < 0.05


def test_real_test_split_slices(real_test_split):
    head, tail = MNIST(REAL_MNIST, split="test[:8000]"), MNIST(REAL_MNIST, split="test[8000:]")
    assert len(head) == 8000 and len(tail) == 2000
    assert torch.equal(torch.cat([head.labels, tail.labels]), real_test_split.labels)
    assert torch.equal(tail.images[0], real_test_split.images[8000])
    assert head.labels[0].item() == 7


def test_real_test_split_checksums_match_the_published_ones():
    if not REAL_MNIST.is_dir():
        pytest.skip(f"{REAL_MNIST} is absent")
    for name in (TEST_IMAGES, TEST_LABELS):
        assert hashlib.sha256((REAL_MNIST / name).read_bytes()).hexdigest() == mnist_files.MNIST_SHA256[name]


# ---------------------------------------------------------------------------------------------------- missing_files


def test_missing_files_lists_exactly_the_absent_ones(tmp_path):
    write(tmp_path / TEST_IMAGES, CONTENTS["test"][0], gz=True)
    write(tmp_path / "MNIST" / "raw" / TRAIN_LABELS.removesuffix(".gz"), CONTENTS["train"][1], gz=False)
    missing = runner.data.missing_files("mnist", root=str(tmp_path), splits=["test[:10]", "train"])
    assert missing == [TEST_LABELS, TRAIN_IMAGES]


def test_missing_files_asks_only_for_the_splits_named(tmp_path):
    assert runner.data.missing_files("mnist", root=str(tmp_path), splits=["test[:10]", "test[10:]"]) == [
        TEST_IMAGES,
        TEST_LABELS,
    ]
    write_mnist(tmp_path, names=(TEST_IMAGES, TEST_LABELS))
    assert runner.data.missing_files("mnist", root=str(tmp_path), splits=["test[:10]", "test"]) == []


def test_missing_files_unknown_dataset(tmp_path):
    with pytest.raises(ValueError, match="'cifar'"):
        runner.data.missing_files("cifar", root=str(tmp_path), splits=["train"])


def test_missing_files_unknown_split_name(tmp_path):
    with pytest.raises(ValueError, match="'val'"):
        runner.data.missing_files("mnist", root=str(tmp_path), splits=["train", "val"])


# ---------------------------------------------------------------------------------------------------- download


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A local HTTP server: ``/good/`` holds the generated files, ``/bad/`` other bytes under the same names."""
    served = tmp_path / "served"
    for name in ALL_FILES:
        write(served / "good" / name, file_contents(name), gz=True)
        write(served / "bad" / name, file_contents(name) + b"\x00", gz=True)
        monkeypatch.setitem(
            mnist_files.MNIST_SHA256, name, hashlib.sha256((served / "good" / name).read_bytes()).hexdigest()
        )
    with http_mirror(served, monkeypatch) as base:
        monkeypatch.setattr(mnist_files, "MIRRORS", (base + "good/",))
        yield base


@pytest.fixture
def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_patched_checksums_reach_the_loader(mirror):
    assert (
        mnist_files.MNIST_SHA256[TEST_LABELS]
        == hashlib.sha256(gzip.compress(file_contents(TEST_LABELS), mtime=0)).hexdigest()
    )


def test_download_fetches_and_verifies(mirror, tmp_path):
    root = tmp_path / "new" / "root"
    fetched = download_mnist(root)
    assert sorted(fetched) == sorted(root / name for name in ALL_FILES)
    assert sorted(p.name for p in root.iterdir()) == sorted(ALL_FILES)
    for name in ALL_FILES:
        assert (root / name).read_bytes() == (tmp_path / "served" / "good" / name).read_bytes()
    check_split(MNIST(root, split="train"), "train")
    check_split(MNIST(root, split="test"), "test")

    assert download_mnist(root) == []


def test_download_only_the_splits_asked(mirror, tmp_path):
    assert download_mnist(tmp_path / "root", ("test",)) == [
        tmp_path / "root" / TEST_IMAGES,
        tmp_path / "root" / TEST_LABELS,
    ]
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == sorted([TEST_IMAGES, TEST_LABELS])


def test_download_replaces_a_corrupt_file(mirror, tmp_path):
    root = tmp_path / "root"
    write_mnist(root, names=(TEST_IMAGES,))
    write(root / TEST_LABELS, b"garbage", gz=False)
    assert download_mnist(root, ("test",)) == [root / TEST_LABELS]
    assert (root / TEST_LABELS).read_bytes() == (tmp_path / "served" / "good" / TEST_LABELS).read_bytes()


def test_download_checksum_mismatch_leaves_nothing(mirror, tmp_path, monkeypatch):
    monkeypatch.setattr(mnist_files, "MIRRORS", (mirror + "bad/",))
    root = tmp_path / "root"
    with pytest.raises(RuntimeError) as error:
        download_mnist(root, ("test",))
    assert "sha256" in str(error.value)
    assert TEST_IMAGES in str(error.value)
    assert not root.exists()  # nor the folder it created for the files


def test_download_missing_on_every_mirror(mirror, tmp_path, monkeypatch, closed_port):
    monkeypatch.setattr(mnist_files, "MIRRORS", (f"http://127.0.0.1:{closed_port}/", mirror + "nowhere/"))
    root = tmp_path / "root"
    with pytest.raises(RuntimeError) as error:
        download_mnist(root, ("train",))
    assert f"127.0.0.1:{closed_port}" in str(error.value) and "404" in str(error.value)
    assert not root.exists()


def test_download_falls_back_to_the_next_mirror(mirror, tmp_path, monkeypatch, closed_port):
    monkeypatch.setattr(mnist_files, "MIRRORS", (f"http://127.0.0.1:{closed_port}/", mirror + "bad/", mirror + "good/"))
    root = tmp_path / "root"
    assert sorted(download_mnist(root)) == sorted(root / name for name in ALL_FILES)
    assert sorted(p.name for p in root.iterdir()) == sorted(ALL_FILES)
    check_split(MNIST(root, split="test"), "test")


def test_mnist_download_on_an_empty_root(mirror, tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    dataset = MNIST(root, split="test[1:]", download=True)
    check_split(dataset, "test", slice(1, None))
    assert sorted(p.name for p in root.iterdir()) == sorted([TEST_IMAGES, TEST_LABELS])


def test_mnist_download_keeps_files_found_elsewhere(mirror, tmp_path, monkeypatch, closed_port):
    monkeypatch.setattr(mnist_files, "MIRRORS", (f"http://127.0.0.1:{closed_port}/",))
    write_mnist(tmp_path / "MNIST" / "raw", gz=False)
    check_split(MNIST(tmp_path, split="train", download=True), "train")
    assert not list(tmp_path.glob("*.gz"))


def test_mirror_fixture_serves_files(mirror):
    with urllib.request.urlopen(mirror + "good/" + TEST_LABELS, timeout=5) as response:
        assert gzip.decompress(response.read()) == file_contents(TEST_LABELS)


def test_download_missing_fetches_only_what_the_splits_lack(mirror, tmp_path):
    root = tmp_path / "partial"
    download_mnist(root, ("test",))
    fetched = runner.data.download_missing("mnist", root=str(root), splits=["test[:10]", "train[:5%]"])
    assert sorted(p.name for p in fetched) == sorted([TRAIN_IMAGES, TRAIN_LABELS])
    assert runner.data.download_missing("mnist", root=str(root), splits=["train", "test"]) == []


def test_a_failed_download_is_a_download_error(mirror, tmp_path, monkeypatch, closed_port):
    monkeypatch.setattr(mnist_files, "MIRRORS", (f"http://127.0.0.1:{closed_port}/",))
    root = tmp_path / "r" / "mnist"
    with pytest.raises(mnist_files.DownloadError) as error:
        runner.data.download_missing("mnist", root=str(root), splits=["test"])
    assert str(error.value).startswith(f"Could not download t10k-images-idx3-ubyte.gz from any mirror into {root} (")
    assert str(error.value).endswith("; check your connection, or set data.root to a folder that holds the files.")
    assert not (tmp_path / "r").exists()  # the folders it created are gone again
