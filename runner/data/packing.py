"""``runner.data.Packed``: documents of token ids concatenated into blocks of one length, as a stream.

    data:
      train:
        _target_: runner.data.Packed
        dataset: {_target_: ...}          # documents: token ids (lists, tensors, dicts holding them) or text
        block_size: 1024
        column: input_ids                 # the key of a dict document
        eos_token_id: 50256               # appended to each document (null: none)
        boundaries: true                  # position_ids restart at each document (the document mask's input)
        tokenizer: null                   # text documents (a string, or text_column of a dict): its ids, else bytes

Each block is ``{"input_ids", "labels"}`` (labels = inputs: the model shifts them, as Hugging Face's causal LMs
do); with ``boundaries``, also ``position_ids`` counting from 0 in each document and ``document_ids`` numbering
the documents within the block, from which a model builds a block-diagonal attention mask (flash-attention's
variable-length kernels take ``position_ids`` so). A document longer than a block continues in the next one; the
last, short block of the stream is dropped, as ``run_clm.py`` drops it.

It records its position (``state_dict``): the source's own state when it has one (else how many documents were
read) and the tokens carried over into the next block, so a prepared loader's checkpoint resumes it exactly,
without reading what was packed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from runner.engine.data.dispatch import stateful


class Packed(IterableDataset):
    """``dataset``'s documents packed into blocks of ``block_size`` tokens (see the module docstring).

    Raises:
        ValueError: One sentence for a block size or a document that cannot be packed.
    """

    def __init__(
        self,
        dataset: Any,
        block_size: int,
        column: str = "input_ids",
        eos_token_id: int | None = None,
        boundaries: bool = False,
        text_column: str = "text",
        tokenizer: Any = None,
    ) -> None:
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"Packed's block_size={block_size!r} must be a positive integer.")
        self.dataset, self.block_size, self.column = dataset, block_size, column
        self.eos_token_id, self.boundaries = eos_token_id, boundaries
        self.text_column, self.tokenizer = text_column, tokenizer
        self._loaded: dict[str, Any] | None = None
        self._live: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The documents read and the tokens (with their positions) carried into the next block: JSON."""
        if self._loaded is not None:
            return self._loaded
        live = self._live or {"documents": 0, "carry": [], "positions": []}
        state = {key: list(value) if isinstance(value, list) else value for key, value in live.items()}
        state["source"] = self.dataset.state_dict() if stateful(self.dataset) else None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = state

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        state, self._loaded = self._loaded, None
        live = {"documents": 0, "carry": [], "positions": []}
        documents: Iterator[Any]
        if state is None:
            documents = iter(self.dataset)
        else:
            live.update(documents=state["documents"], carry=list(state["carry"]), positions=list(state["positions"]))
            if stateful(self.dataset) and state.get("source") is not None:
                self.dataset.load_state_dict(state["source"])
                documents = iter(self.dataset)
            else:  # a source without state: read past the documents already packed
                documents = itertools.islice(iter(self.dataset), state["documents"], None)
        self._live = live
        size = self.block_size
        for document in documents:
            ids = self._ids(document, live["documents"])
            live["documents"] += 1
            live["carry"] += ids
            live["positions"] += range(len(ids))
            while len(live["carry"]) >= size:
                block, live["carry"] = live["carry"][:size], live["carry"][size:]
                positions, live["positions"] = live["positions"][:size], live["positions"][size:]
                yield self._block(block, positions)

    def _ids(self, document: Any, index: int) -> list[int]:
        if isinstance(document, dict) and self.column not in document and self.text_column in document:
            document = document[self.text_column]
        if isinstance(document, str):  # text: the tokenizer's ids, else its UTF-8 bytes (as causal_lm_blocks reads it)
            return self._ids(
                self.tokenizer(document)["input_ids"] if self.tokenizer else list(document.encode()), index
            )
        ids = document.get(self.column) if isinstance(document, dict) else document
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
            what = f"a dict without {self.column!r} or {self.text_column!r}" if ids is None else type(ids).__name__
            raise ValueError(
                f"Packed's document {index} is {what}, not token ids or text; give documents of ids or text (or "
                f"dicts whose {self.column!r} or {self.text_column!r} holds them)."
            )
        return [*ids, self.eos_token_id] if self.eos_token_id is not None else list(ids)

    def _block(self, block: list[int], positions: list[int]) -> dict[str, torch.Tensor]:
        ids = torch.tensor(block, dtype=torch.long)
        packed = {"input_ids": ids, "labels": ids.clone()}
        if self.boundaries:
            packed["position_ids"] = torch.tensor(positions, dtype=torch.long)
            starts = [i == 0 or p == 0 for i, p in enumerate(positions)]
            packed["document_ids"] = torch.tensor(list(itertools.accumulate(starts)), dtype=torch.long) - 1
        return packed
