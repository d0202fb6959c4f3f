"""``runner export``: a checkpoint's model as plain safetensors (here from one process's checkpoints; FSDP's DCP
shards from 2 processes and a transformers model's config.json: tests/e2e/test_hugging_face.py), and every bad
input as one sentence with exit code 2 that writes nothing."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from runner.cli.export import HF_FILES, ExportError, _transformers_class, main
from runner.cli.export_files import _host, _read_own_files
from runner.engine import Accelerator, ProjectConfiguration
from runner.engine.checkpoint.serialization import load_safetensors
from runner.folders.provenance import sign
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


def refused(argv: list[str], capsys) -> str:
    """The one line ``runner export`` printed for a refusal with exit code 2, without its prefix."""
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith("runner export: error: "), captured.err
    return captured.err.removeprefix("runner export: error: ").removesuffix("\n")


def test_a_link_in_the_run_is_refused_and_nothing_is_copied(run, tmp_path, capsys):
    folder, _ = run
    secret, other_secret = tmp_path / "signing.key", tmp_path / "id_ed25519"
    secret.write_text("my key")
    other_secret.write_text("my other key")
    model = folder / "model"
    model.mkdir()
    (model / "config.json").symlink_to(secret)
    out = tmp_path / "out"
    assert refused([str(folder), "--to", str(out)], capsys) == (
        f"{model / 'config.json'} is a symbolic link (to {secret}); a run folder holds no links, so remove it or copy "
        "the run with links resolved (cp -rL)."
    )
    (model / "config.json").unlink()
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    os.link(other_secret, model / "generation_config.json")
    assert refused([str(folder), "--to", str(out)], capsys) == (
        f"{model / 'generation_config.json'} is a hard link (its file has 2 names, any of them perhaps outside the "
        "run); a run folder holds only files of its own, so copy the run with cp -r, which writes each file anew, and "
        "export the copy."
    )
    model.rename(tmp_path / "elsewhere")
    model.symlink_to(tmp_path / "elsewhere")  # model/ itself a link
    assert refused([str(folder), "--to", str(out)], capsys).startswith(f"{model} is a symbolic link (to ")
    model.unlink()
    checkpoint = folder / "checkpoints" / "checkpoint_1"
    (checkpoint / "notes.txt").symlink_to(secret)  # not listed in the manifest: still a link in the checkpoint
    assert refused([str(checkpoint), "--to", str(out)], capsys).startswith(f"{checkpoint / 'notes.txt'} is a symbolic")
    (checkpoint / "notes.txt").unlink()
    os.link(checkpoint / "model.safetensors", tmp_path / "same_file")
    assert refused([str(folder), "--to", str(out)], capsys).startswith(
        f"{checkpoint / 'model.safetensors'} is a hard link (its file has 2 names"
    )
    (tmp_path / "same_file").unlink()
    (tmp_path / "linked_run").mkdir()
    (tmp_path / "linked_run" / "checkpoints").symlink_to(folder / "checkpoints")
    assert refused([str(tmp_path / "linked_run"), "--to", str(out)], capsys).startswith(
        f"{tmp_path / 'linked_run' / 'checkpoints'} is a symbolic link (to {folder / 'checkpoints'})"
    )
    assert not out.exists() and list(tmp_path.glob(".out.partial-*")) == []
    assert main([str(folder), "--to", str(out)]) == 0  # the same run, without links
    assert secret.read_text() == "my key" and other_secret.read_text() == "my other key"


def test_a_file_swapped_for_a_link_after_the_check_is_refused_when_it_is_opened(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").symlink_to(tmp_path / "secret")
    (tmp_path / "secret").write_text("key")
    with pytest.raises(ExportError) as error:
        _read_own_files(tmp_path / "model", HF_FILES)
    assert str(error.value).startswith(f"{tmp_path / 'model' / 'config.json'} is a symbolic link (to ")
    (tmp_path / "model" / "config.json").unlink()
    os.mkfifo(tmp_path / "model" / "config.json")  # a pipe: refused, without waiting for a writer
    with pytest.raises(ExportError) as error:
        _read_own_files(tmp_path / "model", HF_FILES)
    assert str(error.value) == (
        f"{tmp_path / 'model' / 'config.json'} is not a regular file; the run folder is damaged, so export another run."
    )
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.json").write_text("{}")
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ExportError) as error:
        _read_own_files(tmp_path / "linked", HF_FILES)
    assert str(error.value).startswith(f"{tmp_path / 'linked'} is a symbolic link (to {tmp_path / 'elsewhere'})")
    assert _read_own_files(tmp_path / "elsewhere", HF_FILES) == {"config.json": b"{}"}


GPT2_CONFIG = """
data: {width: 8, token: "${oc.env:HF_TOKEN}"}
model:
  _target_: transformers.GPT2LMHeadModel
  size: 8
  config:
    _target_: transformers.GPT2Config
    vocab_size: 16
    n_positions: "${oc.select:data.positions,8}"
    n_embd: "${data.width}"
    n_layer: 1
    n_head: 2
    name_or_path: "tiny-${data.width}"
"""


def test_config_json_is_built_from_plain_values_and_never_from_the_environment(run, tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from omegaconf import OmegaConf

    folder, _ = run
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    config_file = folder / "checkpoints" / "checkpoint_1" / "config.yaml"
    config_file.write_text(GPT2_CONFIG)
    # references to other keys and oc.select resolve; data.token, which nothing here reaches, is not read
    assert main([str(folder), "--to", str(tmp_path / "built")]) == 0
    built = json.loads((tmp_path / "built" / "config.json").read_text())
    assert (built["n_embd"], built["n_positions"], built["architectures"]) == (8, 8, ["GPT2LMHeadModel"])
    assert (tmp_path / "built" / "generation_config.json").is_file()
    capsys.readouterr()
    advice = (
        "which export never resolves (the config.json it writes is meant to be shared, and would carry this "
        "machine's environment or files); export the run once it has finished (its model/config.json is copied as "
        "is), or give {} a plain value."
    )
    cases = [
        ("model.config.token_id", "${oc.env:HF_TOKEN}", "model.config.token_id uses the resolver oc.env"),
        ("model.config.n_embd", "${data.token}", "data.token uses the resolver oc.env"),  # through a reference
        ("model.config.n_embd", "${..size}", None),  # relative: model.size, plain
        ("model.size", "${oc.env:HF_TOKEN}", "model.size uses the resolver oc.env"),  # reached by ${..size}
        ("model.config.cwd", "${hydra:runtime.cwd}", "model.config.cwd uses the resolver hydra"),
        ("model.config.n_head", "${oc.select:data.heads,${oc.env:HF_TOKEN}}", "model.config.n_head uses the resolver "
         "oc.env"),  # a default that reads the environment
        ("model.config.n_layer", "${data.${data.width}}", "model.config.n_layer is ${data.${data.width}}, not a "
         "reference export resolves"),
    ]  # fmt: skip
    config = OmegaConf.create(GPT2_CONFIG)
    for key, value, problem in cases:
        OmegaConf.update(config, key, value)
        config_file.write_text(OmegaConf.to_yaml(config))
        if problem is None:
            continue
        culprit = problem.split(" ")[0]  # the key whose value reads the environment
        expected = f"{config_file}: {problem}, {advice.format(culprit)}"
        assert refused([str(folder), "--to", str(tmp_path / "out")], capsys) == expected
        OmegaConf.update(config, key, 8)
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out.partial-*")) == []
    OmegaConf.update(config, "model.config.n_embd", "${data.missing}")
    config_file.write_text(OmegaConf.to_yaml(config))
    assert refused([str(folder), "--to", str(tmp_path / "out")], capsys) == (
        f"{config_file}: data.missing is not in the config, though a value that export resolves refers to it; the "
        "checkpoint's config is damaged, so export another checkpoint."
    )


def test_to_inside_the_runs_checkpoints_or_model_folder_is_refused(run, tmp_path, capsys):
    folder, _ = run
    checkpoints = folder / "checkpoints"
    advice = "export outside the run's checkpoints folder, beside the run say."
    assert refused([str(folder), "--to", str(checkpoints / "checkpoint_5")], capsys) == (
        f"--to {checkpoints / 'checkpoint_5'} is inside the run's checkpoints folder {checkpoints}; {advice}"
    )
    (folder / "model").mkdir()
    assert refused([str(checkpoints / "checkpoint_0"), "--to", str(folder / "model" / "export")], capsys) == (
        f"--to {folder / 'model' / 'export'} is inside the run's model folder {folder / 'model'}; export outside the "
        "run's model folder, beside the run say."
    )
    (tmp_path / "into_checkpoints").symlink_to(checkpoints)  # the same folder by another path
    assert refused([str(folder), "--to", str(tmp_path / "into_checkpoints" / "new")], capsys).startswith(
        f"--to {tmp_path / 'into_checkpoints' / 'new'} is inside the run's checkpoints folder {checkpoints}; "
    )
    state = tmp_path / "state"  # a folder save_state wrote, outside any run: the checkpoint itself is protected
    shutil.copytree(checkpoints / "checkpoint_0", state)
    assert refused([str(state), "--to", str(state / "export")], capsys) == (
        f"--to {state / 'export'} is inside the checkpoint being exported {state}; export outside the checkpoint "
        "being exported, beside the run say."
    )
    assert sorted(path.name for path in checkpoints.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert list((folder / "model").iterdir()) == [] and sorted(path.name for path in state.iterdir()) == sorted(
        path.name for path in (checkpoints / "checkpoint_0").iterdir()
    )


def test_staging_folders_are_fresh_removed_on_failure_and_left_by_killed_exports_removed(run, tmp_path, capsys):
    folder, _ = run
    host = _host()  # this machine's name, as staging folders spell it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    token = "0123456789abcdef"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    planted = {
        f".out.partial-{os.getpid()}": "link",  # the name an earlier version used: a link to a folder of yours
        f".old.partial-{host}-{dead.pid}-{token}": "abandoned",  # its export was killed: removed
        f".gone.partial-{host}-{dead.pid}-{token}": "link",  # a link of that name: left, never followed
        f".busy.partial-{host}-{os.getpid()}-{token}": "folder",  # a live export's
        f".far.partial-{host}x-{dead.pid}-{token}": "folder",  # another machine's, on a shared disk
        f".odd.partial-{host}-{dead.pid}-{token}x": "folder",  # not a staging folder's name
    }
    for name, kind in planted.items():
        if kind == "link":
            (tmp_path / name).symlink_to(elsewhere)
        else:
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors").write_bytes(b"partial")
    # a failure after the weights were staged (config.json is not JSON, so --dtype cannot set its dtype)
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("not json")
    assert refused([str(folder), "--to", str(tmp_path / "out"), "--dtype", "bf16"], capsys) == (
        f"{folder / 'model' / 'config.json'} is not a JSON object; the run's model folder is damaged, so export "
        "without --dtype or write a valid config.json there."
    )
    left = {name for name, kind in planted.items() if kind != "abandoned"}
    assert {path.name for path in tmp_path.glob(".*")} == left and not (tmp_path / "out").exists()
    assert [path.name for path in elsewhere.iterdir()] == ["keep.txt"]
    (tmp_path / "out").mkdir()  # an empty folder: the rename replaces it
    assert main([str(folder), "--to", str(tmp_path / "out")]) == 0
    assert {path.name for path in tmp_path.glob(".*")} == left
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "config.json", "model.safetensors", "model.safetensors.index.json"
    ]  # fmt: skip


# A real export whose process pauses once the weights are in its staging folder, for the test to signal it there.
PAUSED_EXPORT = """
import sys, time
from runner.cli.export import main
from runner.engine.checkpoint import serialization

save_model_files = serialization.save_model_files

def save_then_pause(*args, **kwargs):
    written = save_model_files(*args, **kwargs)
    print("staged", flush=True)
    time.sleep(120)
    return written

serialization.save_model_files = save_then_pause
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_an_export_stopped_while_staging_leaves_nothing_behind(run, tmp_path, capsys, stop):
    folder, _ = run
    out = tmp_path / "out"
    export = subprocess.Popen(
        [sys.executable, "-c", PAUSED_EXPORT, str(folder), "--to", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert select.select([export.stdout], [], [], 120)[0], "the export did not reach its staging folder"
        assert export.stdout.readline() == "staged\n", export.communicate()
        (staging,) = tmp_path.glob(".out.partial-*")
        assert (staging / "model.safetensors").is_file()
        export.send_signal(stop)
        stdout, stderr = export.communicate(timeout=60)
    finally:
        export.kill()
    if stop == signal.SIGKILL:  # nothing could clean up: the next export into the same folder does
        assert export.returncode == -signal.SIGKILL and staging.is_dir()
        assert main([str(folder), "--to", str(tmp_path / "next")]) == 0
    else:
        assert export.returncode == 128 + stop and stdout == ""
        assert stderr == f"runner export: error: export stopped by {stop.name}; nothing was written to {out}.\n"
    assert not staging.exists() and not out.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == (["next", "run"] if stop == signal.SIGKILL else ["run"])


def test_merge_lora_of_a_target_that_does_not_import_or_reads_the_environment_is_one_sentence(run, tmp_path, capsys):
    folder, _ = run
    config_file = folder / "checkpoints" / "checkpoint_1" / "config.yaml"
    config_file.write_text(
        "model:\n  _target_: runner.models.with_peft\n  model: {_target_: tiny_models_nowhere.TiedModel}\n"
        "  config: {_target_: peft.LoraConfig, r: 2, target_modules: [head]}\n"
    )
    argv = [str(folder), "--to", str(tmp_path / "merged"), "--merge-lora", "--trust-resume"]
    assert refused(argv, capsys) == (
        "--merge-lora: model.model names tiny_models_nowhere.TiedModel, which does not import here (No module named "
        "'tiny_models_nowhere'); install the package that provides it, then export again."
    )
    config_file.write_text(
        "model:\n  _target_: runner.models.with_peft\n  model: {_target_: torch.nn.Linear, in_features: 8, "
        "out_features: '${oc.env:HOME}'}\n  config: {_target_: peft.LoraConfig, r: 2}\n"
    )
    sign(config_file.parent)  # your own run: the resume rules accept it as it is, and export still refuses
    assert refused(argv[:-1], capsys) == (
        f"{config_file}: model.model.out_features uses the resolver oc.env, which export never resolves (the "
        "config.json it writes is meant to be shared, and would carry this machine's environment or files); give "
        "model.model.out_features a plain value in the run's config."
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]
