"""Hugging Face ``datasets`` for causal language models: rows of text -> blocks of token ids to predict.

    data:
      train:
        _target_: runner.data.causal_lm_blocks
        dataset: {_target_: datasets.load_dataset, path: text, data_files: input.txt, split: "train[:90%]"}
        block_size: 64

:func:`causal_lm_blocks` is transformers' ``run_clm.py`` recipe (tokenize, then ``group_texts``) as one
call: the rows' tokens are concatenated and cut into consecutive, non-overlapping blocks of
``block_size`` tokens, each a sample ``{"input_ids": ..., "labels": ...}``. The labels are the inputs
themselves: a Hugging Face causal LM shifts them inside its loss (the logits at position t are scored
against the label at t + 1), so a block of ``block_size`` tokens gives ``block_size - 1`` predictions.

Both steps are ``Dataset.map`` calls of module-level functions, so ``datasets`` caches their results
under ``HF_HOME`` keyed by the dataset and the arguments: the main process builds the blocks, the
others (and the next run) read them back. Every block is full, so a batch needs no padding and no
attention mask.
"""

from __future__ import annotations

from functools import partial
from typing import Any

GROUP_ROWS = 1000  # rows concatenated per map batch (datasets' and run_clm's default)


def causal_lm_blocks(
    dataset: Any,
    *,
    block_size: int,
    text_column: str = "text",
    tokenizer: Any = None,
    rows_per_group: int | None = GROUP_ROWS,
) -> Any:
    """Cut the text of ``dataset`` into blocks of ``block_size`` token ids, for a causal language model.

    Args:
        dataset: A ``datasets.Dataset`` with a column of strings (``load_dataset(...)`` with a ``split``).
        block_size: Tokens per block: the model's context length (``n_positions`` for GPT-2).
        text_column: The column holding the text.
        tokenizer: A Hugging Face tokenizer (any callable taking a list of strings and returning a mapping
            with ``input_ids``); None: the text's UTF-8 bytes, a vocabulary of 256 (characters, for ASCII).
        rows_per_group: Rows whose tokens are concatenated before cutting, as ``run_clm``'s ``group_texts``
            does per map batch: the tail of each group that does not fill a block is dropped. None: the
            whole dataset is one group (every block consecutive, but all its tokens in memory at once).

    Returns:
        A ``datasets.Dataset`` with columns ``input_ids`` and ``labels`` (equal), in torch format: each row
        two int64 tensors of ``block_size`` tokens, consecutive blocks in the order of the text.

    Raises:
        ValueError: ``block_size`` or ``rows_per_group`` is below 1, ``dataset`` has no ``text_column``
            (or is a DatasetDict), or its text does not fill one block.

    Example::

        >>> text = datasets.Dataset.from_dict({"text": ["First Citizen:\\n", "Before we proceed...\\n"]})
        >>> blocks = causal_lm_blocks(text, block_size=8)
        >>> blocks[0]["input_ids"]  # b"First Ci"
        tensor([ 70, 105, 114, 115, 116,  32,  67, 105])
    """
    _check_positive("block_size", block_size, fix="pass the model's context length, e.g. block_size=64")
    if rows_per_group is not None:
        _check_positive("rows_per_group", rows_per_group, fix="pass e.g. 1000, or None for one group of every row")
    columns = _column_names(dataset)
    if text_column not in columns:
        raise ValueError(
            f"text_column={text_column!r} is not a column of the dataset (its columns: {', '.join(columns)}); "
            "set text_column to the one holding the text."
        )
    tokens = dataset.map(
        partial(_tokenize, text_column=text_column, tokenizer=tokenizer),
        batched=True, remove_columns=columns, desc="Tokenizing",
    )  # fmt: skip
    blocks = tokens.map(
        partial(_group_into_blocks, block_size=block_size),
        batched=True, batch_size=rows_per_group, remove_columns=tokens.column_names,
        desc=f"Grouping into blocks of {block_size}",
    )  # fmt: skip
    if len(blocks) == 0:
        raise _too_short(tokens, block_size=block_size, rows_per_group=rows_per_group)
    return blocks.with_format("torch")


def _tokenize(rows: dict[str, list], *, text_column: str, tokenizer: Any) -> dict[str, list[list[int]]]:
    """A map batch of rows -> their ``input_ids`` (the tokenizer's only: every block is full, no mask needed)."""
    texts = rows[text_column]
    if tokenizer is None:
        return {"input_ids": [list(text.encode("utf-8")) for text in texts]}
    return {"input_ids": list(tokenizer(texts)["input_ids"])}


def _group_into_blocks(rows: dict[str, list], *, block_size: int) -> dict[str, list[list[int]]]:
    """``run_clm``'s ``group_texts``: concatenate the batch's tokens, cut consecutive blocks, drop the tail."""
    stream = [token for ids in rows["input_ids"] for token in ids]
    end = len(stream) // block_size * block_size
    blocks = [stream[start : start + block_size] for start in range(0, end, block_size)]
    return {"input_ids": blocks, "labels": blocks.copy()}


def _check_positive(name: str, value: Any, *, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer; {fix}.")


def _column_names(dataset: Any) -> list[str]:
    """The columns of a ``datasets.Dataset``; a DatasetDict (no ``split`` given) is refused in one sentence."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):
        raise ValueError(
            f"dataset is a DatasetDict of the splits {', '.join(columns)}, not one split; pass split=... to "
            "load_dataset (e.g. split='train[:90%]')."
        )
    if not isinstance(columns, list):
        raise ValueError(
            f"dataset is a {type(dataset).__name__}, not a datasets.Dataset with columns; build it with "
            "datasets.load_dataset(..., split=...) or datasets.Dataset.from_dict."
        )
    return columns


def _too_short(tokens: Any, *, block_size: int, rows_per_group: int | None) -> ValueError:
    total = sum(len(ids) for ids in tokens["input_ids"])
    if total >= block_size:  # enough in all, but no group of rows fills a block on its own
        return ValueError(
            f"No group of rows_per_group={rows_per_group} rows holds block_size={block_size} tokens (the text holds "
            f"{total} in all); raise rows_per_group, or pass rows_per_group=None."
        )
    return ValueError(
        f"The text holds {total} tokens, fewer than one block of block_size={block_size}; lower block_size or give "
        "the dataset more text (a wider split)."
    )


def stream_slice(dataset: Any, start: int = 0, stop: int | None = None) -> Any:
    """Rows ``start`` to ``stop`` of a Hugging Face streamed dataset (``load_dataset(..., streaming=True)``,
    which takes no split slices): its ``skip`` and ``take``, whose position its ``state_dict`` keeps.

    Raises:
        ValueError: One sentence for bounds that select nothing.
    """
    if start < 0 or (stop is not None and stop <= start):
        raise ValueError(f"stream_slice's start={start}, stop={stop} select no rows; give 0 <= start < stop.")
    if start:
        dataset = dataset.skip(start)
    return dataset.take(stop - start) if stop is not None else dataset
