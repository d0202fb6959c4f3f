"""Hugging Face datasets cut into blocks for a causal LM (runner.data.hf), and the next-token perplexity of
conf/data/shakespeare_hf.yaml (runner.metrics' two shift functions), on a real batch."""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import runner.data
from runner.data.hf import causal_lm_blocks
from runner.metrics import build_metrics, drop_first_position, drop_last_position
from tests.shared_data import SHAKESPEARE

datasets = pytest.importorskip("datasets")

CONF = Path(__file__).resolve().parents[3] / "conf"
LINES = ["First Citizen:\n", "Before we proceed any further, hear me speak.\n", "\n", "All: Speak, speak. é\n"]
STREAM = "".join(LINES).encode("utf-8")  # 84 bytes: "é" is two


def text(lines=LINES, **columns) -> "datasets.Dataset":
    return datasets.Dataset.from_dict({"text": list(lines), **columns})


class WordLengths:
    """A tokenizer stand-in: a token per word, its id the word's length; returns a mask too, as HF's do."""

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        ids = [[len(word) for word in line.split()] for line in texts]
        return {"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]}


def test_blocks_are_the_consecutive_utf8_bytes_of_the_text_with_labels_equal_to_inputs():
    blocks = causal_lm_blocks(text(line_number=range(len(LINES))), block_size=8, rows_per_group=None)
    assert blocks.column_names == ["input_ids", "labels"]  # the text and every other column are gone
    assert len(blocks) == len(STREAM) // 8 == 10
    rows = blocks[:]
    assert rows["input_ids"].dtype == torch.int64 and rows["input_ids"].shape == (10, 8)
    assert torch.equal(rows["labels"], rows["input_ids"])  # the model shifts inside its loss
    assert bytes(rows["input_ids"].flatten().tolist()) == STREAM[:80]  # in order, no overlap, the tail dropped
    assert runner.data.causal_lm_blocks is causal_lm_blocks  # the lazy export


def test_each_group_of_rows_drops_its_own_tail_as_run_clm_does():
    lines = ["abcde"] * 6  # groups of 2 rows: 10 bytes each, two blocks of 4 and 2 bytes dropped per group
    blocks = causal_lm_blocks(text(lines), block_size=4, rows_per_group=2)
    assert [bytes(row.tolist()) for row in blocks[:]["input_ids"]] == [b"abcd", b"eabc"] * 3
    whole = causal_lm_blocks(text(lines), block_size=4, rows_per_group=None)  # 30 bytes: 7 blocks, 2 dropped
    assert [bytes(row.tolist()) for row in whole[:]["input_ids"]] == [
        b"abcd", b"eabc", b"deab", b"cdea", b"bcde", b"abcd", b"eabc"
    ]  # fmt: skip


def test_a_tokenizer_gives_its_ids_and_only_them():
    blocks = causal_lm_blocks(text(), block_size=3, tokenizer=WordLengths(), text_column="text")
    words = [len(word) for line in LINES for word in line.split()]  # 14 words: 4 blocks of 3
    assert blocks.column_names == ["input_ids", "labels"]  # the tokenizer's attention mask is not kept
    assert blocks[:]["input_ids"].flatten().tolist() == words[:12]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            {"block_size": 0},
            "block_size=0 must be a positive integer; pass the model's context length, e.g. block_size=64.",
        ),
        ({"block_size": True}, "block_size=True must be a positive integer; pass the model's context length"),
        (
            {"block_size": 4, "rows_per_group": 0},
            "rows_per_group=0 must be a positive integer; pass e.g. 1000, or None for one group of every row.",
        ),
        (
            {"block_size": 4, "text_column": "content"},
            "text_column='content' is not a column of the dataset (its columns: text); set text_column to the one "
            "holding the text.",
        ),
        (
            {"block_size": 85},
            "The text holds 84 tokens, fewer than one block of block_size=85; lower block_size or give the dataset "
            "more text (a wider split).",
        ),
        (
            {"block_size": 50, "rows_per_group": 1},
            "No group of rows_per_group=1 rows holds block_size=50 tokens (the text holds 84 in all); raise "
            "rows_per_group, or pass rows_per_group=None.",
        ),
    ],
)
def test_values_that_cannot_work_are_one_sentence(arguments, message):
    with pytest.raises(ValueError) as error:
        causal_lm_blocks(text(), **arguments)
    assert str(error.value).startswith(message)


def test_a_dataset_dict_is_refused_with_the_split_to_pass():
    splits = datasets.DatasetDict({"train": text(), "test": text()})
    with pytest.raises(ValueError, match=r"^dataset is a DatasetDict of the splits train, test, not one split; pass"):
        causal_lm_blocks(splits, block_size=4)


def test_the_shift_functions_line_up_each_prediction_with_the_next_token():
    logits = torch.arange(2 * 4 * 3.0).reshape(2, 4, 3)  # batch 2, 4 positions, vocabulary 3
    labels = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    assert torch.equal(drop_last_position(logits), logits[:, :3]) and drop_last_position(logits).shape == (2, 3, 3)
    assert drop_first_position(labels).tolist() == [[6, 7, 8], [2, 3, 4]]


def test_the_presets_perplexity_is_exp_of_the_models_own_loss_on_real_batches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    corpus = SHAKESPEARE / "input.txt"
    lines = corpus.read_text().splitlines(keepends=True)[:200] if corpus.is_file() else LINES * 50
    blocks = causal_lm_blocks(text(lines), block_size=16)
    metrics = build_metrics(OmegaConf.load(CONF / "data" / "shakespeare_hf.yaml").metrics)
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in (blocks[:40], blocks[40:64]):  # batches of unequal size, as an eval loop meets them
            outputs = model(**batch)
            metrics.update(outputs.logits, batch["labels"])
            total, count = total + outputs.loss.item() * len(batch["labels"]), count + len(batch["labels"])
    assert math.log(256) - 0.5 < total / count < math.log(256) + 0.5  # an untrained model: about uniform
    assert metrics.compute()["eval/perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)


def test_a_streamed_hugging_face_dataset_resumes_from_its_own_state(tmp_path):
    from torch.utils.data import DataLoader

    from runner.engine import Accelerator

    (tmp_path / "input.txt").write_text("".join(f"line {i}\n" for i in range(200)))

    def loader(accelerator):
        stream = datasets.load_dataset("text", data_files=str(tmp_path / "input.txt"), split="train", streaming=True)
        return accelerator.prepare(DataLoader(stream, batch_size=8, collate_fn=lambda rows: [r["text"] for r in rows]))

    uninterrupted = list(loader(Accelerator()))
    first = loader(accelerator := Accelerator(project_dir=tmp_path))
    iterator = iter(first)
    head = [next(iterator) for _ in range(5)]
    accelerator.save_state(tmp_path / "saved")
    state = first.state_dict()
    assert state["samples_seen"] == 40 and "shard_example_idx': 40" in str(state["dataset_state"])  # HF's own
    resumed = Accelerator(project_dir=tmp_path)
    second = loader(resumed)
    resumed.load_state(tmp_path / "saved")
    assert head + list(second) == uninterrupted and len(uninterrupted) == 25
