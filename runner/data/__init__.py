"""The built-in datasets, and the one call that prepares any declared dataset before workers start.

``data.train`` and ``data.eval`` are ``_target_`` nodes; the presets in ``conf/data/`` point them at
:class:`MNIST`, :class:`CharCorpus` and :func:`causal_lm_blocks` (Hugging Face ``datasets`` cut into
blocks for a causal language model), or at :class:`Split` (a named, sliced split of a dataset whose
constructor takes ``train: bool``, as torchvision's do). A dataset class may offer a
``prepare_data(...)`` classmethod taking its constructor's arguments (Lightning's name):
:func:`prepare_datasets` calls it once, in the launching process, so downloads and checks never race
between workers.

This package's top level imports no torch; the dataset classes load on first use.
"""

from __future__ import annotations

from pathlib import Path

from runner.data.splits import SplitSpec, parse_split

__all__ = [
    "MNIST",
    "CharCorpus",
    "Mixture",
    "Packed",
    "Split",
    "causal_lm_blocks",
    "stream_slice",
    "DATASETS",
    "TEXT_DATASETS",
    "SplitSpec",
    "check_splits",
    "download_missing",
    "missing_files",
    "parse_split",
    "prepare_datasets",
]

TEXT_DATASETS = ("shakespeare_char",)  # character-level corpora, for the language_model recipe
DATASETS = ("mnist", *TEXT_DATASETS)
_LAZY = {
    "MNIST": "runner.data.mnist",
    "CharCorpus": "runner.data.text",
    "Mixture": "runner.data.mixture",
    "Packed": "runner.data.packing",
    "causal_lm_blocks": "runner.data.hf",
    "stream_slice": "runner.data.hf",
    "Split": "runner.data.subsets",
}


def __getattr__(name: str):
    """``runner.data.MNIST``, ``CharCorpus``, ``causal_lm_blocks`` and ``Split`` load on first use (torch too)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'runner.data' has no attribute {name!r}")


_PREPARED: set[str] = set()  # the prepare_data calls this process made, so the command-line check's counts


def prepare_datasets(data) -> None:
    """Call ``prepare_data`` of ``data.train``'s and ``data.eval``'s dataset classes, where they offer one.

    Each gets its node's arguments, resolved (and nested ``_target_`` nodes built), in place of the
    constructor; a call with the same arguments is made once per process (the command-line check
    and the run share it). Errors keep their own type; a rejected value becomes a ConfigError naming
    the key.
    """
    import json

    from omegaconf import OmegaConf

    from runner.config.targets import locate
    from runner.training.components import build

    for split in ("train", "eval"):
        node = data[split]
        if node is None:
            continue
        key = f"data.{split}"
        prepare = getattr(locate(node._target_, key=f"{key}._target_"), "prepare_data", None)
        if not callable(prepare):
            continue
        arguments = OmegaConf.to_container(node, resolve=True)
        arguments.pop("_partial_", None)
        arguments["_target_"] = f"{node._target_}.prepare_data"
        call = json.dumps(arguments, sort_keys=True, default=str)
        if call in _PREPARED:
            continue
        build(OmegaConf.create(arguments), key=key, target=node._target_)
        _PREPARED.add(call)


def _unknown(name: str) -> ValueError:
    return ValueError(f"{name!r} is not a built-in dataset; use one of {', '.join(DATASETS)}.")


def check_splits(
    name: str, splits: list[str], *, root: str | None = None, block_size: int | None = None, val_fraction: float = 0.1
) -> None:
    """Raise ValueError for a split ``name`` does not have, or a slice that selects nothing.

    A text dataset's splits hold windows of ``block_size + 1`` characters: they are counted when
    ``root`` and ``block_size`` are given and the corpus is there.
    """
    if name in TEXT_DATASETS:
        from runner.data.text_files import TEXT_SPLITS, window_counts

        counts = (
            None
            if root is None or block_size is None
            else window_counts(root, block_size=block_size, val_fraction=val_fraction)
        )
        for split in splits:
            spec = parse_split(split)
            if spec.name not in TEXT_SPLITS:
                raise ValueError(
                    f"{name} has no split {spec.name!r} ({split!r}); use 'train' or 'val' with an optional slice."
                )
            if counts is not None and len(spec.indices(counts[spec.name])) == 0:
                raise ValueError(
                    f"Split {split!r} selects none of the {counts[spec.name]} windows of {block_size + 1} characters "
                    f"in {name}'s {spec.name} split; widen the slice, lower model.block_size or change "
                    "data.val_fraction."
                )
        return
    if name != "mnist":
        raise _unknown(name)
    from runner.data.mnist_files import MNIST_SIZES

    for split in splits:
        spec = parse_split(split)
        if spec.name not in MNIST_SIZES:
            raise ValueError(
                f"MNIST has no split {spec.name!r} ({split!r}); use 'train' or 'test' with an optional slice."
            )
        if len(spec.indices(MNIST_SIZES[spec.name])) == 0:
            raise ValueError(f"Split {split!r} selects none of MNIST's {MNIST_SIZES[spec.name]} {spec.name} images.")


def missing_files(name: str, *, root: str, splits: list[str]) -> list[str]:
    """The files ``name`` needs for ``splits`` that are not under ``root``."""
    if name in TEXT_DATASETS:
        from runner.data.text_files import SHAKESPEARE_FILE, find_corpus

        return [] if find_corpus(root) is not None else [SHAKESPEARE_FILE]
    if name == "mnist":
        from runner.data.mnist_files import MNIST_FILES, find_mnist_file

        names = list(dict.fromkeys(parse_split(s).name for s in splits))
        unknown = [name for name in names if name not in MNIST_FILES]
        if unknown:
            raise ValueError(f"MNIST has no split {unknown[0]!r}; use 'train' or 'test' (with an optional slice).")
        wanted = [file for name in names for file in MNIST_FILES[name]]
        return [file for file in wanted if find_mnist_file(Path(root), file) is None]
    raise _unknown(name)


def download_missing(name: str, *, root: str, splits: list[str]) -> list[Path]:
    """Fetch (checksum-verified) the files of ``splits`` that are not under ``root``; returns those fetched.

    Raises:
        DownloadError: No mirror delivered a file with its published checksum.
    """
    if name not in DATASETS:
        raise _unknown(name)
    if not missing_files(name, root=root, splits=splits):
        return []
    if name in TEXT_DATASETS:
        from runner.data.text_files import download_shakespeare

        return download_shakespeare(root)
    from runner.data.mnist_files import download_mnist

    return download_mnist(root, tuple(dict.fromkeys(parse_split(s).name for s in splits)))
