"""runner.data.Packed: documents of token ids as blocks of one length, document boundaries on request, resumed
exactly from its state (through a prepared loader's checkpoint too), and one sentence for what cannot be packed."""

import json

import pytest
import torch
from torch.utils.data import DataLoader

from runner.data import Packed
from runner.engine import Accelerator
from runner.engine.checkpoint.errors import CheckpointError
from runner.engine.loaders.stream_states import shown, stream_state_error
from tests.helpers import StatefulRange
from tests.unit.engine.checkpoint.checkpoint_edits import rewrite_manifest


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


# ------------------------------------------------------------------------ a saved state from someone else
FIX = "the checkpoint's stream state is not one this data can have: resume from another checkpoint or start a new run."


def saved_state(**packing) -> dict:
    """A real state of Packed(Documents(40), block_size=8, eos_token_id=0) after 2 blocks, as the manifest keeps it."""
    packed = Packed(Documents(40), block_size=8, eos_token_id=0, **packing)
    iterator = iter(packed)
    next(iterator), next(iterator)
    return json.loads(json.dumps(packed.state_dict()))


def test_saved_state_is_a_real_one_to_edit():
    # document 4, [400, ..., 404] and its eos, is the fifth read: the second block ends inside it
    state = saved_state()
    assert state == {"documents": 5, "carry": [402, 403, 404, 0], "positions": [2, 3, 4, 5], "source": {"next": 5}}


@pytest.mark.parametrize(
    ("edit", "sentence"),
    [
        ({"carry": [1] * 299 + [0], "positions": list(range(300))},
         "state.carry: 300 tokens carried over, where packing leaves fewer than block_size=8 (or the rest of one "
         "document, which these are not)"),
        ({"carry": -5}, "state.carry: -5 is not a list of token ids"),
        ({"carry": "x"}, "state.carry: 'x' is not a list of token ids"),
        ({"carry": [402, "403", 404, 0]}, "state.carry: [402, '403', 404, 0] is not a list of token ids"),
        ({"carry": [402, 403, 404, 7]}, "state.carry: its documents do not each end with eos_token_id=0"),
        ({"documents": 1, "carry": [0, 5, 0], "positions": [5, 0, 1]}, "state.carry: it holds tokens of more "
         "documents than the 1 read"),
        ({"documents": "abc"}, "state.documents: 'abc' is not a count of documents"),
        ({"documents": -1}, "state.documents: -1 is not a count of documents"),
        ({"documents": 0}, "state.carry: it holds tokens of more documents than the 0 read"),
        ({"positions": [0, 1]}, "state.positions: [0, 1] is not one position for each of the 4 tokens"),
        ({"positions": [2, 3, 5, 6]}, "state.positions: [2, 3, 5, 6] do not count up within a document"),
        ({"positions": [2, 3, -4, 5]}, "state.positions: [2, 3, -4, 5] is not one position for each of the 4 "
         "tokens"),
        ({"source": "abc"}, "state.source: 'abc' is not a count"),
    ],
)  # fmt: skip
def test_an_edited_state_is_one_sentence_naming_its_field(edit, sentence):
    class Counted(Documents):
        def check_state_dict(self, state, *, field):  # a source that checks its own state, as Mixture does
            if not isinstance(state, dict) or type(state.get("next")) is not int:
                raise stream_state_error(field, f"{shown(state)} is not a count")

    packed = Packed(Counted(40), block_size=8, eos_token_id=0)
    with pytest.raises(CheckpointError) as refused:
        packed.load_state_dict({**saved_state(), **edit})
    assert str(refused.value) == f"{sentence}; {FIX}"


def test_a_state_that_is_no_packings_and_a_source_without_state_that_gets_one_are_refused():
    for state in ("abc", {**saved_state(), "extra": 1}, {"documents": 7}):
        with pytest.raises(CheckpointError) as refused:
            Packed(Documents(40), block_size=8).load_state_dict(state)
        assert str(refused.value).startswith(f"state: {shown(state)} is not Packed's state (documents, carry, ")
    plain = saved_state() | {"source": {}}
    with pytest.raises(CheckpointError) as refused:
        Packed([[1, 2]] * 40, block_size=8, eos_token_id=0).load_state_dict(plain)
    assert str(refused.value) == f"state.source: {{}}, but the source (list) has no state; {FIX}"


def test_impossible_but_self_consistent_states_are_refused():
    # a million tokens that begin a document: a pass leaves fewer than a block over, but inside a longer document
    million = {"documents": 7, "carry": [5] * 999_999 + [0], "positions": list(range(1_000_000)), "source": None}
    with pytest.raises(CheckpointError) as refused:
        Packed([[1, 2]] * 40, block_size=8, eos_token_id=0).load_state_dict(million)
    assert str(refused.value) == (
        f"state.carry: 1000000 tokens carried over, where packing leaves fewer than block_size=8 (or the rest of one "
        f"document, which these are not); {FIX}"
    )
    # the same million tokens as the rest of one document: a source read by index says what document 6 holds
    rest = {**million, "positions": list(range(3, 1_000_003))}
    with pytest.raises(CheckpointError) as refused:
        Packed([[1, 2]] * 40, block_size=8, eos_token_id=0).load_state_dict(rest)
    assert str(refused.value) == (
        f"state.carry: its tokens 0 to 999999 are not the rest of document 6 from its position 3 (the source's "
        f"document 6 has 3 tokens); {FIX}"
    )
    documents = [list(range(1, 30)), [40, 41], list(range(50, 75))]
    packed = Packed(documents, block_size=8, eos_token_id=0)
    iterator = iter(packed)
    next(iterator), next(iterator), next(iterator)
    state = json.loads(json.dumps(packed.state_dict()))
    assert state == {"documents": 1, "carry": [25, 26, 27, 28, 29, 0], "positions": list(range(24, 30)), "source": None}
    longer = {"carry": [*state["carry"], 5, 0], "positions": list(range(24, 32))}
    for edit, tokens_ in [({"carry": [99, 26, 27, 28, 29, 0]}, "0 to 5"), (longer, "0 to 7")]:
        with pytest.raises(CheckpointError) as refused:
            Packed(documents, block_size=8, eos_token_id=0).load_state_dict({**state, **edit})
        assert str(refused.value) == (
            f"state.carry: its tokens {tokens_} are not the rest of document 0 from its position 24 (the source's "
            f"document 0 has 30 tokens); {FIX}"
        )
    Packed(documents, block_size=8, eos_token_id=0).load_state_dict(state)  # as saved: the document's rest
    skipped = {"documents": 30_000, "carry": [], "positions": [], "source": None}  # more than the source holds
    with pytest.raises(CheckpointError) as refused:
        Packed([[1, 2]] * 40, block_size=8).load_state_dict(skipped)
    assert str(refused.value) == f"state.documents: 30000 documents read, but the source holds 40; {FIX}"


def test_the_rest_of_a_document_longer_than_a_block_is_carried_and_resumes_exactly():
    documents = [list(range(1, 30)), [40, 41], list(range(50, 75))]  # 29 and 25 tokens: 3 blocks of 8 and more
    uninterrupted = tokens(Packed(documents, block_size=8, eos_token_id=0))
    packed = Packed(documents, block_size=8, eos_token_id=0)
    iterator = iter(packed)
    head = tokens([next(iterator)])
    state = json.loads(json.dumps(packed.state_dict()))
    assert len(state["carry"]) == 22 and state["positions"][0] == 8  # a block or more: one document's rest
    resumed = Packed(documents, block_size=8, eos_token_id=0)
    resumed.load_state_dict(state)
    assert head + tokens(resumed) == uninterrupted


def test_a_hugging_face_sources_state_is_checked_by_its_layout(tmp_path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "lines.txt").write_text("".join(f"line {i}\n" for i in range(30)))

    def packed():
        stream = datasets.load_dataset("text", data_files=str(tmp_path / "lines.txt"), split="train", streaming=True)
        return Packed(stream, block_size=8)

    first = packed()
    iterator = iter(first)
    head = tokens([next(iterator) for _ in range(4)])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = packed()
    resumed.load_state_dict(state)  # its own layout: accepted, and resumed exactly
    assert head + tokens(resumed) == tokens(packed())
    edits = [
        ({}, "state.source: {} is not laid out as this Hugging Face stream's state (epoch, examples_iterable)"),
        ({**state["source"], "epoch": "x"}, "state.source.epoch: 'x' is not a count"),
        ({**state["source"], "examples_iterable": {**state["source"]["examples_iterable"], "type": "Other"}},
         "state.source.examples_iterable.type: 'Other' where this stream reads a RebatchedArrowExamplesIterable"),
    ]  # fmt: skip
    for source, sentence in edits:
        with pytest.raises(CheckpointError) as refused:
            packed().load_state_dict({**state, "source": source})
        assert str(refused.value) == f"{sentence}; {FIX}"


def test_a_loaded_checkpoint_with_an_edited_packing_state_is_refused_naming_its_field(tmp_path):
    def loader(accelerator):
        return accelerator.prepare(DataLoader(Packed(Documents(60), block_size=8, eos_token_id=0), batch_size=2))

    accelerator = Accelerator(project_dir=tmp_path)
    iterator = iter(loader(accelerator))
    [next(iterator) for _ in range(4)]
    accelerator.save_state(tmp_path / "saved")
    manifest = json.loads((tmp_path / "saved" / "manifest.json").read_text())
    assert set(manifest["dataloaders"][0]["dataset_state"]) == {"documents", "carry", "positions", "source"}

    def edit(manifest: dict) -> None:  # re-digested, as someone who knows the format would
        manifest["dataloaders"][0]["dataset_state"]["carry"] = "x"

    rewrite_manifest(tmp_path / "saved", edit)
    resumed = Accelerator(project_dir=tmp_path)
    loader(resumed)
    with pytest.raises(CheckpointError) as refused:
        resumed.load_state(tmp_path / "saved")
    assert str(refused.value) == (
        f"{tmp_path / 'saved' / 'manifest.json'} dataloaders[0].dataset_state.carry: 'x' is not a list of token ids; "
        f"{FIX}"
    )
