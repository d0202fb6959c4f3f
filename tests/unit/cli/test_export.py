"""``runner export``: a checkpoint's model as plain safetensors (here from one process's checkpoints; FSDP's DCP
shards from 2 processes and a transformers model's config.json: tests/e2e/test_hugging_face.py), and every bad
input as one sentence with exit code 2 that writes nothing."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from runner.cli.export import _transformers_class, main
from runner.engine import Accelerator, ProjectConfiguration
from runner.engine.checkpoint.serialization import load_safetensors
from tests.e2e.conftest import REPO


class TiedModel(nn.Module):
    """An embedding and a head that share one weight, as a language model's."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.tensor(7))


@pytest.fixture
def run(tmp_path):
    """A run folder with two checkpoints of a model with tied weights; returns it and the second's weights."""
    torch.manual_seed(0)
    accelerator = Accelerator(
        project_config=ProjectConfiguration(str(tmp_path / "run"), automatic_checkpoint_naming=True)
    )
    model = accelerator.prepare(TiedModel())
    accelerator.save_state(metadata={"step": 5})
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    accelerator.save_state(metadata={"step": 10})
    return tmp_path / "run", {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_export_writes_the_newest_checkpoints_model_its_tied_weights_once_and_casts_on_request(run, tmp_path, capsys):
    folder, weights = run
    assert main([str(folder), "--to", str(tmp_path / "out")]) == 0
    checkpoint = folder / "checkpoints" / "checkpoint_1"
    assert capsys.readouterr().out == (
        f"Exported {checkpoint} (step 10) to {tmp_path / 'out'}: model.safetensors, model.safetensors.index.json "
        f"(5 tensors, float32/int64, {sum(f.stat().st_size for f in (tmp_path / 'out').iterdir()) / 1e3:.1f} kB).\n"
    )
    exported = load_safetensors(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == weights.keys() and all(torch.equal(exported[k], weights[k]) for k in weights)
    plain = load_file(tmp_path / "out" / "model.safetensors")  # plain safetensors: the tied head once
    assert sorted(plain) == ["embed.weight", "norm.bias", "norm.weight", "steps"]
    model = TiedModel()
    assert model.load_state_dict(plain, strict=False).missing_keys == ["head.weight"]
    assert torch.equal(model.head.weight, weights["embed.weight"])  # tied: loading one loads both

    assert main([str(checkpoint.parent / "checkpoint_0"), "--to", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    cast = load_safetensors(tmp_path / "bf16" / "model.safetensors")
    assert cast["norm.weight"].dtype == torch.bfloat16 and cast["steps"].dtype == torch.int64
    assert torch.equal(cast["norm.weight"], torch.ones(8, dtype=torch.bfloat16))  # checkpoint_0: before the add
    assert "(step 5)" in capsys.readouterr().out


def test_export_shards_past_the_size_given(run, tmp_path):
    folder, weights = run
    assert main([str(folder), "--to", str(tmp_path / "shards"), "--max-shard-size", "300B"]) == 0
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((tmp_path / "shards" / name).is_file() for name in files)
    loaded = {}
    for name in files:
        loaded.update(load_file(tmp_path / "shards" / name))
    assert all(torch.equal(loaded[k], weights[k]) for k in loaded) and "embed.weight" in loaded


def test_every_bad_input_is_one_sentence_exit_code_2_and_writes_nothing(run, tmp_path, capsys):
    folder, _ = run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty").mkdir()
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "checkpoints").mkdir()
    for name in ("checkpoint_0", "checkpoint_1"):
        (folder / "checkpoints" / name).rename(damaged / "checkpoints" / name)
        weights = damaged / "checkpoints" / name / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    out = str(tmp_path / "out")
    cases = [
        ([str(tmp_path / "missing"), "--to", out], f"{tmp_path / 'missing'} does not exist; pass a run folder or a "
         "checkpoint folder (checkpoints/checkpoint_N)."),
        ([str(tmp_path / "a_file"), "--to", out], f"{tmp_path / 'a_file'} is a file; pass a run folder or a "
         "checkpoint folder (checkpoints/checkpoint_N)."),
        ([str(tmp_path / "empty"), "--to", out], f"{tmp_path / 'empty'} is neither a checkpoint (it has no "
         "manifest.json) nor a run folder (it has no checkpoints/ folder); pass one of those."),
        ([str(damaged), "--to", out], f"{damaged} has no intact checkpoint in {damaged / 'checkpoints'}; point at a "
         "run or checkpoint that has one."),
        ([str(damaged / "checkpoints" / "checkpoint_0"), "--to", out], "model.safetensors does not match its "
         "xxh3_128 digest in the manifest"),
        ([str(damaged), "--to", str(tmp_path / "full")], f"--to {tmp_path / 'full'} already holds files; give a new "
         "or empty folder (nothing was written)."),
        ([str(damaged), "--to", str(tmp_path / "a_file")], f"--to {tmp_path / 'a_file'} is a file; give a new or "
         "empty folder."),
        ([str(damaged), "--to", str(tmp_path / "no" / "such")], f"--to {tmp_path / 'no' / 'such'}: its parent folder "
         f"{tmp_path / 'no'} does not exist; create it first."),
        ([str(damaged), "--to", out, "--max-shard-size", "big"], "--max-shard-size big is not a size; write it like "
         "10GB, 500MiB or 1000000."),
    ]  # fmt: skip
    for argv, sentence in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.err.startswith("runner export: error: ") and sentence in captured.err, captured.err
        assert captured.err.count("\n") == 1 and captured.out == ""
    with pytest.raises(SystemExit) as stop:
        main([str(damaged), "--to", out, "--dtype", "fp8"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        "runner export: error: argument --dtype: invalid choice: 'fp8' (choose from 'bf16', 'fp16', 'fp32'); see "
        "runner export --help.\n"
    )
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine" and sorted(tmp_path.glob("*out*")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "damaged", "empty", "full", "run"]


def test_a_checkpoint_of_two_models_exports_the_one_asked_for(tmp_path, capsys):
    accelerator = Accelerator(project_dir=tmp_path / "run")
    first, second = accelerator.prepare(nn.Linear(2, 2), nn.Linear(3, 1))
    accelerator.save_state(tmp_path / "state")
    assert main([str(tmp_path / "state"), "--to", str(tmp_path / "second"), "--model", "1"]) == 0
    exported = load_file(tmp_path / "second" / "model.safetensors")
    assert torch.equal(exported["weight"], second.weight.detach()) and exported["weight"].shape == (1, 3)
    assert main([str(tmp_path / "state"), "--to", str(tmp_path / "third"), "--model", "2"]) == 2
    expected = f"--model 2: {tmp_path / 'state'} holds 2 models, so there is no model 2; give 0 to 1.\n"
    assert capsys.readouterr().err.endswith(expected)
    # in a run whose final model/ has a transformers config.json: that file describes model 0 only
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint_0"
    shutil.copytree(tmp_path / "state", checkpoint)
    (tmp_path / "run" / "model").mkdir()
    (tmp_path / "run" / "model" / "config.json").write_text('{"model_type": "gpt2"}')
    weights = ["model.safetensors", "model.safetensors.index.json"]
    for index, files in [("0", ["config.json", *weights]), ("1", weights)]:
        assert main([str(checkpoint), "--to", str(tmp_path / f"model_{index}"), "--model", index]) == 0
        assert sorted(path.name for path in (tmp_path / f"model_{index}").iterdir()) == files


def test_only_a_transformers_class_named_by_its_top_level_name_is_ever_built():
    transformers = pytest.importorskip("transformers")
    assert _transformers_class("transformers.GPT2Config") is transformers.GPT2Config
    for target in ("transformers.pipeline", "builtins.eval", "os.system", "transformers.models.gpt2.GPT2Config",
                   "transformers.AutoModelForCausalLM.from_pretrained", None, 3):  # fmt: skip
        assert _transformers_class(target) is None, target


def test_runner_export_and_eval_are_commands_of_their_own():
    done = subprocess.run(
        [sys.executable, "-m", "runner", "export", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: runner export [-h] --to TO")
    assert "--dtype {bf16,fp16,fp32}" in done.stdout
    done = subprocess.run(
        [sys.executable, "-m", "runner", "eval", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: runner eval RUN_OR_CHECKPOINT [key=value ...]")
    assert "``runner eval FOLDER [overrides]`` as the command it stands for" in done.stdout
