"""Character-level language modelling data: a corpus's vocabulary, and windows of it to predict.

The vocabulary is every distinct character of the whole corpus, sorted (so both splits encode with
it, and the same text always gives the same ids). The first ``1 - val_fraction`` of the characters
are the ``train`` split, the rest ``val``.

- ``train``: one window per offset, item ``i`` starting at character ``i``. The recipe's shuffled
  sampler draws from them: random windows, seeded and new each epoch, identical on any number of
  processes, and resumable at any sample because item ``i`` is a pure function of ``i``.
- ``val``: consecutive non-overlapping windows, so an evaluation reads every character of the split
  once (but the last few that do not fill a window).

A window holds ``block_size + 1`` characters; an item is ``(inputs, targets)``, the targets being the
inputs shifted by one. Split names take slices of the items, e.g. ``val[:200]`` (the first 200
windows) or ``train[:50%]``.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from runner.data.download import DataFileError
from runner.data.splits import parse_split
from runner.data.text_files import SHAKESPEARE_FILE, TEXT_SPLITS, download_shakespeare, find_corpus, split_boundary
from runner.files import write_text_atomically

VOCAB_FILE = "vocab.json"


class CharVocab:
    """Characters <-> token ids: id ``i`` is ``chars[i]``.

    Args:
        chars: Distinct single characters, in id order.
    """

    def __init__(self, chars: Sequence[str]) -> None:
        chars = list(chars)
        if not chars or any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("A vocabulary needs distinct single characters (and at least one).")
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """Every distinct character of ``text``, sorted by code point."""
        return cls(sorted(set(text)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharVocab:
        """The vocabulary :meth:`save` wrote to ``path``.

        Raises:
            DataFileError: The file is not ``{"chars": [...]}`` of distinct single characters (one sentence naming it).
        """
        try:
            return cls(_vocab_chars(_vocab_json(Path(path))))
        except _NotAVocabulary as problem:
            raise DataFileError(
                f"{path} is not a character vocabulary ({problem}); it is damaged, so use another checkpoint of the "
                "run."
            ) from None

    def save(self, path: str | os.PathLike) -> None:
        """Write ``{"chars": [...]}`` as JSON, atomically."""
        write_text_atomically(path, json.dumps({"chars": self.chars}, ensure_ascii=False) + "\n")

    def __len__(self) -> int:
        return len(self.chars)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharVocab) and self.chars == other.chars

    def encode(self, text: str) -> torch.Tensor:
        """Token ids of ``text`` (uint8 when the vocabulary fits in a byte, int32 otherwise).

        Raises:
            ValueError: ``text`` holds a character the vocabulary lacks.
        """
        unknown = set(text) - self._ids.keys()
        if unknown:
            raise ValueError(f"The character {min(unknown)!r} is not in the vocabulary of {len(self)} characters.")
        if len(self) <= 256:  # str.translate then latin-1: one pass in C, even for a large corpus
            table = {ord(c): i for c, i in self._ids.items()}
            return torch.frombuffer(bytearray(text.translate(table).encode("latin-1")), dtype=torch.uint8)
        return torch.tensor([self._ids[c] for c in text], dtype=torch.int32)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


# Every code point, each as a 12-character JSON escape and its separator: a larger file is no vocabulary.
MAX_VOCAB_BYTES = 0x110000 * 16


class _NotAVocabulary(ValueError):
    """What makes a file no vocabulary, in a few words."""


def _vocab_json(path: Path) -> object:
    """The JSON value ``path`` holds, read without waiting on a pipe and without reading more than a vocabulary."""
    try:  # O_NONBLOCK: a pipe planted under the name does not hang the open; it is refused below
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as error:
        raise _NotAVocabulary(f"it cannot be read: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise _NotAVocabulary("it is not a regular file")
        if info.st_size > MAX_VOCAB_BYTES:
            raise _NotAVocabulary(f"it holds {info.st_size} bytes, more than any vocabulary")
        data = file.read(MAX_VOCAB_BYTES + 1)
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise _NotAVocabulary(f"it is not UTF-8 text: {error.reason} at byte {error.start}") from None
    except ValueError as error:
        raise _NotAVocabulary(f"it is not JSON: {error}") from None
    except RecursionError:
        raise _NotAVocabulary("it is JSON nested deeper than the parser goes") from None


def _vocab_chars(content: object) -> list[str]:
    """The ``chars`` of a vocabulary file's JSON, checked: distinct single characters, at least one."""
    chars = content.get("chars") if isinstance(content, dict) else None
    if chars is None:
        raise _NotAVocabulary('it holds no "chars" list')
    if not isinstance(chars, list) or not chars:
        raise _NotAVocabulary('"chars" is empty' if chars == [] else f'"chars" is {type(chars).__name__}, not a list')
    first: dict[str, int] = {}
    for index, char in enumerate(chars):
        where = f'"chars"[{index}]'
        if not isinstance(char, str):
            raise _NotAVocabulary(f"{where} is {type(char).__name__}, not a character")
        if len(char) != 1:
            shown = repr(char) if len(char) <= 12 else f"{char[:12]!r}..."
            raise _NotAVocabulary(f"{where} is {shown}, {len(char)} characters, not one")
        if "\ud800" <= char <= "\udfff":  # half of a UTF-16 pair: no text holds it, and no terminal can show it
            raise _NotAVocabulary(f"{where} is {char!r}, half of a UTF-16 surrogate pair, not a character")
        if char in first:
            raise _NotAVocabulary(f'{where} is {char!r} again (it is "chars"[{first[char]}] too)')
        first[char] = index
    return chars


def read_corpus(path: str | os.PathLike) -> str:
    """The text of ``path`` (UTF-8).

    Raises:
        DataFileError: The file cannot be read, is not UTF-8 text, or is empty.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataFileError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); convert it.") from None
    except OSError as error:
        raise DataFileError(f"{path} cannot be read ({error.strerror}); check the file.") from None
    if not text:
        raise DataFileError(f"{path} is empty; point data.root at a folder whose {SHAKESPEARE_FILE} holds text.")
    return text


class CharWindows(Dataset):
    """Windows of ``block_size + 1`` token ids, as ``(inputs, targets)`` pairs of ``block_size`` int64 ids.

    Args:
        tokens: The split's token ids.
        block_size: Characters the model reads per window.
        stride: Characters between the starts of consecutive items (1: every offset).
        vocab: The corpus's vocabulary (kept for the recipe: model size, ``vocab.json``).
        split: The split this is (``train``, ``val[:200]``, ...), for messages.
    """

    def __init__(
        self, tokens: torch.Tensor, *, block_size: int, stride: int, vocab: CharVocab, split: str = ""
    ) -> None:
        if block_size < 1 or stride < 1:
            raise ValueError(f"block_size={block_size} and stride={stride} must be at least 1.")
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride
        self.vocab = vocab
        self.split = split
        self.starts = range(0, max(len(tokens) - block_size, 0), stride)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def select(self, positions: range) -> CharWindows:
        """The items at ``positions`` (a slice of this dataset's items)."""
        subset = CharWindows(
            self.tokens, block_size=self.block_size, stride=self.stride, vocab=self.vocab, split=self.split
        )
        subset.starts = self.starts[positions.start : positions.stop : positions.step]
        return subset

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.starts[index]
        window = self.tokens[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class CharCorpus(CharWindows):
    """One split of a character-level corpus (``root/input.txt``) as windows: the language model's dataset.

    ``conf/data/shakespeare_char.yaml`` declares it; the recipe reads ``vocab`` (for the model's size and
    ``vocab.json``) from the train split.

    Args:
        root: Folder holding ``input.txt`` (any UTF-8 text; tiny-shakespeare downloads there).
        split: ``train`` or ``val`` with an optional slice of the windows, e.g. ``val[:200]``.
        block_size: Characters the model reads per window.
        val_fraction: The last fraction of the characters that is the ``val`` split.
        download: Fetch tiny-shakespeare (sha256-checked) when ``input.txt`` is missing.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        split: str = "train",
        block_size: int,
        val_fraction: float = 0.1,
        download: bool = False,
    ) -> None:
        windows = build_char_dataset(
            root, split=split, block_size=block_size, val_fraction=val_fraction, download=download
        )
        super().__init__(windows.tokens, block_size=block_size, stride=windows.stride, vocab=windows.vocab, split=split)
        self.starts = windows.starts

    @classmethod
    def prepare_data(
        cls,
        root: str | os.PathLike,
        *,
        split: str = "train",
        block_size: int,
        val_fraction: float = 0.1,
        download: bool = False,
    ) -> None:
        """Once, before the training processes start: fetch the corpus (``download``) or check it is there, and
        check that the split's slice selects at least one window.

        Raises:
            ValueError: An unknown split, or a slice that selects no window of ``block_size + 1`` characters.
            FileNotFoundError: ``input.txt`` is missing and ``download`` is off.
        """
        from runner.data import check_splits, download_missing, missing_files

        check_splits("shakespeare_char", [split])
        if download:
            download_missing("shakespeare_char", root=str(root), splits=[split])
        elif missing_files("shakespeare_char", root=str(root), splits=[split]):
            raise FileNotFoundError(
                f"{SHAKESPEARE_FILE} is not in {root}; set data.root to the folder that holds it, or "
                "data.download=true to fetch tiny-shakespeare."
            )
        check_splits("shakespeare_char", [split], root=str(root), block_size=block_size, val_fraction=val_fraction)


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> dict[str, torch.Tensor]:
    """``train``: the first ``1 - val_fraction`` of the tokens (rounded down); ``val``: the rest."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1.")
    boundary = split_boundary(len(tokens), val_fraction)
    return {"train": tokens[:boundary], "val": tokens[boundary:]}


def build_char_dataset(
    root: str | os.PathLike, *, split: str, block_size: int, val_fraction: float = 0.1, download: bool = False
) -> CharWindows:
    """The windows of ``split`` (``train`` or ``val``, with an optional slice) of the corpus in ``root``.

    Raises:
        FileNotFoundError: The corpus is missing and ``download`` is off.
        DataFileError: The corpus cannot be read as text.
        ValueError: An unknown split, or one that holds no window of ``block_size + 1`` characters.
    """
    spec = parse_split(split)
    if spec.name not in TEXT_SPLITS:
        raise ValueError(f"A text corpus has no split {spec.name!r}; use 'train' or 'val' with an optional slice.")
    path = find_corpus(root)
    if path is None and download:
        download_shakespeare(root)
        path = find_corpus(root)
    if path is None:
        raise FileNotFoundError(
            f"{SHAKESPEARE_FILE} is not in {root}; set data.root to the folder that holds it, or data.download=true "
            "to fetch tiny-shakespeare."
        )
    text = read_corpus(path)
    vocab = CharVocab.from_text(text)
    tokens = split_tokens(vocab.encode(text), val_fraction)[spec.name]
    stride = 1 if spec.name == "train" else block_size
    windows = CharWindows(tokens, block_size=block_size, stride=stride, vocab=vocab, split=split)
    selected = windows.select(spec.indices(len(windows)))
    if len(selected) == 0:
        raise ValueError(
            f"Split {split!r} holds no window of {block_size + 1} characters (the {spec.name} split has "
            f"{len(tokens)} characters, {len(windows)} windows); widen the slice, lower model.block_size or change "
            "data.val_fraction."
        )
    return selected
