"""Character-level text: vocabulary, splits, windows (deterministic, world-size independent), files, download."""

import hashlib
import json
import os
import random
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler

import runner.data
from runner.data import text_files
from runner.data.download import DataFileError, DownloadError
from runner.data.text import MAX_VOCAB_BYTES, CharVocab, CharWindows, build_char_dataset, split_tokens
from runner.engine.loaders import DataLoaderConfiguration
from runner.engine.loaders.prepare import prepare_data_loader
from runner.engine.optimizer import GradientAccumulationPlugin, GradientState
from tests.helpers import http_mirror
from tests.shared_data import SHAKESPEARE, needs_shakespeare

# 1000 characters without repeated windows, so a window's text identifies its offset.
TEXT = "".join(random.Random(0).choices("abcdefghijklmnopqrstuvwxyz ,.;!?\n", k=1000))


@pytest.fixture
def corpus(tmp_path) -> Path:
    (tmp_path / "input.txt").write_text(TEXT, encoding="utf-8")
    return tmp_path


# -------------------------------------------------------------------------------------------------- vocabulary
def test_vocabulary_is_the_sorted_distinct_characters_and_round_trips(tmp_path):
    vocab = CharVocab.from_text("hello, world\n")
    assert vocab.chars == sorted(set("hello, world\n")) and len(vocab) == 10
    ids = vocab.encode("hello")
    assert ids.dtype == torch.uint8 and vocab.decode(ids) == "hello"
    assert ids.tolist() == [vocab.chars.index(c) for c in "hello"]
    vocab.save(tmp_path / "vocab.json")
    assert json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8")) == {"chars": vocab.chars}
    assert CharVocab.load(tmp_path / "vocab.json") == vocab


def test_vocabularies_beyond_a_byte_and_beyond_ascii(tmp_path):
    text = "".join(chr(0x4E00 + i) for i in range(300)) + "é\n"
    vocab = CharVocab.from_text(text)
    ids = vocab.encode(text)
    assert len(vocab) == 302 and ids.dtype == torch.int32 and vocab.decode(ids) == text
    vocab.save(tmp_path / "vocab.json")
    assert CharVocab.load(tmp_path / "vocab.json").decode(ids) == text
    small = CharVocab.from_text("ñé\n")
    assert small.decode(small.encode("ñ\né")) == "ñ\né"  # non-ASCII, but one byte per id


def test_a_vocabulary_file_that_is_not_one_is_one_sentence_naming_it(tmp_path):
    # The shapes of JSON a vocabulary cannot have: tests/unit/cli/test_generate.py, through runner generate.
    os.mkfifo(tmp_path / "piped.json")  # reading it would wait forever
    with open(tmp_path / "large.json", "wb") as file:
        file.truncate(MAX_VOCAB_BYTES + 1)  # a hole: never read
    (tmp_path / "valid.json").write_text('{"chars": ["a", "b"], "note": "other keys are left alone"}')
    for name, problem in [
        ("piped.json", "it is not a regular file"),
        ("large.json", f"it holds {MAX_VOCAB_BYTES + 1} bytes, more than any vocabulary"),
        ("missing.json", "it cannot be read: No such file or directory"),
    ]:
        with pytest.raises(DataFileError) as refused:
            CharVocab.load(tmp_path / name)
        assert str(refused.value) == (
            f"{tmp_path / name} is not a character vocabulary ({problem}); it is damaged, so use another checkpoint "
            "of the run."
        )
    assert CharVocab.load(tmp_path / "valid.json") == CharVocab(["a", "b"])


def test_an_unknown_character_is_named():
    with pytest.raises(ValueError, match="The character 'z' is not in the vocabulary of 3 characters"):
        CharVocab.from_text("abc").encode("abz")


# ------------------------------------------------------------------------------------------- splits and windows
def test_the_split_is_the_first_and_last_fraction_of_the_characters():
    parts = split_tokens(torch.arange(1000), 0.1)
    assert torch.equal(parts["train"], torch.arange(900)) and torch.equal(parts["val"], torch.arange(900, 1000))
    assert [len(p) for p in split_tokens(torch.arange(1001), 0.25).values()] == [750, 251]


def test_train_has_a_window_at_every_offset_and_val_consecutive_windows(corpus):
    train = build_char_dataset(corpus, split="train", block_size=8)
    val = build_char_dataset(corpus, split="val", block_size=8)
    assert len(train) == 900 - 8 and len(val) == 12  # val: 100 characters, starts 0, 8, ..., 88
    vocab = train.vocab
    assert vocab == val.vocab == CharVocab.from_text(TEXT) and train.vocab_size == len(vocab)
    inputs, targets = train[123]
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (8,)
    assert vocab.decode(inputs) == TEXT[123:131] and vocab.decode(targets) == TEXT[124:132]
    last_inputs, last_targets = val[11]
    assert vocab.decode(last_inputs) + vocab.decode(last_targets[-1:]) == TEXT[988:997]
    assert vocab.decode(train[len(train) - 1][1])[-1] == TEXT[899]  # the last train window ends at the boundary


def test_slices_select_windows_and_val_fraction_moves_the_boundary(corpus):
    assert len(build_char_dataset(corpus, split="val[:5]", block_size=8)) == 5
    half = build_char_dataset(corpus, split="train[50%:]", block_size=8)
    assert len(half) == 446 and half.vocab.decode(half[0][0]) == TEXT[446:454]
    wide = build_char_dataset(corpus, split="val", block_size=8, val_fraction=0.5)
    assert len(wide) == 62 and wide.vocab.decode(wide[0][0]) == TEXT[500:508]


def test_items_are_pure_functions_of_their_index(corpus):
    train = build_char_dataset(corpus, split="train", block_size=8)
    order = [5, 800, 17, 5, 399]
    forward = [train[i] for i in order]
    backward = [train[i] for i in reversed(order)][::-1]
    rebuilt = build_char_dataset(corpus, split="train", block_size=8)
    for (a, b), (c, d), (e, f) in zip(forward, backward, [rebuilt[i] for i in order], strict=True):
        assert torch.equal(a, c) and torch.equal(b, d) and torch.equal(a, e) and torch.equal(b, f)


def prepared(dataset, *, batch_size: int, world: int, rank: int, samples: int | None):
    """The recipe's train loader as the engine shards it for ``rank`` of ``world`` (no process group needed)."""
    sampler = RandomSampler(dataset, num_samples=samples, generator=torch.Generator().manual_seed(42))
    return prepare_data_loader(
        DataLoader(dataset, batch_size=batch_size, sampler=sampler),
        device=None,
        num_processes=world,
        process_index=rank,
        gradient_state=GradientState(GradientAccumulationPlugin()),
        config=DataLoaderConfiguration(use_seedable_sampler=True),  # as the runner prepares recipes' loaders
    )


def epochs(loader, count: int) -> list[list[torch.Tensor]]:
    return [[inputs for inputs, _ in loader] for _ in range(count)]


def test_windows_are_the_same_on_any_number_of_processes_new_each_epoch_and_resumable(corpus):
    train = build_char_dataset(corpus, split="train", block_size=8)
    single = epochs(prepared(train, batch_size=8, world=1, rank=0, samples=40), 2)
    ranks = [epochs(prepared(train, batch_size=4, world=2, rank=r, samples=40), 2) for r in range(2)]
    assert [len(e) for e in single] == [5, 5]
    for epoch in range(2):
        for step, batch in enumerate(single[epoch]):  # rank 0 then rank 1 make up the single process's batch
            assert torch.equal(batch, torch.cat([ranks[0][epoch][step], ranks[1][epoch][step]]))
    assert not torch.equal(torch.cat(single[0]), torch.cat(single[1]))  # each epoch draws other windows
    assert len({tuple(w.tolist()) for w in torch.cat(single[0])}) == 40  # without replacement within an epoch

    resumed = prepared(train, batch_size=8, world=1, rank=0, samples=40)
    resumed.load_state_dict({"epoch": 1, "samples_seen": 24})
    assert all(torch.equal(a, b) for a, b in zip([x for x, _ in resumed], single[1][3:], strict=True))


# ----------------------------------------------------------------------------------------------- bad files
def test_missing_empty_and_binary_corpora_get_one_sentence(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"input.txt is not in .*; set data.root to the folder that holds it"):
        build_char_dataset(tmp_path, split="train", block_size=8)
    (tmp_path / "input.txt").write_bytes(b"")
    with pytest.raises(DataFileError, match="input.txt is empty"):
        build_char_dataset(tmp_path, split="train", block_size=8)
    (tmp_path / "input.txt").write_bytes(b"abc\xff\xfe")
    with pytest.raises(DataFileError, match=r"input.txt is not UTF-8 text \(invalid start byte at byte 3\)"):
        build_char_dataset(tmp_path, split="train", block_size=8)


def test_unknown_splits_and_empty_selections_are_refused(corpus):
    with pytest.raises(ValueError, match="A text corpus has no split 'test'; use 'train' or 'val'"):
        build_char_dataset(corpus, split="test", block_size=8)
    with pytest.raises(ValueError, match=r"Split 'val\[20:\]' holds no window of 9 characters \(the val split has 100"):
        build_char_dataset(corpus, split="val[20:]", block_size=8)
    with pytest.raises(ValueError, match="holds no window of 101 characters"):
        build_char_dataset(corpus, split="val", block_size=100)
    with pytest.raises(ValueError, match="shakespeare_char has no split 'test'"):
        runner.data.check_splits("shakespeare_char", ["train", "test[:5]"])
    runner.data.check_splits("shakespeare_char", ["train[:50%]", "val[:10]"])


@pytest.mark.parametrize(("block_size", "val_fraction"), [(8, 0.1), (7, 0.25), (99, 0.1), (100, 0.1), (500, 0.3)])
def test_windows_are_counted_before_launch_as_the_datasets_count_them(corpus, block_size, val_fraction):
    counts = text_files.window_counts(corpus, block_size=block_size, val_fraction=val_fraction)
    for split in ("train", "val"):
        try:
            built = len(build_char_dataset(corpus, split=split, block_size=block_size, val_fraction=val_fraction))
        except ValueError:  # holds no window
            built = 0
        assert counts[split] == built, split
    assert text_files.window_counts(corpus / "nowhere", block_size=8, val_fraction=0.1) is None
    with pytest.raises(ValueError, match=r"Split 'val\[12:\]' selects none of the 12 windows of 9 characters in "):
        runner.data.check_splits("shakespeare_char", ["train", "val[12:]"], root=str(corpus), block_size=8)
    runner.data.check_splits("shakespeare_char", ["train", "val[11:]"], root=str(corpus), block_size=8)


def test_missing_files_and_the_dataset_registry(corpus, tmp_path):
    assert runner.data.missing_files("shakespeare_char", root=str(corpus), splits=["train", "val"]) == []
    empty = tmp_path / "empty"
    assert runner.data.missing_files("shakespeare_char", root=str(empty), splits=["train"]) == ["input.txt"]
    dataset = runner.data.CharCorpus(corpus, split="val", block_size=8)
    assert isinstance(dataset, CharWindows) and len(dataset) == 12
    windows = build_char_dataset(corpus, split="val", block_size=8)
    assert all(torch.equal(dataset[i][0], windows[i][0]) for i in range(12)) and dataset.vocab == windows.vocab


# -------------------------------------------------------------------------------------------------- download
@pytest.fixture
def mirror(tmp_path, monkeypatch):
    """A local HTTP server holding a small corpus as ``good/input.txt`` and other bytes as ``bad/input.txt``."""
    served = tmp_path / "served"
    for folder, text in (("good", TEXT), ("bad", TEXT + "!")):
        (served / folder).mkdir(parents=True)
        (served / folder / "input.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(text_files, "SHAKESPEARE_SHA256", hashlib.sha256(TEXT.encode()).hexdigest())
    with http_mirror(served, monkeypatch) as base:
        yield base


def test_download_fetches_a_verified_corpus_once(mirror, tmp_path, monkeypatch):
    monkeypatch.setattr(text_files, "SHAKESPEARE_URLS", (mirror + "bad/input.txt", mirror + "good/input.txt"))
    root = tmp_path / "new" / "root"
    fetched = runner.data.download_missing("shakespeare_char", root=str(root), splits=["train", "val"])
    assert fetched == [root / "input.txt"] and (root / "input.txt").read_text(encoding="utf-8") == TEXT
    assert runner.data.download_missing("shakespeare_char", root=str(root), splits=["train"]) == []
    assert len(build_char_dataset(tmp_path / "other", split="val", block_size=8, download=True)) == 12


def test_a_corrupted_download_leaves_nothing(mirror, tmp_path, monkeypatch):
    monkeypatch.setattr(text_files, "SHAKESPEARE_URLS", (mirror + "bad/input.txt",))
    root = tmp_path / "root"
    with pytest.raises(
        DownloadError, match=r"Could not download input.txt from any mirror into .*root \(.*sha256 .* is not the"
    ):
        runner.data.download_missing("shakespeare_char", root=str(root), splits=["train"])
    assert not root.exists()  # nor the folder it created for the file


# ------------------------------------------------------------------------------------------ the real corpus
@needs_shakespeare
def test_tiny_shakespeare_matches_its_published_checksum_and_size():
    from runner.data.download import sha256_of

    assert sha256_of(SHAKESPEARE / "input.txt") == text_files.SHAKESPEARE_SHA256
    train = build_char_dataset(SHAKESPEARE, split="train", block_size=64)
    val = build_char_dataset(SHAKESPEARE, split="val", block_size=64)
    assert train.vocab_size == 65
    assert (len(train), len(val)) == (1_003_854 - 64, (111_540 - 65) // 64 + 1)
