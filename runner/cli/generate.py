"""``runner generate RUN [prompt=...] [max_new_tokens=200] [temperature=0.8] [top_k=null] [seed=0]``: text from a
language-model run, streamed to the terminal as it is sampled.

RUN is a run folder (its final ``model/``, or while it has none its newest intact checkpoint) or one
checkpoint folder. The model is rebuilt from the run's own config, on this one process and the CPU (or
``device=cuda``), then takes the weights: so the same trust rules as ``resume=`` hold (a run you did not
write may name only the code your configs name, unless ``trust_resume=true``). Both language-model recipes:
``recipe=language_model`` (``runner.models.GPT``, its characters from ``vocab.json``) and a Hugging Face causal
LM under the supervised recipe (its ``generate()``; its tokenizer where the data declares one, else UTF-8
bytes, as ``runner.data.causal_lm_blocks`` reads the text). The same seed gives the same text. Any
``max_new_tokens`` works: the model reads the last tokens that fit its positions (GPT's ``block_size``, a
transformers config's ``max_position_embeddings``/``n_positions``/``n_ctx``), as nanoGPT's sampling does.

The run folder is data from whoever wrote it: a link in it, or a file read here that has other names (a hard
link), is refused, and so is a ``vocab.json``, a config or weights that are not what a run writes; each in one
sentence and exit code 2, as a setting out of range is.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

USAGE_ERROR = 2
SETTINGS = {"prompt": "\n", "max_new_tokens": 200, "temperature": 0.8, "top_k": None, "seed": 0, "device": "cpu"}
MAX_SEED = 2**64 - 1  # torch.manual_seed's largest
_EXAMPLES = {
    "max_new_tokens": "max_new_tokens=200",
    "temperature": "temperature=0.8",
    "top_k": "top_k=50",
    "seed": f"a seed from 0 to {MAX_SEED} (seed=0 by default)",
}
USAGE = (
    "usage: runner generate RUN_OR_CHECKPOINT [prompt=TEXT] [max_new_tokens=200] [temperature=0.8] [top_k=null] "
    "[seed=0] [device=cpu] [trust_resume=true]"
)


_WRAPPERS = ("runner.models.with_peft", "runner.models.from_run")


class GenerateError(Exception):
    """One sentence: what is wrong with the command line or the run, and what to do."""


def main(argv: list[str]) -> int:
    """``runner generate``; returns its exit code."""
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    if not argv or ("=" in argv[0] and not os.path.isdir(argv[0])):  # a sweep job's folder may be named lr=0.1
        print(f"runner generate: error: give a run or checkpoint folder first; {USAGE}", file=sys.stderr)
        return USAGE_ERROR
    try:
        settings, trusted = _settings(argv[1:])
        generate(argv[0], **settings, trust=trusted, out=sys.stdout)
    except GenerateError as error:
        print(f"runner generate: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    return 0


def _settings(pairs: list[str]) -> tuple[dict[str, Any], bool]:
    settings, trusted = dict(SETTINGS), False
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if key == "trust_resume" and equals:
            trusted = value.lower() == "true"
            continue
        if key not in SETTINGS or not equals:
            close = difflib.get_close_matches(key, SETTINGS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise GenerateError(f"{pair!r} is not a setting{hint}; give key=value with a key of {', '.join(SETTINGS)}.")
        settings[key] = _value(key, value)
    return settings, trusted


def _value(key: str, value: str) -> Any:
    if key == "prompt":  # \n, \t and \\ as typed in a shell: prompt="ROMEO:\n" ends with a newline
        return _prompt(value)
    if key == "device":
        return value
    if key == "top_k" and value.lower() in ("null", "none", ""):
        return None
    kind = float if key == "temperature" else int
    try:
        number = kind(value)
    except ValueError:
        raise GenerateError(f"{key}={value} is not a number; give {_EXAMPLES[key]}.") from None
    if key == "seed" and number < 0:
        raise GenerateError(f"seed={value} must be 0 or more.")
    if key == "seed" and number > MAX_SEED:
        raise GenerateError(f"seed={value} is out of range; give {_EXAMPLES['seed']}.")
    if key == "temperature" and not math.isfinite(number):
        raise GenerateError(f"temperature={value} is not a finite number; give {_EXAMPLES['temperature']}.")
    if key != "seed" and number <= 0:
        raise GenerateError(f"{key}={value} must be positive.")
    return number


def _prompt(value: str) -> str:
    prompt = re.sub(r"\\([nt\\])", lambda match: {"n": "\n", "t": "\t", "\\": "\\"}[match.group(1)], value)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:  # bytes of the command line that are not UTF-8 arrive as lone surrogates
        raise GenerateError(
            f"prompt={prompt!r} is not UTF-8 text (character {error.start + 1}); give the prompt in UTF-8."
        ) from None
    return prompt


def generate(
    folder: str,
    *,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    device: str = "cpu",
    trust: bool = False,
    out=None,
) -> str:
    """Sample ``max_new_tokens`` after ``prompt`` from the run ``folder`` names, writing each piece to ``out`` as it
    comes; returns the prompt and the text sampled.

    Raises:
        GenerateError: One sentence: the folder, a setting, or a prompt the model cannot read.
    """
    import torch
    from omegaconf import DictConfig, OmegaConf

    from runner.config import ConfigError
    from runner.data.download import DataFileError
    from runner.engine.checkpoint.errors import CheckpointError

    _check_device(device)
    try:
        cfg, weights = _run(folder, trust=trust)
    except (CheckpointError, ConfigError) as error:
        raise GenerateError(str(error)) from None
    base = cfg.model
    while OmegaConf.select(base, "_target_") in _WRAPPERS and isinstance(base.get("model"), DictConfig):
        base = base.model  # adapters on it, or weights from another run
    hugging_face = str(base.get("_target_", "")).startswith("transformers.") and cfg.get("loss") == "model"
    if cfg.recipe != "language_model" and not hugging_face:
        raise GenerateError(
            f"{folder} is not a language model run (recipe={cfg.recipe}, model {cfg.model.get('_target_')}); "
            "generate needs recipe=language_model or a transformers causal LM (loss: model)."
        )
    writer = _Writer(out)
    try:
        if cfg.recipe == "language_model":
            generator = torch.Generator().manual_seed(seed)
            _generate_gpt(cfg, weights, prompt, max_new_tokens, temperature, top_k, generator, device, writer)
        else:
            _generate_hugging_face(cfg, weights, prompt, max_new_tokens, temperature, top_k, seed, device, writer)
    except (CheckpointError, ConfigError, DataFileError) as error:  # the files, or the model node the config declares
        raise GenerateError(str(error)) from None
    writer.write("\n")
    return writer.text


def _check_device(device: str) -> None:
    """A device this process has and a model can run on: the CPU, a visible GPU, or another accelerator here."""
    import torch

    try:
        torch_device = torch.device(device)
    except RuntimeError:
        raise GenerateError(f"device={device} is not a device; give device=cpu or device=cuda.") from None
    kind = torch_device.type
    if kind == "meta":
        raise GenerateError(f"device={device} holds no data, so no model runs on it; give device=cpu or device=cuda.")
    if kind == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"device={device}: no GPU is visible to this process; give device=cpu.")
    if kind == "cuda" and (torch_device.index or 0) >= torch.cuda.device_count():
        raise GenerateError(
            f"device={device}: this process sees {torch.cuda.device_count()} GPU(s), numbered from 0; give "
            "device=cuda or device=cuda:0."
        )
    backend = getattr(torch.backends, kind, None) if kind == "mps" else getattr(torch, kind, None)
    if kind not in ("cpu", "cuda") and not getattr(backend, "is_available", lambda: False)():
        raise GenerateError(f"device={device}: this machine has no {kind} device; give device=cpu or device=cuda.")


def _run(folder: str, *, trust: bool):
    """The run's config (trust-checked, as resume checks it) and the folder of the weights to load, once no link is
    found in the run (see :func:`runner.folders.layout.check_no_links`) or among the checkpoint's files read here."""
    from runner.cli.run_folder import resumed_run_folder
    from runner.engine.checkpoint.model_weights import check_not_linked, find_checkpoint
    from runner.engine.constants import MANIFEST_NAME
    from runner.folders.layout import CONFIG_FILE, MODEL_DIR, OVERRIDES_FILE, check_no_links
    from runner.folders.provenance import SIGNATURE_FILE, check_resumable

    path = Path(folder).expanduser().absolute()
    check_no_links(resumed_run_folder(folder))
    checkpoint, _ = find_checkpoint(path)
    if not (checkpoint / CONFIG_FILE).is_file():
        raise GenerateError(f"{checkpoint} has no {CONFIG_FILE}, so it was not written by `python -m runner`.")
    for name in (MANIFEST_NAME, CONFIG_FILE, OVERRIDES_FILE, SIGNATURE_FILE):
        check_not_linked(checkpoint / name)
    check_resumable(
        checkpoint, path=folder, overrides=["trust_resume=true"] if trust else [], search_path=[], command="generate"
    )
    final = path / MODEL_DIR
    return _run_config(checkpoint / CONFIG_FILE), final if (final / "model.safetensors").is_file() else checkpoint


def _run_config(path: Path):
    """The run's saved config, if it is one: a mapping that names a recipe and a model node."""
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = OmegaConf.load(path)
        usable = isinstance(cfg.get("recipe"), str) and isinstance(cfg.get("model"), DictConfig)
    except Exception:  # not YAML, not a mapping, or a value that does not resolve (OmegaConf raises several types)
        usable = False
    if not usable:
        raise GenerateError(
            f"{path} is not a run's config (a mapping with a recipe and a model node); the checkpoint is damaged, so "
            "point at another one."
        )
    return cfg


def _generate_gpt(cfg, weights: Path, prompt, max_new_tokens, temperature, top_k, generator, device, writer) -> None:

    from runner.data.text import VOCAB_FILE, CharVocab
    from runner.engine.checkpoint.model_weights import check_not_linked

    check_not_linked(weights / VOCAB_FILE)
    if not (weights / VOCAB_FILE).is_file():
        raise GenerateError(
            f"{weights} has no {VOCAB_FILE}, the characters the model reads; point at the run folder or a checkpoint "
            "the language model recipe wrote."
        )
    vocab = CharVocab.load(weights / VOCAB_FILE)
    _check_not_empty(prompt)
    try:
        ids = vocab.encode(prompt).long()[None]
    except ValueError as error:
        raise GenerateError(f"prompt={prompt!r}: {error} Use the run's characters ({weights / VOCAB_FILE}).") from None
    model = _with_weights(weights, _built(cfg.model, vocab_size=len(vocab))).to(device).eval()
    ids = ids.to(device)
    writer.write(prompt)
    for _ in range(max_new_tokens):  # one token at a time: the same draws as one call, shown as they come
        ids = model.generate(ids, 1, temperature=temperature, top_k=top_k, generator=generator)
        writer.write(vocab.decode(ids[0, -1:].cpu()))


def _generate_hugging_face(
    cfg, weights: Path, prompt, max_new_tokens, temperature, top_k, seed, device, writer
) -> None:
    import torch
    from omegaconf import OmegaConf

    from runner.training.components import build

    tokenizer_node = OmegaConf.select(cfg, "data.train.tokenizer")
    tokenizer = build(tokenizer_node, key="data.train.tokenizer") if tokenizer_node is not None else None
    if tokenizer is not None:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    else:
        ids = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
    _check_not_empty(ids[0].tolist())
    model = _with_weights(weights, _built(cfg.model)).to(device).eval()
    if tokenizer is not None:  # without clean-up, decoding more tokens only adds to the text decoded before

        def decode(tokens: list[int]) -> str:
            return tokenizer.decode(tokens, clean_up_tokenization_spaces=False)

    else:
        decode = _utf8

    writer.write(prompt)
    torch.manual_seed(seed)  # transformers' sampling draws from the global generator: seeded after the model's init
    stream = _Stream(decode, writer)
    with torch.no_grad():
        _sample(model, ids, max_new_tokens, device=device, streamer=stream, temperature=temperature, top_k=top_k or 0)
    stream.close()


def _sample(model, ids, max_new_tokens: int, *, device: str, **options) -> None:
    """``max_new_tokens`` tokens after ``ids`` from ``model.generate()``, streamed: one call while the text fits the
    model's positions, then one call per token on the last ``positions - 1`` tokens, so that no call reads past them
    (a position past the embeddings is an IndexError, and transformers warns before)."""
    import torch

    positions = _max_positions(model)
    while max_new_tokens:
        context = ids if positions is None else ids[:, -max(positions - 1, 1) :]
        step = max_new_tokens if positions is None else max(min(max_new_tokens, positions - context.shape[1]), 1)
        context = context.to(device)
        sampled = model.generate(
            context, attention_mask=torch.ones_like(context), max_new_tokens=step, min_new_tokens=step,
            do_sample=True, pad_token_id=0, **options,
        )  # fmt: skip
        ids = torch.cat((ids, sampled[:, context.shape[1] :].cpu()), dim=1)
        max_new_tokens -= step


def _max_positions(model) -> int | None:
    """How many tokens the model reads at most (its position embeddings), as its config names it; None if it has no
    such limit. The context is cropped to it, as GPT.generate crops to its block_size: past it, a position has no
    embedding."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class _Stream:
    """What ``generate()`` hands its tokens to (transformers' streamer interface: ``put``, ``end``). It decodes the
    whole sequence sampled so far and writes what is new, so a character a tokenizer spreads over several tokens
    (bytes, byte-level BPE, SentencePiece) is written once, whole. Past the model's positions the text is sampled by
    several ``generate()`` calls, each handing its context over first and ending by itself: :meth:`close` writes
    what never finished, once the last one ends."""

    def __init__(self, decode, writer: _Writer) -> None:
        self.decode, self.writer = decode, writer
        self.prompt_seen, self.tokens, self.shown = False, [], ""

    def put(self, value) -> None:
        if not self.prompt_seen:  # each generate() call hands its context over first
            self.prompt_seen = True
            return
        self.tokens += value.reshape(-1).tolist()
        self._show(self.decode(self.tokens).rstrip("\ufffd"))  # an unfinished character waits for its next token

    def end(self) -> None:
        self.prompt_seen = False  # a next call, if any, starts with its context

    def close(self) -> None:
        self._show(self.decode(self.tokens))

    def _show(self, text: str) -> None:
        if len(text) > len(self.shown):  # what is new; were an earlier character decoded anew, it stays as shown
            self.writer.write(text[len(self.shown) :])
            self.shown = text


def _check_not_empty(prompt: str | list[int]) -> None:
    if len(prompt) == 0:  # the text, or the ids a tokenizer made of it
        raise GenerateError("prompt='' is empty; give the model something to continue, prompt=\\n at least.")


def _built(node, **given):
    """The run's model node, built without reading what a ``from_run`` in it names: the run's weights come next."""
    from runner.models.run_weights import reading
    from runner.training.components import build

    return build(reading(node, "checkpoint"), key="model", **given)


def _with_weights(weights: Path, model):
    """``model`` with the run's weights; a model they do not fit is one sentence."""
    from runner.models import from_run

    try:
        return from_run(weights, model)
    except ValueError as error:  # from_run's refusals are one sentence each
        raise GenerateError(str(error)) from None


def _utf8(tokens: list[int]) -> str:
    """Token ids as UTF-8 bytes (how ``runner.data.causal_lm_blocks`` reads text without a tokenizer); an id
    past 255 is not a byte and reads as U+FFFD, as an invalid byte does."""
    pieces, run = [], bytearray()
    for token in tokens:
        if token < 256:
            run.append(token)
            continue
        pieces.append(run.decode("utf-8", errors="replace") + "\ufffd")
        run = bytearray()
    pieces.append(run.decode("utf-8", errors="replace"))
    return "".join(pieces)


class _Writer:
    """Writes each piece to ``out`` at once (flushed) and keeps the whole text."""

    def __init__(self, out) -> None:
        self.out, self.pieces = out, []

    def write(self, piece: str) -> None:
        self.pieces.append(piece)
        if self.out is not None:
            self.out.write(piece)
            self.out.flush()

    @property
    def text(self) -> str:
        return "".join(self.pieces)
