"""``runner generate``'s command line: its settings, their refusals, and --help. (Text from real runs, GPT and
Hugging Face: tests/e2e/test_language_model.py, tests/e2e/test_hugging_face.py; a run that is not a language
model: tests/e2e/test_bad_input.py.)"""

import pytest
import torch

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


def _streamed(decode, steps: list[list[int]]) -> list[str]:
    """What each token of ``steps`` writes, then what the end writes, after a prompt of one token."""
    writer = _Writer(None)
    stream = _Stream(decode, writer)
    stream.put(torch.tensor([[7]]))  # the prompt: not written again
    written = []
    for tokens in [*steps, None]:
        before = len(writer.pieces)
        stream.put(torch.tensor(tokens)) if tokens is not None else stream.end()
        written.append("".join(writer.pieces[before:]))
    return written


def test_a_character_spread_over_tokens_is_written_once_whole():
    # UTF-8 bytes as ids (no tokenizer): 'é' is two; an id past 255 is not a byte
    assert _streamed(_utf8, [[104], [195], [169], [300], [33]]) == ["h", "", "é", "", "\ufffd!", ""]
    assert _streamed(_utf8, [[195]]) == ["", "\ufffd"]  # the end writes what never finished
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
