"""``python -m runner experiment=shakespeare_gpt*`` end to end, on tiny models and the real corpus."""

import io
import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
from torch.utils.data import DataLoader

from runner.cli.export import main as export
from runner.cli.generate import GenerateError, generate
from runner.data.text import CharVocab, build_char_dataset, read_corpus
from runner.engine import load_checkpoint_in_model
from runner.models import GPT
from tests.e2e.conftest import metrics, run_cli
from tests.shared_data import SHAKESPEARE, needs_shakespeare

TINY = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
EVAL_WINDOWS = 64

pytestmark = needs_shakespeare


def lm_args(experiment: str = "shakespeare_gpt") -> list[str]:
    """A tiny GPT on the real corpus, evaluated on the first windows of the val split."""
    return [
        f"experiment={experiment}", f"data.root={SHAKESPEARE}", "data.batch_size=16",
        f'data.eval_split="val[:{EVAL_WINDOWS}]"', "data.eval_batch_size=24", "trainer.log_every_n_steps=5",
        "optimizer.lr=3e-3", "scheduler.warmup_steps=2", *(f"model.{key}={value}" for key, value in TINY.items()),
    ]  # fmt: skip


def final_model(run_dir) -> GPT:
    model = GPT(65, **TINY)
    load_checkpoint_in_model(model, run_dir / "model", strict=True)  # the final model, into a plain GPT
    return model.eval()


def eval_loss(model: GPT) -> float:
    """The eval split's mean loss per character, computed here in one process."""
    windows = build_char_dataset(SHAKESPEARE, split=f"val[:{EVAL_WINDOWS}]", block_size=TINY["block_size"])
    inputs, targets = next(iter(DataLoader(windows, batch_size=EVAL_WINDOWS)))
    with torch.no_grad():
        return model(inputs, targets)[1].item()


def test_shakespeare_gpt_learns_samples_and_keeps_its_vocabulary(tmp_path):
    run = tmp_path / "run"
    result = run_cli(
        *lm_args(), "trainer.max_steps=30", "trainer.eval_every_n_steps=15", "trainer.checkpoint_every_n_steps=15",
        f"hydra.run.dir={run}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(run)
    assert set(summary) == {"eval/loss", "eval/perplexity", "train/loss", "step", "epoch"}
    assert summary["step"] == 30 and summary["epoch"] == 0
    assert summary["eval/loss"] < 3.6, summary  # it learned: uniform guessing is ln 65 = 4.17
    assert summary["eval/perplexity"] == pytest.approx(math.exp(summary["eval/loss"]))
    model = final_model(run)
    assert eval_loss(model) == pytest.approx(summary["eval/loss"], abs=1e-5)  # every eval window exactly once

    vocab = CharVocab.from_text(read_corpus(SHAKESPEARE / "input.txt"))
    assert CharVocab.load(run / "model" / "vocab.json") == vocab and len(vocab) == 65
    for checkpoint in ("checkpoint_0", "checkpoint_1"):
        assert CharVocab.load(run / "checkpoints" / checkpoint / "vocab.json") == vocab
        manifest = json.loads((run / "checkpoints" / checkpoint / "manifest.json").read_text())
        assert "vocab.json" in manifest["files"]  # covered by the checkpoint's checksums
    samples = (run / "samples.txt").read_text(encoding="utf-8").rstrip("\n").split("\n\n---\n\n")
    assert [len(sample) for sample in samples] == [300, 300, 300]
    assert set("".join(samples)) <= set(vocab.chars) and len(set(samples)) == 3
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "logs"))
    events.Reload()
    (text,) = events.Tensors("samples/text_summary")  # the trackers get the samples as text, at the last step
    assert text.step == 30 and text.tensor_proto.string_val[0].decode() == "\n\n---\n\n".join(samples)

    # runner generate: the model's own sampling, streamed as it comes; the same seed gives the same text
    out = io.StringIO()
    settings = {"prompt": "ROMEO:", "max_new_tokens": 40, "temperature": 0.8, "top_k": None}
    first = generate(str(run), **settings, seed=1, out=out)
    assert first == out.getvalue() and first.startswith("ROMEO:") and first.endswith("\n") and len(first) == 47
    drawn = final_model(run).generate(
        vocab.encode("ROMEO:").long()[None], 40, temperature=0.8, generator=torch.Generator().manual_seed(1)
    )
    assert first == "ROMEO:" + vocab.decode(drawn[0, 6:]) + "\n"
    assert generate(str(run), **settings, seed=1) == first and generate(str(run), **settings, seed=2) != first
    earlier = generate(str(run / "checkpoints" / "checkpoint_0"), **settings, seed=1)  # step 15's weights
    assert earlier != first and len(earlier) == 47
    with pytest.raises(GenerateError) as refused:
        generate(str(run), **{**settings, "prompt": "ROMEO€"}, seed=1)
    assert str(refused.value) == (
        f"prompt='ROMEO€': The character '€' is not in the vocabulary of 65 characters. Use the run's characters "
        f"({run / 'model' / 'vocab.json'})."
    )
    copy = tmp_path / "copy"  # a run's model/ without its vocabulary, then with another model's weights
    shutil.copytree(run, copy)
    (copy / "model" / "vocab.json").unlink()
    save_file({"wte.weight": torch.zeros(3, 2)}, copy / "model" / "model.safetensors")
    refusals = [
        ({"prompt": ""}, run, "prompt='' is empty; give the model something to continue, prompt=\\n at least."),
        ({}, copy, f"{copy / 'model'} has no vocab.json, the characters the model reads; point at the run folder or "
         "a checkpoint the language model recipe wrote."),
    ]  # fmt: skip
    for changed, folder, sentence in refusals:
        with pytest.raises(GenerateError) as refused:
            generate(str(folder), **{**settings, **changed}, seed=1)
        assert str(refused.value) == sentence
    shutil.copy(run / "model" / "vocab.json", copy / "model" / "vocab.json")
    with pytest.raises(GenerateError, match=rf"^The weights in {re.escape(str(copy / 'model'))} are not GPT's "):
        generate(str(copy), **settings, seed=1)

    # runner eval: the final checkpoint's eval, exactly the run's own
    evaluated = run_cli("eval", str(run), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (record,) = [json.loads(path.read_text()) for path in run.glob("eval-*.json")]
    assert record == {"checkpoint": str(run / "checkpoints" / "checkpoint_1"), "step": 30,
                      "eval/loss": summary["eval/loss"], "eval/perplexity": summary["eval/perplexity"]}  # fmt: skip

    log = (run / "run.log").read_text()
    assert "GPT with 0.01M parameters, vocabulary of 65 characters" in log
    assert "train/tokens_per_second" in log and "train/mfu" not in log  # MFU only on GPUs
    assert "step 30/30 | eval/loss" in log


def test_resumed_language_model_matches_an_uninterrupted_run_bit_for_bit(tmp_path):
    constant = [
        "scheduler.warmup_steps=0",
        "scheduler.min_lr_ratio=1.0",
    ]  # the cosine, flat: max_steps does not shape it
    common = [*lm_args(), *constant, "model.dropout=0.1", "trainer.checkpoint_every_n_steps=4"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    done = run_cli(*common, "trainer.max_steps=12", f"hydra.run.dir={full}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert run_cli(*common, "trainer.max_steps=6", f"hydra.run.dir={cut}", cwd=tmp_path).returncode == 0
    resumed = run_cli(f"resume={cut}/checkpoints/checkpoint_0", "trainer.max_steps=12", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (cut / "run.log").read_text()
    assert "Resumed at step 4" in log
    # checkpoint_1 (step 6) is left behind: the run says so, and TensorBoard is told to hide steps 5 and after.
    assert "Resuming checkpoint_0 (step 4), older than this run's checkpoint_1 (step 6): the run goes on from step 4 " \
           "as a new branch" in log  # fmt: skip
    starts = [(event.step, path) for path in sorted((cut / "logs").rglob("events.out.tfevents.*"))
              for event in LegacyEventFileLoader(str(path)).Load() if event.HasField("session_log")]  # fmt: skip
    assert [step for step, _ in starts] == [5]

    assert metrics(cut) == metrics(full)  # eval loss, perplexity and the logged train loss
    expected, got = load_file(full / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert (cut / "samples.txt").read_text() == (full / "samples.txt").read_text()


def test_changed_corpus_is_refused_on_resume(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "input.txt").write_text("to be or not to be, that is the question\n" * 60)
    run = tmp_path / "run"
    args = [*lm_args(), f"data.root={corpus}", 'data.eval_split="val[:4]"', "trainer.max_steps=2"]
    assert run_cli(*args, f"hydra.run.dir={run}", cwd=tmp_path).returncode == 0
    (corpus / "input.txt").write_text("TO BE OR NOT TO BE, THAT IS THE QUESTION\n" * 60)
    result = run_cli(f"resume={run}", "trainer.max_steps=4", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"runner: error: {run}/checkpoints/checkpoint_0/vocab.json differs from the vocabulary of the corpus in "
        f"{corpus}; resume with the text the run was trained on."
    )


@pytest.mark.parametrize("experiment", ["shakespeare_gpt_ddp", "shakespeare_gpt_fsdp"])
def test_two_process_language_models_learn_and_evaluate_every_window(tmp_path, experiment):
    run = tmp_path / "run"
    result = run_cli(*lm_args(experiment), "trainer.max_steps=10", f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(run)
    assert summary["step"] == 10 and math.isfinite(summary["eval/loss"])
    assert summary["eval/loss"] < math.log(65), summary
    # 64 windows over 2 ranks in batches of 24: the padding of the last batch is dropped again.
    assert eval_loss(final_model(run)) == pytest.approx(summary["eval/loss"], abs=1e-5)
    manifest = json.loads((run / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and "vocab.json" in manifest["files"]
    if experiment.endswith("fsdp"):  # sharded checkpoints, the tied embedding included, load again
        assert {"model/__0_0.distcp", "model/__1_0.distcp"} <= set(manifest["files"])
        resumed = run_cli(f"resume={run}", "trainer.max_steps=12", cwd=tmp_path)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert metrics(run)["step"] == 12 and "Resumed at step 10" in (run / "run.log").read_text()


def test_tensor_parallel_gpt_trains_and_saves_the_full_plain_model(tmp_path):
    run = tmp_path / "run"
    args = [*lm_args("shakespeare_gpt_tp"), "trainer.checkpoint_every_n_steps=5"]
    result = run_cli(*args, "trainer.max_steps=10", f"hydra.run.dir={run}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = metrics(run)
    assert summary["step"] == 10 and math.isfinite(summary["eval/loss"]), summary
    train_losses = [float(value) for value in re.findall(r"train/loss (\S+)", (run / "run.log").read_text())]
    assert len(train_losses) == 2 and all(math.isfinite(loss) for loss in train_losses), train_losses

    # model.safetensors is the whole model (no shards of the tp dimension): a 1-process GPT's shapes.
    saved = load_file(run / "model" / "model.safetensors")
    plain = GPT(65, **TINY).state_dict()
    assert set(saved) <= set(plain) and {k: v.shape for k, v in saved.items()} == {k: plain[k].shape for k in saved}
    assert saved["blocks.0.attn.qkv.weight"].shape == (3 * TINY["n_embd"], TINY["n_embd"])
    # Loaded into a plain GPT it computes the logged eval loss: the TP group's one batch, every window once.
    assert eval_loss(final_model(run)) == pytest.approx(summary["eval/loss"], abs=1e-4)
    # Both processes of the TP group read the same batches: the weights of one process's run on the same data.
    single = tmp_path / "single"
    done = run_cli(*lm_args(), "trainer.max_steps=10", f"hydra.run.dir={single}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = load_file(single / "model" / "model.safetensors")
    assert expected.keys() == saved.keys()
    for name, tensor in saved.items():
        # 1e-7 apart here; FSDP on 2 processes (each its own batch) ends 2e-2 apart.
        torch.testing.assert_close(
            tensor, expected[name], atol=1e-4, rtol=0, msg=lambda text, name=name: f"{name}: {text}"
        )

    # Two pipeline stages (the embeddings and the block, then the final norm and the head) reading the same batches:
    # the same weights as one process, up to float rounding (1e-6 here), and an export of its sharded checkpoint.
    pipelined = tmp_path / "pipelined"
    done = run_cli(
        *lm_args("shakespeare_gpt_pp"), "parallel.pp_split_points=[ln_f]", "trainer.max_steps=10",
        f"hydra.run.dir={pipelined}", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    staged = load_file(pipelined / "model" / "model.safetensors")
    assert staged.keys() == expected.keys()
    for name, tensor in staged.items():
        torch.testing.assert_close(
            tensor, expected[name], atol=1e-5, rtol=0, msg=lambda text, name=name: f"{name}: {text}"
        )
    assert eval_loss(final_model(pipelined)) == pytest.approx(metrics(pipelined)["eval/loss"], abs=1e-5)
    assert export([str(pipelined / "checkpoints" / "checkpoint_0"), "--to", str(tmp_path / "staged")]) == 0
    exported = load_file(tmp_path / "staged" / "model.safetensors")
    assert [name for name in staged if not torch.equal(exported[name], staged[name])] == []
    # runner generate reads the stages' checkpoint as the final model; runner eval gives the run's own loss.
    sampling = {"prompt": "ROMEO:", "max_new_tokens": 40, "temperature": 0.8, "top_k": None, "seed": 3}
    from_checkpoint = generate(str(pipelined / "checkpoints" / "checkpoint_0"), **sampling, out=io.StringIO())
    assert from_checkpoint == generate(str(pipelined), **sampling, out=io.StringIO())
    assert from_checkpoint.startswith("ROMEO:") and len(from_checkpoint) > 40
    evaluated = run_cli("eval", str(pipelined), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (record,) = [json.loads(path.read_text()) for path in pipelined.glob("eval-*.json")]
    assert record["eval/loss"] == metrics(pipelined)["eval/loss"]

    for checkpoint, step in (("checkpoint_0", 5), ("checkpoint_1", 10)):
        manifest = json.loads((run / "checkpoints" / checkpoint / "manifest.json").read_text())
        assert (manifest["world_size"], manifest["step"]) == (2, step), manifest
    # runner export on one process: checkpoint_1's tensor-parallel shards (step 10) are the final model's weights
    assert export([str(run / "checkpoints" / "checkpoint_1"), "--to", str(tmp_path / "exported")]) == 0
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    assert set(saved) <= set(exported) <= set(plain)
    assert [name for name in saved if not torch.equal(exported[name], saved[name])] == []
    for name in set(exported) - set(saved):  # a tied weight under its second name: the same values
        assert any(torch.equal(exported[name], saved[other]) for other in saved), name
    # The sharded checkpoint reshards onto another mesh: plain FSDP over the same 2 processes.
    resumed = run_cli(f"resume={run}", "trainer.max_steps=12", "parallel.tp=1", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metrics(run)["step"] == 12 and "Resumed at step 10" in (run / "run.log").read_text()
