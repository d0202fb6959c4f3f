"""``runner generate``'s command line: its settings, their refusals, and --help. (Text from real runs, GPT and
Hugging Face: tests/e2e/test_language_model.py, tests/e2e/test_hugging_face.py; a run that is not a language
model: tests/e2e/test_bad_input.py.)"""

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.cli.generate import SETTINGS, USAGE, GenerateError, _settings, _Stream, _utf8, _Writer, main


def test_settings_are_key_value_pairs_with_defaults_and_prompt_escapes():
    assert _settings([]) == (SETTINGS, False)
    settings, trusted = _settings(["prompt=ROMEO:\\n", "max_new_tokens=5", "temperature=0.5", "top_k=null", "seed=0",
                                   "trust_resume=true"])  # fmt: skip
    assert settings == {**SETTINGS, "prompt": "ROMEO:\n", "max_new_tokens": 5, "temperature": 0.5, "top_k": None}
    assert trusted and _settings(["top_k=40"])[0]["top_k"] == 40
    assert _settings(["prompt=café\\tau\\\\n\\n"])[0]["prompt"] == "café\tau\\n\n"  # only \n, \t, \\: not UTF-8 bytes


@pytest.mark.parametrize(
    ("pair", "sentence"),
    [
        ("temprature=1", "'temprature=1' is not a setting (did you mean temperature?); give key=value with a key of "
         "prompt, max_new_tokens, temperature, top_k, seed, device."),
        ("ROMEO", "'ROMEO' is not a setting; give key=value with a key of prompt, max_new_tokens, temperature, top_k, "
         "seed, device."),
        ("max_new_tokens=many", "max_new_tokens=many is not a number; give max_new_tokens=200."),
        ("max_new_tokens=0", "max_new_tokens=0 must be positive."),
        ("temperature=-1", "temperature=-1 must be positive."),
        ("top_k=abc", "top_k=abc is not a number; give top_k=50."),
        ("seed=-1", "seed=-1 must be 0 or more."),
    ],
)  # fmt: skip
def test_a_bad_setting_is_one_sentence(pair, sentence):
    with pytest.raises(GenerateError) as refused:
        _settings([pair])
    assert str(refused.value) == sentence


def test_help_and_a_missing_folder(capsys):
    assert main(["--help"]) == 0
    assert capsys.readouterr().out.startswith(USAGE + "\n\n``runner generate RUN")
    assert main([]) == 2 and main(["prompt=x"]) == 2
    assert capsys.readouterr().err == f"runner generate: error: give a run or checkpoint folder first; {USAGE}\n" * 2


def test_a_device_that_is_not_one_or_not_here_is_one_sentence():
    from runner.cli.generate import generate

    with pytest.raises(GenerateError, match=r"^device=tpu0 is not a device; give device=cpu or device=cuda\.$"):
        generate("unused", **{**SETTINGS, "device": "tpu0"})
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(GenerateError, match=r"^device=cuda: no GPU is visible to this process; give device=cpu\.$"):
            generate("unused", **{**SETTINGS, "device": "cuda"})


def _streamed(decode, steps: list[list[int] | None]) -> list[str]:
    """What each token of ``steps`` writes, then what the end writes, after a prompt of one token; a None in
    ``steps`` ends one generate() call there, and the next starts with a context of one token."""
    writer = _Writer(None)
    stream = _Stream(decode, writer)
    stream.put(torch.tensor([[7]]))  # the prompt: not written again
    written = []
    for tokens in [*steps, "end"]:
        before = len(writer.pieces)
        if tokens is None:
            stream.end()
            stream.put(torch.tensor([[7]]))  # the next call's context: not written either
        elif tokens == "end":
            stream.end()
            stream.close()
        else:
            stream.put(torch.tensor(tokens))
        written.append("".join(writer.pieces[before:]))
    return written


def test_a_character_spread_over_tokens_is_written_once_whole():
    # UTF-8 bytes as ids (no tokenizer): 'é' is two; an id past 255 is not a byte
    assert _streamed(_utf8, [[104], [195], [169], [300], [33]]) == ["h", "", "é", "", "\ufffd!", ""]
    assert _streamed(_utf8, [[195]]) == ["", "\ufffd"]  # the end writes what never finished
    # past the model's positions, one generate() call per token: 'é' split between two calls is written once, whole
    assert _streamed(_utf8, [[104], None, [195], None, [169], None, [33]]) == ["h", "", "", "", "é", "", "!", ""]
    # a byte-level BPE tokenizer (the tokenizers library's own), too small to have 'é' as one token
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["to be or not to be"] * 10, trainers.BpeTrainer(
        vocab_size=270, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe)
    ids = tokenizer("be café")["input_ids"]
    assert tokenizer.decode(ids[-1:]) == "\ufffd"  # decoded one by one, the last byte alone is not a character
    written = _streamed(tokenizer.decode, [[token] for token in ids])
    assert "".join(written) == "be café" and written[-2] == "é"


# ------------------------------------------------------------------------------------- runs crafted in the test
# A run as the recipes leave it: one checkpoint holding the config (and the vocabulary), and the final model/.
# Its weights are set so that the next token is always 'a', whatever the context: the text sampled is known.
GPT_NODE = {"_target_": "runner.models.GPT", "block_size": 8, "n_layer": 1, "n_head": 1, "n_embd": 8}
HF_NODE = {
    "_target_": "transformers.GPT2LMHeadModel",
    "config": {"_target_": "transformers.GPT2Config", "vocab_size": 256, "n_positions": 8, "n_embd": 8, "n_layer": 1,
               "n_head": 1, "bos_token_id": None, "eos_token_id": None},
}  # fmt: skip
CHARS = "\n :EGIKMNORabcdehilmostuw"


def always_a(model, *, final_norm, embedding, token_a: int):
    """``model`` with every weight 0 but its final norm's bias and token ``token_a``'s embedding, which its head
    shares: whatever it reads, token ``token_a``'s logit is 80 and every other 0."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        final_norm.bias.fill_(1.0)
        embedding.weight[token_a] = 10.0
    return model


def craft_run(folder: Path, *, cfg: dict, model, vocab=None) -> Path:
    from omegaconf import OmegaConf

    from runner.data.text import VOCAB_FILE
    from runner.engine import Accelerator, ProjectConfiguration
    from runner.engine.checkpoint.serialization import save_model_files

    def save_run_files(models, weights, output_dir) -> None:
        OmegaConf.save(OmegaConf.create(cfg), Path(output_dir) / "config.yaml")
        if vocab is not None:
            vocab.save(Path(output_dir) / VOCAB_FILE)

    accelerator = Accelerator(project_config=ProjectConfiguration(str(folder), automatic_checkpoint_naming=True))
    accelerator.register_save_state_pre_hook(save_run_files)
    accelerator.prepare(model)
    accelerator.save_state()
    save_model_files(model.state_dict(), folder / "model")
    if vocab is not None:
        vocab.save(folder / "model" / VOCAB_FILE)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hydra.utils import instantiate

    from runner.data.text import CharVocab
    from runner.models import GPT

    folder = tmp_path_factory.mktemp("runs")
    vocab = CharVocab(list(CHARS))
    gpt = GPT(len(vocab), **{key: value for key, value in GPT_NODE.items() if key != "_target_"})
    hf = instantiate(HF_NODE)
    return {
        "gpt": craft_run(folder / "gpt", cfg={"recipe": "language_model", "model": GPT_NODE}, vocab=vocab,
                         model=always_a(gpt, final_norm=gpt.ln_f, embedding=gpt.token_embedding,
                                        token_a=vocab.chars.index("a"))),
        "hf": craft_run(folder / "hf", cfg={"recipe": "supervised", "loss": "model", "model": HF_NODE},
                        model=always_a(hf, final_norm=hf.transformer.ln_f, embedding=hf.transformer.wte,
                                       token_a=ord("a"))),
    }  # fmt: skip


def copied(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / run.name))


def refused(capsys, argv: list[str]) -> str:
    """What ``runner generate argv`` says on stderr, once it exited with code 2 having written nothing else."""
    code = main(argv)
    captured = capsys.readouterr()
    assert (code, captured.out) == (2, "") and "Traceback" not in captured.err
    assert captured.err.startswith("runner generate: error: ") and captured.err.count("\n") == 1
    return captured.err.removeprefix("runner generate: error: ").removesuffix("\n")


@pytest.mark.parametrize("name", ["hf", "gpt"])
def test_any_number_of_new_tokens_past_the_models_eight_positions(runs, name, capsys):
    for prompt in ("KING:", "KING ROMEO:"):  # shorter than the model's 8 positions, and longer
        assert main([str(runs[name]), f"prompt={prompt}", "max_new_tokens=30"]) == 0
        assert capsys.readouterr().out == prompt + "a" * 30 + "\n"
    assert main([str(runs[name]), "prompt=KING:", "max_new_tokens=3", f"seed={2**64 - 1}"]) == 0  # the largest
    assert capsys.readouterr().out == "KING:aaa\n"


LARGEST = "give a seed from 0 to 18446744073709551615 (seed=0 by default)."


@pytest.mark.parametrize(
    ("setting", "sentence"),
    [
        ("temperature=nan", "temperature=nan is not a finite number; give temperature=0.8."),
        ("temperature=inf", "temperature=inf is not a finite number; give temperature=0.8."),
        ("temperature=-inf", "temperature=-inf is not a finite number; give temperature=0.8."),
        ("temperature=-0.5", "temperature=-0.5 must be positive."),
        ("seed=18446744073709551616", f"seed=18446744073709551616 is out of range; {LARGEST}"),
        ("seed=abc", f"seed=abc is not a number; {LARGEST}"),
        ("seed=-1", "seed=-1 must be 0 or more."),
        ("prompt=KING\udcff", "prompt='KING\\udcff' is not UTF-8 text (character 5); give the prompt in UTF-8."),
        ("device=meta", "device=meta holds no data, so no model runs on it; give device=cpu or device=cuda."),
        ("device=tpu0", "device=tpu0 is not a device; give device=cpu or device=cuda."),
    ],
)
def test_a_bad_setting_on_the_command_line_is_one_sentence_and_exit_code_2(runs, capsys, setting, sentence):
    assert refused(capsys, [str(runs["gpt"]), setting]) == sentence


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an Apple GPU")
def test_a_device_this_machine_lacks_is_one_sentence(runs, capsys):
    assert refused(capsys, [str(runs["gpt"]), "device=mps"]) == (
        "device=mps: this machine has no mps device; give device=cpu or device=cuda."
    )


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{", "it is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        (b'{"vocab": ["a"]}', 'it holds no "chars" list'),
        (b'["a", "b"]', 'it holds no "chars" list'),
        (b'{"chars": 5}', '"chars" is int, not a list'),
        (b'{"chars": "ab"}', '"chars" is str, not a list'),
        (b'{"chars": []}', '"chars" is empty'),
        (b'{"chars": ["a", "b", "a"]}', '"chars"[2] is \'a\' again (it is "chars"[0] too)'),
        (b'{"chars": ["a", "ab"]}', "\"chars\"[1] is 'ab', 2 characters, not one"),
        (b'{"chars": ["a", ""]}', "\"chars\"[1] is '', 0 characters, not one"),
        (b'{"chars": ["a", null]}', '"chars"[1] is NoneType, not a character'),
        (b'{"chars": ["a", ["b"]]}', '"chars"[1] is list, not a character'),
        (b'{"chars": ["\\ud800"]}', "\"chars\"[0] is '\\ud800', half of a UTF-16 surrogate pair, not a character"),
        (b'\xff\xfe{"chars": ["a"]}', "it is not UTF-8 text: invalid start byte at byte 0"),
        (b"[" * 100_000, "it is JSON nested deeper than the parser goes"),
    ],
)
def test_a_crafted_vocabulary_is_one_sentence_naming_it(runs, tmp_path, capsys, content, problem):
    run = copied(runs["gpt"], tmp_path)
    (run / "model" / "vocab.json").write_bytes(content)
    assert refused(capsys, [str(run)]) == (
        f"{run / 'model' / 'vocab.json'} is not a character vocabulary ({problem}); it is damaged, so use another "
        "checkpoint of the run."
    )


def _symbolic(path: Path, target: Path) -> str:
    return (
        f"{path} is a symbolic link (to {target}); a run folder holds no links, so remove it or copy the run with "
        "links resolved (cp -rL)."
    )


def _hard(path: Path) -> str:
    return (
        f"{path} is a hard link (its file has 2 names, any of them perhaps outside the run); a run folder holds only "
        "files of its own, so copy the run with cp -r, which writes each file anew, and point at the copy."
    )


@pytest.mark.parametrize(
    ("name", "inside", "kind"),
    [
        ("gpt", "model", "symbolic"),
        ("hf", "model", "symbolic"),
        ("gpt", "checkpoints/checkpoint_0", "symbolic"),
        ("gpt", "checkpoints", "symbolic"),
        ("gpt", "model/vocab.json", "symbolic"),
        ("hf", "model/model.safetensors", "symbolic"),
        ("gpt", "checkpoints/checkpoint_0/config.yaml", "symbolic"),
        ("gpt", "model/vocab.json", "hard"),
        ("gpt", "model/model.safetensors", "hard"),
        ("hf", "model/model.safetensors", "hard"),
        ("gpt", "checkpoints/checkpoint_0/config.yaml", "hard"),
        ("gpt", "checkpoints/checkpoint_0/model.safetensors", "hard"),
    ],
)
def test_a_link_in_the_run_is_one_sentence_naming_it(runs, tmp_path, capsys, name, inside, kind):
    run = copied(runs[name], tmp_path)
    if inside.endswith("model.safetensors") and inside.startswith("checkpoints"):
        shutil.rmtree(run / "model")  # an unfinished run: its weights are the checkpoint's
    path = run / inside
    elsewhere = tmp_path / "elsewhere"
    if kind == "symbolic":  # the same bytes, or folder, moved away and linked back
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
    else:  # another name for the run's own file, outside the run
        os.link(path, elsewhere)
    sentence = _symbolic(path, elsewhere) if kind == "symbolic" else _hard(path)
    assert refused(capsys, [str(run)]) == sentence
    if inside.startswith("checkpoints/checkpoint_0"):  # the checkpoint named, rather than its run
        assert refused(capsys, [str(run / "checkpoints" / "checkpoint_0")]) == sentence


@pytest.mark.parametrize(
    ("aliases", "problem"),
    [
        ('{"lm_head.weight": "gone"}', "maps 'lm_head.weight' to 'gone', a tensor the file does not hold"),
        ('{"ln_f.weight": "token_embedding.weight"}',
         "maps 'ln_f.weight', a tensor the file holds itself, to 'token_embedding.weight'"),
        ('{"lm_head.weight": 5}', "is not a JSON object of tensor names (name -> stored name)"),
        ('["lm_head.weight"]', "is not a JSON object of tensor names (name -> stored name)"),
        ("lm_head.weight", "is not a JSON object of tensor names (name -> stored name)"),
    ],
)  # fmt: skip
def test_aliases_that_name_no_tensor_of_the_file_are_one_sentence(runs, tmp_path, capsys, aliases, problem):
    run = copied(runs["gpt"], tmp_path)
    weights = run / "model" / "model.safetensors"
    save_file(load_file(weights), weights, metadata={"format": "pt", "aliases": aliases})
    assert refused(capsys, [str(run)]) == (
        f"{weights}: its aliases metadata {problem}; the file is damaged, so write it again or load a different one."
    )


def test_a_checkpoint_whose_config_or_weights_are_not_a_runs_is_one_sentence(runs, tmp_path, capsys):
    from tests.unit.engine.checkpoint.checkpoint_edits import rewrite_manifest

    run = copied(runs["gpt"], tmp_path)
    shutil.rmtree(run / "model")
    checkpoint = run / "checkpoints" / "checkpoint_0"
    (checkpoint / "model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{}garbage")  # its manifest made anew
    rewrite_manifest(checkpoint, relist=["model.safetensors"])
    assert refused(capsys, [str(run)]) == (
        f"{checkpoint} holds weights that cannot be read (SafetensorError: Error while deserializing header: invalid "
        "JSON in header: trailing characters at line 1 column 3); the checkpoint is damaged, so load a different one."
    )
    (checkpoint / "config.yaml").write_text("recipe: language_model\nmodel: 5\n")
    rewrite_manifest(checkpoint, relist=["config.yaml"])
    assert refused(capsys, [str(run)]) == (
        f"{checkpoint / 'config.yaml'} is not a run's config (a mapping with a recipe and a model node); the "
        "checkpoint is damaged, so point at another one."
    )
