"""``python -m runner experiment=shakespeare_hf`` end to end: a tiny Hugging Face GPT-2 on the real corpus read by
Hugging Face datasets, on 1 and 2 processes; the run's model folder loads with ``from_pretrained``."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from runner.cli.export import main as export
from runner.cli.generate import generate
from runner.data import causal_lm_blocks
from tests.e2e.conftest import metrics, run_cli
from tests.shared_data import SHAKESPEARE, needs_shakespeare

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

TINY = {"n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}
EVAL_SPLIT = "train[99%:]"  # the last 400 lines: 349 blocks of 32 bytes
UNTRAINED_LOSS = math.log(256)  # 5.545: a uniform guess over the bytes
LEARNED_LOSS = 4.0  # measured: 3.42 after 30 steps on 1 process, 3.38 on 2 (DDP), 3.65 after 20 steps of FSDP

pytestmark = needs_shakespeare


def hf_args(*extra: str) -> list[str]:
    """The tiny model on the real corpus, a flat learning rate (so max_steps does not shape it: resume runs
    compare with uninterrupted ones), evaluated at the end on the last 1% of the lines. ``scheduler=constant``
    switches the group the experiment set, which leaves its cosine keys out
    (runner.config.validation.settle_options)."""
    return [
        "experiment=shakespeare_hf", f"data.root={SHAKESPEARE}", f'data.eval_split="{EVAL_SPLIT}"',
        "data.batch_size=16", "data.eval_batch_size=48", "optimizer.lr=3e-3", "scheduler=constant",
        "trainer.log_every_n_steps=10",
        *(f"model.config.{key}={value}" for key, value in TINY.items()), *extra,
    ]  # fmt: skip


def train(folder, *extra: str):
    """A finished run in ``folder``."""
    done = run_cli(*hf_args(*extra), f"hydra.run.dir={folder}", cwd=folder.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train(tmp_path_factory.mktemp("hf") / "one_process", "trainer.max_steps=30")


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    two = ("trainer.num_processes=2", "parallel=ddp")
    return train(tmp_path_factory.mktemp("hf") / "ddp", "trainer.max_steps=30", *two)


def eval_inputs() -> torch.Tensor:
    """Every eval block, as the runs read them."""
    text = datasets.load_dataset(
        "text", data_files=str(SHAKESPEARE / "input.txt"), keep_linebreaks=True, split=EVAL_SPLIT
    )
    return causal_lm_blocks(text, block_size=TINY["n_positions"])[:]["input_ids"]


def model_from_the_weights_file(run) -> torch.nn.Module:
    """The trained model, built here from its config values and model/model.safetensors (not from_pretrained)."""
    config = transformers.GPT2Config(vocab_size=256, **TINY, bos_token_id=None, eos_token_id=None)
    model = transformers.GPT2LMHeadModel(config)
    weights = load_file(run / "model" / "model.safetensors")  # the tied head once, under FSDP too
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # the head is tied to the embedding
    assert model.lm_head.weight is model.transformer.wte.weight
    return model.eval()


def check_from_pretrained(run) -> float:
    """``AutoModelForCausalLM.from_pretrained(run/model)`` loads every weight and gives the trained model's logits;
    returns its mean loss over the eval blocks."""
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(run / "model", output_loading_info=True)
    assert type(loaded).__name__ == "GPT2LMHeadModel" and all(not keys for keys in info.values()), info
    assert json.loads((run / "model" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    assert (run / "model" / "generation_config.json").is_file()
    inputs = eval_inputs()
    with torch.no_grad():
        outputs = loaded.eval()(input_ids=inputs, labels=inputs)
        reference = model_from_the_weights_file(run)(input_ids=inputs).logits
    torch.testing.assert_close(outputs.logits, reference, rtol=0, atol=1e-6)
    return outputs.loss.item()


@pytest.mark.parametrize("run_name", ["one_process", "two_processes"])
def test_shakespeare_hf_learns_and_leaves_a_hugging_face_model(request, run_name):
    run = request.getfixturevalue(run_name)
    summary = metrics(run)
    assert set(summary) == {"eval/loss", "eval/perplexity", "train/loss", "step", "epoch"}
    assert summary["step"] == 30 and summary["eval/loss"] < LEARNED_LOSS < UNTRAINED_LOSS, summary
    assert summary["eval/perplexity"] == pytest.approx(math.exp(summary["eval/loss"]), rel=1e-4)
    # Every eval block counted once (on 2 processes the last batch's padding is dropped again): the same mean
    # loss as one forward over all of them here, with the model from_pretrained loads.
    assert check_from_pretrained(run) == pytest.approx(summary["eval/loss"], abs=1e-5)
    # runner export of the newest checkpoint (step 30, one file for the whole model): the final model folder again
    exported = run.parent / f"{run.name}-exported"
    assert export([str(run), "--to", str(exported)]) == 0
    assert load_file(exported / "model.safetensors").keys() == load_file(run / "model" / "model.safetensors").keys()
    assert (exported / "model.safetensors").read_bytes() == (run / "model" / "model.safetensors").read_bytes()
    for name in ("config.json", "generation_config.json"):  # copied from the run's final model folder
        assert (exported / name).read_text() == (run / "model" / name).read_text()
    if run_name == "two_processes":  # runner eval after DDP, on its 2 processes: the run's own final eval exactly
        evaluated = run_cli("eval", str(run), cwd=run.parent)
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        (record,) = [json.loads(path.read_text()) for path in run.glob("eval-*.json")]
        assert {key: record[key] for key in ("step", "eval/loss", "eval/perplexity")} == {
            key: summary[key] for key in ("step", "eval/loss", "eval/perplexity")
        }


def test_generate_samples_a_hugging_face_run_as_its_own_generate_does(one_process):
    settings = {"prompt": "KING:", "max_new_tokens": 24, "temperature": 0.9, "top_k": 40}
    first = generate(str(one_process), **settings, seed=3)
    assert first.startswith("KING:") and generate(str(one_process), **settings, seed=3) == first
    assert generate(str(one_process), **settings, seed=4) != first
    model = transformers.AutoModelForCausalLM.from_pretrained(one_process / "model").eval()
    torch.manual_seed(3)
    with torch.no_grad():  # the bytes of the text, as the run read its corpus
        ids = model.generate(
            torch.tensor([list(b"KING:")]), attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=24,
            min_new_tokens=24, do_sample=True, temperature=0.9, top_k=40, pad_token_id=0,
        )  # fmt: skip
    assert first == bytes(ids[0].tolist()).decode("utf-8", errors="replace") + "\n"


FROM_RUN = """# The tiny GPT-2, started from another run's weights
_target_: runner.models.from_run
source: ???
model:
  _target_: transformers.GPT2LMHeadModel
  config: {_target_: transformers.GPT2Config, vocab_size: 256, n_positions: 32, n_embd: 32, n_layer: 2, n_head: 2,
           bos_token_id: null, eos_token_id: null}
"""


def test_a_run_starts_from_another_runs_weights_with_from_run(tmp_path, one_process):
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "gpt2_from_run.yaml").write_text(FROM_RUN)
    args = [arg for arg in hf_args() if not arg.startswith("model.config.")]  # the model node is FROM_RUN's
    run = tmp_path / "tuned"
    done = run_cli(
        "--config-dir", str(tmp_path / "conf"), *args, "model=gpt2_from_run", f"model.source={one_process}",
        "data.train.block_size=32", "optimizer.lr=1e-12", "trainer.max_steps=1", f"hydra.run.dir={run}", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # One AdamW step of lr 1e-12 moves a weight by about 1e-12: the run holds the source run's final weights (an
    # untrained model's differ by 1e-2) and evaluates as the source did.
    expected, got = (load_file(folder / "model" / "model.safetensors") for folder in (one_process, run))
    assert expected.keys() == got.keys()
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) < 1e-10
    assert metrics(run)["eval/loss"] == pytest.approx(metrics(one_process)["eval/loss"], abs=1e-6)


def test_fsdp_run_trains_and_leaves_a_hugging_face_model(tmp_path):
    run = train(
        tmp_path / "fsdp", "trainer.max_steps=20", "trainer.num_processes=2", "parallel=fsdp",
        "parallel.shard_modules=[GPT2Block]",
    )  # fmt: skip
    summary = metrics(run)
    assert summary["step"] == 20 and summary["eval/loss"] < LEARNED_LOSS, summary
    manifest = json.loads((run / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    assert {"model/__0_0.distcp", "model/__1_0.distcp"} <= set(manifest["files"])  # each GPT2Block was sharded
    # The sharded class is FSDPGPT2LMHeadModel; config.json names the model's own class.
    assert check_from_pretrained(run) == pytest.approx(summary["eval/loss"], abs=1e-5)

    # runner export, on this one process: the 2 processes' DCP shards of checkpoint_0 (step 20) as one file
    assert export([str(run), "--to", str(tmp_path / "exported")]) == 0
    exported, final = (
        load_file(tmp_path / "exported" / "model.safetensors"),
        load_file(run / "model" / "model.safetensors"),
    )
    assert set(exported) == set(final) | {"lm_head.weight"}  # DCP keeps the tied head under both names
    assert [key for key in final if not torch.equal(exported[key], final[key])] == []
    assert torch.equal(exported["lm_head.weight"], exported["transformer.wte.weight"])
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    with torch.no_grad():
        logits = loaded.eval()(input_ids=eval_inputs()[:8]).logits
        torch.testing.assert_close(logits, model_from_the_weights_file(run)(input_ids=eval_inputs()[:8]).logits)
    plain = transformers.GPT2LMHeadModel(loaded.config)  # and in plain torch, every key
    loaded_keys = plain.load_state_dict(exported)  # strict: every name, the tied head's too
    assert (loaded_keys.missing_keys, loaded_keys.unexpected_keys) == ([], [])
    assert torch.equal(plain.lm_head.weight, final["transformer.wte.weight"])

    # A run whose final model folder is gone (an interrupted one): config.json comes from the run's model.config
    (run / "model").rename(run / "final")
    assert export([str(run), "--to", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    built, saved = (json.loads((folder / "config.json").read_text()) for folder in (tmp_path / "bf16", run / "final"))
    assert built["dtype"] == "bfloat16" and saved["dtype"] == "float32"
    shape = ("architectures", "model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "bos_token_id")
    assert {key: built.get(key) for key in shape} == {key: saved.get(key) for key in shape}
    assert (tmp_path / "bf16" / "generation_config.json").is_file()
    cast = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert cast.dtype == torch.bfloat16
    assert torch.equal(
        cast.transformer.h[0].mlp.c_fc.weight, final["transformer.h.0.mlp.c_fc.weight"].to(torch.bfloat16)
    )


def test_resumed_run_matches_an_uninterrupted_one_bit_for_bit(tmp_path, one_process):
    cut = train(tmp_path / "cut", "trainer.max_steps=20")
    resumed = run_cli(f"resume={cut}", "trainer.max_steps=30", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed at step 20" in (cut / "run.log").read_text()
    # The weights first: when the metrics differ, whether the weights do too says where to look.
    expected, got = (load_file(run / "model" / "model.safetensors") for run in (one_process, cut))
    assert expected.keys() == got.keys() and [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert metrics(cut) == metrics(one_process)  # eval loss and perplexity, the logged train loss, step
    assert (cut / "model" / "config.json").read_text() == (one_process / "model" / "config.json").read_text()


# ------------------------------------------------------------------------------------------- LoRA fine-tuning
LORA_PARALLEL = {
    "one_process": (),
    "ddp": ("trainer.num_processes=2", "parallel=ddp"),
    "fsdp": ("trainer.num_processes=2", "parallel=fsdp", "parallel.shard_modules=[GPT2Block]"),
}


def lora_args(base, *extra: str) -> list[str]:
    """experiment=shakespeare_hf_lora on ``base`` (a run of the tiny model), its adapters learning fast."""
    args = [arg for arg in hf_args() if not arg.startswith(("experiment=", "model.config."))]
    return [
        "experiment=shakespeare_hf_lora", *args, f"model.model.source={base}", "optimizer.lr=1e-2",
        *(f"model.model.model.config.{key}={value}" for key, value in TINY.items()), *extra,
    ]  # fmt: skip


def lora_train(folder, base, *extra: str):
    done = run_cli(*lora_args(base, *extra), f"hydra.run.dir={folder}", cwd=folder.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


def peft_model_of(lora_run, base_run):
    """The base run's model from_pretrained, with the LoRA run's adapters loaded by peft itself."""
    peft = pytest.importorskip("peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(base_run / "model")
    return peft.PeftModel.from_pretrained(base, lora_run / "model").eval()


@pytest.mark.parametrize("parallel", sorted(LORA_PARALLEL))
def test_lora_trains_only_its_adapters_and_resumes_bit_for_bit(tmp_path, one_process, parallel):
    pytest.importorskip("peft")
    extra = LORA_PARALLEL[parallel]
    whole = lora_train(tmp_path / "whole", one_process, "trainer.max_steps=30", *extra)
    cut = lora_train(tmp_path / "cut", one_process, "trainer.max_steps=20", *extra)
    resumed = run_cli(f"resume={cut}", "trainer.max_steps=30", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed at step 20" in (cut / "run.log").read_text()
    # 20 + 10 steps == 30: the adapters bit for bit, the metrics exactly
    expected, got = (load_file(run / "model" / "adapter_model.safetensors") for run in (whole, cut))
    assert expected.keys() == got.keys() and [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert metrics(cut) == metrics(whole)
    summary = metrics(whole)
    assert summary["step"] == 30 and summary["eval/loss"] < metrics(one_process)["eval/loss"], summary

    # The final model/ is PEFT's format: peft loads it on the base run's model, and gives the run's own eval
    assert sorted(p.name for p in (whole / "model").iterdir()) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors"
    ]  # fmt: skip
    model = peft_model_of(whole, one_process)
    inputs = eval_inputs()
    with torch.no_grad():
        outputs = model(input_ids=inputs, labels=inputs)
    assert outputs.loss.item() == pytest.approx(summary["eval/loss"], abs=1e-5)
    # Only the adapters trained: the base weights in the last checkpoint are the base run's, bit for bit
    from runner.engine.checkpoint.model_weights import read_model_weights

    state, _ = read_model_weights(whole)
    base = load_file(one_process / "model" / "model.safetensors")
    named = {key.removeprefix("base_model.model.").replace(".base_layer.", "."): key for key in state}
    adapters = sorted(key for key in state if ".lora_" in key)
    assert sorted(set(named) - set(base) - {"lm_head.weight"}) == sorted(
        key.removeprefix("base_model.model.") for key in adapters
    )  # every other name is a base weight
    assert [key for key in base if not torch.equal(state[named[key]], base[key])] == []
    r, layers, width = 8, TINY["n_layer"], TINY["n_embd"]
    per_layer = r * (width + 3 * width) + r * (width + width) + r * (4 * width + width)  # c_attn, attn/mlp c_proj
    assert sum(state[key].numel() for key in adapters) == layers * per_layer
    log = (whole / "run.log").read_text()
    assert f"LORA adapters on GPT2LMHeadModel: {layers * per_layer:,} of " in log
    if parallel != "one_process":
        return

    # runner export --merge-lora: the base model's own names, and the fine-tuned model's logits without peft
    merged_dir = tmp_path / "merged"
    assert export([str(whole), "--to", str(merged_dir), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert set(load_file(merged_dir / "model.safetensors")) == set(base)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=inputs[:16]).logits, outputs.logits[:16], rtol=0, atol=1e-5)
    # runner eval of the LoRA run: its model rebuilt (adapters on the base run's model), its final eval exactly
    evaluated = run_cli("eval", str(whole), cwd=tmp_path)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (record,) = [json.loads(path.read_text()) for path in whole.glob("eval-*.json")]
    assert {key: record[key] for key in summary if key != "train/loss" and key != "epoch"} == {
        key: summary[key] for key in summary if key != "train/loss" and key != "epoch"
    }
    # runner generate from the LoRA run: its adapters on the base model, the same text for a seed
    settings = {"prompt": "KING:", "max_new_tokens": 12, "temperature": 0.9, "top_k": 40}
    first = generate(str(whole), **settings, seed=3)
    assert first.startswith("KING:") and generate(str(whole), **settings, seed=3) == first
    assert generate(str(whole), **settings, seed=4) != first
    # the checkpoint holds every weight: eval and generate need not find the base run any more
    one_process.rename(one_process.with_name("moved"))
    try:
        assert generate(str(whole), **settings, seed=3) == first
    finally:
        one_process.with_name("moved").rename(one_process)


def test_a_lora_target_that_is_not_in_the_model_is_one_sentence_before_launch(one_process):
    pytest.importorskip("peft")
    from runner.config import ConfigError, register_configs
    from runner.config.check import check_overrides

    register_configs()
    overrides = lora_args(one_process, "model.config.target_modules=[c_atn,c_proj]")
    with pytest.raises(ConfigError) as refused:
        check_overrides(overrides)
    assert str(refused.value).endswith(
        "failed: The target module 'c_atn' is not in GPT2LMHeadModel (did you mean 'c_attn'?); set target_modules "
        "to names of its layers: c_attn, c_fc, c_proj, lm_head, wpe, wte."
    )


# ------------------------------------------------------------------------------------ the corpus streamed
@pytest.mark.parametrize("parallel, workers", [("one_process", 0), ("ddp", 0), ("one_process", 2), ("ddp", 2)])
def test_a_streamed_corpus_resumes_from_the_streams_state_bit_for_bit(tmp_path, parallel, workers):
    data = ()
    if workers:  # the corpus in two files, the stream's two shards: each loader worker reads one
        lines = (SHAKESPEARE / "input.txt").read_text().splitlines(keepends=True)
        for part, half in enumerate((lines[:20000], lines[20000:])):
            (tmp_path / f"part{part}.txt").write_text("".join(half))
        files = ",".join(str(tmp_path / f"part{part}.txt") for part in range(2))
        data = (f"data.num_workers={workers}", f"data.train.dataset.dataset.data_files=[{files}]")

    def stream_train(folder, *extra):
        args = [arg if arg != "experiment=shakespeare_hf" else "experiment=shakespeare_hf_stream" for arg in hf_args()]
        done = run_cli(*args, *LORA_PARALLEL[parallel], *data, *extra, f"hydra.run.dir={folder}", cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        return folder

    whole = stream_train(tmp_path / "whole", "trainer.max_steps=30")
    cut = stream_train(tmp_path / "cut", "trainer.max_steps=20")
    manifest = json.loads((cut / "checkpoints" / "checkpoint_0" / "manifest.json").read_text())
    position = manifest["dataloaders"][0]  # the train loader's (then the eval loader's)
    assert position["samples_seen"] == 20 * 16 * (2 if parallel == "ddp" else 1)
    if workers:  # each worker's Packed state, over its own shard
        states = [saved["stream_state"] for saved in position["worker_states"]["workers"]]
        assert len(states) == 2 and all(state["documents"] > 0 and state["source"] is not None for state in states)
    else:  # Packed's: the lines read, the bytes carried over, the HF stream's own state
        state = position["dataset_state"]
        assert state["documents"] > 0 and 0 < len(state["carry"]) and state["source"] is not None
    resumed = run_cli(f"resume={cut}", "trainer.max_steps=30", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (cut / "run.log").read_text()
    assert "Resumed at step 20" in log and "reading past" not in log
    expected, got = (load_file(run / "model" / "model.safetensors") for run in (whole, cut))
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert metrics(cut) == metrics(whole)


def test_export_of_a_handed_over_run_copies_no_link_and_builds_config_json_from_plain_values(
    tmp_path, one_process, capsys
):
    handed = tmp_path / "handed"
    shutil.copytree(one_process, handed, symlinks=True)
    signing_key = tmp_path / "signing.key"
    signing_key.write_text("0123456789abcdef")
    (handed / "model" / "config.json").unlink()
    (handed / "model" / "config.json").symlink_to(signing_key)
    assert export([str(handed), "--to", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"runner export: error: {handed / 'model' / 'config.json'} is a symbolic link (to {signing_key}); a run folder "
        "holds no links, so remove it or copy the run with links resolved (cp -rL).\n"
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["handed", "signing.key"]
    # unfinished (no model/ yet): config.json is built from the run's model.config node, and loads
    shutil.rmtree(handed / "model")
    assert export([str(handed), "--to", str(tmp_path / "built")]) == 0
    built = json.loads((tmp_path / "built" / "config.json").read_text())
    assert {key: built[key] for key in TINY} == TINY and built["architectures"] == ["GPT2LMHeadModel"]
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "built", output_loading_info=True)
    assert all(not keys for keys in info.values()), info
