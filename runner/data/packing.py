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
without reading what was packed. A loaded state is checked first (``check_state_dict``): one this packing cannot
reach is one sentence naming its field. Between blocks the carry is shorter than a block, except inside a
document longer than a block, whose unpacked rest it then is; that rest is as long as the document makes it. A
source that reads by index (a list, a map-style dataset) is read again at the carried documents, whose rest the
carry must be, token for token; a stream cannot be read again, and its carry is taken as recorded.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset

from runner.engine.loaders.dispatch import stateful
from runner.engine.loaders.stream_states import check_stream_state, is_count, known_length, shown, stream_state_error

_STATE_KEYS = ("documents", "carry", "positions", "source")


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
        """Continue from ``state`` on the next pass; a CheckpointError for one it cannot have (``check_state_dict``)."""
        self.check_state_dict(state)
        self._loaded = state

    def check_state_dict(self, state: Any, *, field: str = "state") -> None:
        """Raise CheckpointError, one sentence naming ``field``'s key, unless this packing can reach ``state``.

        The documents read are a count (at most the source's length, where it has one), the carry holds token
        ids with a position each (counting up within a document, each document ending with ``eos_token_id``), and
        the source's state is checked by the source (:func:`~runner.engine.loaders.stream_states.check_stream_state`).
        """
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            raise stream_state_error(field, f"{shown(state)} is not Packed's state ({', '.join(_STATE_KEYS)})")
        documents = state["documents"]
        if not is_count(documents):
            raise stream_state_error(f"{field}.documents", f"{shown(documents)} is not a count of documents")
        length = known_length(self.dataset)
        if length is not None and documents > length:
            raise stream_state_error(f"{field}.documents", f"{documents} documents read, but the source holds {length}")
        self._check_carry(state["carry"], state["positions"], documents=documents, field=field)
        source = state["source"]
        if source is not None and not stateful(self.dataset):
            raise stream_state_error(
                f"{field}.source", f"{shown(source)}, but the source ({type(self.dataset).__name__}) has no state"
            )
        if source is not None:
            check_stream_state(self.dataset, source, field=f"{field}.source")
        if state["carry"] and self._reads_by_index():
            self._check_carried_documents(state["carry"], state["positions"], documents=documents, field=field)

    def _check_carry(self, carry: Any, positions: Any, *, documents: int, field: str) -> None:
        if not isinstance(carry, list) or not all(type(token) is int for token in carry):
            raise stream_state_error(f"{field}.carry", f"{shown(carry)} is not a list of token ids")
        if not (isinstance(positions, list) and len(positions) == len(carry) and all(map(is_count, positions))):
            raise stream_state_error(
                f"{field}.positions", f"{shown(positions)} is not one position for each of the {len(carry)} tokens"
            )
        starts = [k for k, position in enumerate(positions) if position == 0]
        if any(positions[k] not in (0, positions[k - 1] + 1) for k in range(1, len(positions))):
            raise stream_state_error(f"{field}.positions", f"{shown(positions)} do not count up within a document")
        if len(starts) + (1 if positions and positions[0] > 0 else 0) > documents:
            raise stream_state_error(f"{field}.carry", f"it holds tokens of more documents than the {documents} read")
        if len(carry) >= self.block_size and starts:
            raise stream_state_error(
                f"{field}.carry",
                f"{len(carry)} tokens carried over, where packing leaves fewer than block_size={self.block_size} "
                "(or the rest of one document, which these are not)",
            )
        ends = [k - 1 for k in starts if k] + ([len(carry) - 1] if carry else [])
        if self.eos_token_id is not None and any(carry[k] != self.eos_token_id for k in ends):
            raise stream_state_error(
                f"{field}.carry", f"its documents do not each end with eos_token_id={self.eos_token_id}"
            )

    def _reads_by_index(self) -> bool:
        """Whether the source's document ``i`` is ``dataset[i]`` (a list, a map-style dataset), so a carried document
        can be read again; a stream's cannot, and its carry is taken as recorded."""
        return (
            not isinstance(self.dataset, IterableDataset)
            and not stateful(self.dataset)
            and known_length(self.dataset) is not None
            and callable(getattr(self.dataset, "__getitem__", None))
        )

    def _check_carried_documents(self, carry: list[int], positions: list[int], *, documents: int, field: str) -> None:
        """Each carried document is the rest of the one the source holds at its index: the last is the last read."""
        bounds = sorted({0, *(k for k, position in enumerate(positions) if position == 0)}) + [len(carry)]
        pieces = list(itertools.pairwise(bounds))
        for back, (first, end) in enumerate(reversed(pieces), start=1):
            index = documents - back
            document = self._ids(self.dataset[index], index)
            if carry[first:end] != document[positions[first] :]:
                raise stream_state_error(
                    f"{field}.carry",
                    f"its tokens {first} to {end - 1} are not the rest of document {index} from its position "
                    f"{positions[first]} (the source's document {index} has {len(document)} tokens)",
                )

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
