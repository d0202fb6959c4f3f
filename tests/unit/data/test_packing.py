"""runner.data.Packed: documents of token ids as blocks of one length, document boundaries on request, resumed
exactly from its state (through a prepared loader's checkpoint too), and one sentence for what cannot be packed."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

from runner.data import Packed
from runner.engine import Accelerator
from tests.helpers import StatefulRange


class Documents(StatefulRange):
    """Document i is [100 * i, 100 * i + 1, ...] of length 1 + i % 5: a stream with state."""

    def __iter__(self):
        for index in super().__iter__():
            yield {"input_ids": [100 * index + k for k in range(1 + index % 5)], "text": "ignored"}


def tokens(blocks) -> list[int]:
    return [int(t) for block in blocks for t in block["input_ids"]]


def test_documents_are_concatenated_into_blocks_with_an_eos_and_the_short_tail_dropped():
    blocks = list(Packed(Documents(6), block_size=4, eos_token_id=-1))
    every = [t for i in range(6) for t in [*(100 * i + k for k in range(1 + i % 5)), -1]]  # 16 ids and 6 eos: 22 tokens
    assert tokens(blocks) == every[:20] and len(blocks) == 5
    assert all(torch.equal(block["labels"], block["input_ids"]) for block in blocks)
    assert set(blocks[0]) == {"input_ids", "labels"}


def test_boundaries_give_each_documents_positions_and_its_number_in_the_block():
    (first, second) = list(Packed([[1, 2, 3], [4, 5], [6, 7, 8, 9]], block_size=4, boundaries=True))
    assert first["input_ids"].tolist() == [1, 2, 3, 4] and second["input_ids"].tolist() == [5, 6, 7, 8]
    assert first["position_ids"].tolist() == [0, 1, 2, 0] and first["document_ids"].tolist() == [0, 0, 0, 1]
    # the second document continues across the block's start: its positions go on, it is the block's first
    assert second["position_ids"].tolist() == [1, 0, 1, 2] and second["document_ids"].tolist() == [0, 1, 1, 1]


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_resumed_packing_continues_exactly_reading_only_what_follows(cut):
    uninterrupted = list(Packed(Documents(40), block_size=8, boundaries=True))
    packed = Packed(Documents(40), block_size=8, boundaries=True)
    iterator = iter(packed)
    head = [next(iterator) for _ in range(cut)]
    state = json.loads(json.dumps(packed.state_dict()))  # as the manifest keeps it
    source = Documents(40)
    resumed = Packed(source, block_size=8, boundaries=True)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head + rest) == len(uninterrupted)
    assert all(all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(head + rest, uninterrupted, strict=True))
    assert source.reads == 40 - state["documents"]  # no document read twice
    plain = Packed([[1, 2, 3]] * 10, block_size=2)  # a source without state: read past what was packed
    iterator = iter(plain)
    next(iterator), next(iterator)
    again = Packed([[1, 2, 3]] * 10, block_size=2)
    again.load_state_dict(plain.state_dict())
    assert tokens(list(again)) == tokens(list(Packed([[1, 2, 3]] * 10, block_size=2)))[4:]


def test_a_prepared_loader_checkpoints_the_packing_and_resumes_it(tmp_path):
    def loader(accelerator):
        return accelerator.prepare(DataLoader(Packed(Documents(60), block_size=8, eos_token_id=0), batch_size=2))

    uninterrupted = [batch["input_ids"] for batch in loader(Accelerator())]
    accelerator = Accelerator(project_dir=tmp_path)
    first = loader(accelerator)
    iterator = iter(first)
    head = [next(iterator)["input_ids"] for _ in range(4)]
    accelerator.save_state(tmp_path / "saved")
    resumed = Accelerator(project_dir=tmp_path)
    second = loader(resumed)
    resumed.load_state(tmp_path / "saved")
    rest = [batch["input_ids"] for batch in second]
    assert len(head + rest) == len(uninterrupted)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, uninterrupted, strict=True))


@pytest.mark.parametrize(
    ("arguments", "sentence"),
    [
        ({"dataset": [[1]], "block_size": 0}, "Packed's block_size=0 must be a positive integer."),
        ({"dataset": [[1]], "block_size": "64"}, "Packed's block_size='64' must be a positive integer."),
    ],
)
def test_what_cannot_be_packed_is_one_sentence(arguments, sentence):
    with pytest.raises(ValueError) as refused:
        Packed(**arguments)
    assert str(refused.value) == sentence
    for documents, what in [([[1, 2], 3.5], "float"), ([[1, 2], {"ids": [1]}], "a dict without 'input_ids' or 'text'")]:
        with pytest.raises(ValueError) as refused:
            list(Packed(documents, block_size=2))
        assert str(refused.value) == (
            f"Packed's document 1 is {what}, not token ids or text; give documents of ids or text (or dicts whose "
            "'input_ids' or 'text' holds them)."
        )


def test_text_documents_are_packed_as_their_utf8_bytes_or_a_tokenizers_ids():
    blocks = list(Packed([{"text": "ab\n"}, "cé\n"], block_size=3))
    assert [block["input_ids"].tolist() for block in blocks] == [[97, 98, 10], [99, 195, 169]]
    tokenized = list(Packed(["ab", "cd"], block_size=2, tokenizer=lambda text: {"input_ids": [ord(text[0])]}))
    assert [block["input_ids"].tolist() for block in tokenized] == [[97, 99]]
