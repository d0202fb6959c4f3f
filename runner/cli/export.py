"""``runner export FOLDER --to DIR``: a checkpoint's model as a plain weights folder, on one process, without a GPU.

FOLDER is a run folder (its newest intact checkpoint; damaged ones are skipped with a warning) or one
checkpoint folder (``checkpoints/checkpoint_N``, or any folder ``save_state`` wrote). Every file the
checkpoint's manifest lists is hashed first. Whatever wrote the model (one process, DDP, FSDP's DCP shards
from any number of processes, tensor-parallel shards) it becomes ``model.safetensors`` in DIR (shards and
``model.safetensors.index.json`` past ``--max-shard-size``), the tensors whole and under the model's own
names, optionally cast (``--dtype bf16``). For a Hugging Face transformers model DIR also gets its
``config.json`` (and ``generation_config.json``), so ``from_pretrained(DIR)`` loads it: copied from the run's
final ``model/`` folder, or, for a run that has none yet, built from the run's ``model.config`` node when it
names a transformers config class.

Nothing in the checkpoint runs: tensors are read with safetensors, DCP's metadata with an unpickler that
builds only DCP's own classes, and the only class built from the run's config is a transformers config class
(checked to be one). DIR must be new or empty; it is written under a temporary name and renamed into place.

``--merge-lora``: for a run whose model is ``runner.models.with_peft`` (LoRA adapters on a base model), the
model is rebuilt from the run's config (so resume's trust rules hold: ``--trust-resume`` for a run someone else
wrote), takes the checkpoint's weights, and its adapters are merged into the base layers: DIR holds the base
model's own names and shapes, and ``from_pretrained(DIR)`` gives the fine-tuned model without peft.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

USAGE_ERROR = 2
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
HF_FILES = ("config.json", "generation_config.json")


class ExportError(Exception):
    """One sentence: what is wrong with the command line or the folder, and what to do."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one sentence and exit code 2, not a usage dump
        print(f"runner export: error: {message}; see runner export --help.", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def main(argv: list[str]) -> int:
    """``runner export``; returns its exit code."""
    parser = _Parser(
        prog="runner export",
        description="Write a checkpoint's model as model.safetensors (+ a transformers model's config.json) in "
        "a new folder, from any checkpoint: one process, DDP, or FSDP/tensor-parallel shards.",
    )
    parser.add_argument("folder", help="a run folder (its newest intact checkpoint) or a checkpoint folder")
    parser.add_argument("--to", required=True, help="the folder to write: new, or empty")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast the floating-point weights (default: as saved)")
    parser.add_argument("--max-shard-size", default="10GB", help="split into shards past this size (default 10GB)")
    parser.add_argument("--model", type=int, default=0, help="which prepared model, for a checkpoint of several")
    parser.add_argument(
        "--merge-lora", action="store_true",
        help="a run of runner.models.with_peft: the base weights with the adapters merged in (the run's model node is "
        "built, under resume's trust rules)",
    )  # fmt: skip
    parser.add_argument("--trust-resume", action="store_true", help="with --merge-lora: a run someone else wrote")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        summary = export(
            args.folder, args.to, dtype=args.dtype, max_shard_size=args.max_shard_size, model_index=args.model,
            merge_lora=args.merge_lora, trust=args.trust_resume,
        )  # fmt: skip
    except ExportError as error:
        print(f"runner export: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    print(summary)
    return 0


def export(
    folder: str | os.PathLike,
    to: str | os.PathLike,
    *,
    dtype: str | None = None,
    max_shard_size: int | str = "10GB",
    model_index: int = 0,
    merge_lora: bool = False,
    trust: bool = False,
) -> str:
    """Export the model of the checkpoint ``folder`` names into the new folder ``to``; returns what was written.

    Raises:
        ExportError: One sentence naming the folder or option and the fix; nothing is written.
    """
    import torch

    from runner.engine.checkpoint.manifest import CheckpointError
    from runner.engine.checkpoint.model_weights import checkpoint_model_state, find_checkpoint
    from runner.engine.checkpoint.serialization import parse_size, save_model_files

    destination = _destination(Path(to))
    try:
        parse_size(max_shard_size)
    except ValueError:
        raise ExportError(
            f"--max-shard-size {max_shard_size} is not a size; write it like 10GB, 500MiB or 1000000."
        ) from None
    try:
        checkpoint, manifest = find_checkpoint(folder)
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    try:
        state = checkpoint_model_state(checkpoint, manifest, model_index)
    except CheckpointError as error:
        raise ExportError(f"--model {model_index}: {error}" if model_index else str(error)) from None
    merged = None
    if merge_lora:
        merged = _merged_model(checkpoint, state, folder, trust)
        state = merged.state_dict()
    if dtype is not None:
        target = getattr(torch, DTYPES[dtype])
        state = {name: t.to(target) if t.is_floating_point() else t for name, t in state.items()}
    staging = destination.with_name(f".{destination.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        written = save_model_files(state, staging, max_shard_size=max_shard_size)
        if merged is not None:
            written += _merged_config(merged, staging, dtype)
        elif model_index == 0:  # the run's config.json, or its model node, describe its one declared model
            written += _hugging_face_files(checkpoint, staging, state, dtype)
        if destination.is_dir():
            destination.rmdir()  # empty, as _destination checked
        staging.rename(destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files = sorted(path.name for path in written)
    size = sum((destination / name).stat().st_size for name in files)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values()})
    step = manifest.get("step")
    return (
        f"Exported {checkpoint}{'' if step is None else f' (step {step})'} to {destination}: {', '.join(files)} "
        f"({len(state)} tensors, {'/'.join(dtypes)}, {_size(size)})."
    )


def _merged_model(checkpoint: Path, state: dict[str, Any], folder, trust: bool):
    """The run's ``runner.models.with_peft`` model with the checkpoint's weights, its adapters merged into the base
    layers (``merge_and_unload``). The base model node is built as the run declared it; a ``from_run`` around it
    is not followed (the checkpoint holds every weight)."""
    from omegaconf import OmegaConf

    from runner.components import build
    from runner.config import ConfigError
    from runner.layout import CONFIG_FILE
    from runner.models.adapters import with_peft
    from runner.provenance import check_resumable

    if not (checkpoint / CONFIG_FILE).is_file():
        raise ExportError(
            f"--merge-lora: {checkpoint} has no {CONFIG_FILE}, so its model cannot be rebuilt; export it without "
            "--merge-lora."
        )
    node = OmegaConf.load(checkpoint / CONFIG_FILE).get("model")
    target = OmegaConf.select(node, "_target_") if OmegaConf.is_dict(node) else None
    if target != "runner.models.with_peft":
        raise ExportError(
            f"--merge-lora: the model of {folder} is {target}, not runner.models.with_peft, so it has no adapters to "
            "merge; export it without --merge-lora."
        )
    try:
        check_resumable(
            checkpoint, path=str(folder), overrides=["trust_resume=true"] if trust else [], search_path=[],
            command="export",
        )  # fmt: skip
        base = node.model
        if OmegaConf.select(base, "_target_") == "runner.models.from_run":
            base = base.model
        model = with_peft(build(base, key="model.model"), build(node.config, key="model.config"))
        model.load_state_dict(state, strict=True)
    except (ConfigError, ValueError, RuntimeError) as error:  # a refusal, or weights of another model
        raise ExportError(f"--merge-lora: {str(error).splitlines()[0]}") from None
    return model.merge_and_unload()


def _merged_config(model, to: Path, dtype: str | None) -> list[Path]:
    """config.json (and generation_config.json) of a merged transformers model; [] for any other."""
    from runner.components import save_pretrained_config

    written = save_pretrained_config(model, to)
    if written and dtype is not None:
        config = json.loads(written[0].read_text())
        config["dtype"] = DTYPES[dtype]
        written[0].write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


def _size(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


def _destination(to: Path) -> Path:
    to = to.expanduser().absolute()
    if to.is_symlink() or (to.exists() and not to.is_dir()):
        raise ExportError(f"--to {to} is a file; give a new or empty folder.")
    if to.is_dir() and any(to.iterdir()):
        raise ExportError(f"--to {to} already holds files; give a new or empty folder (nothing was written).")
    if not to.parent.is_dir():
        raise ExportError(f"--to {to}: its parent folder {to.parent} does not exist; create it first.")
    return to


def _hugging_face_files(checkpoint: Path, to: Path, state: dict[str, Any], dtype: str | None) -> list[Path]:
    """A transformers model's config.json (and generation_config.json) in ``to``; [] for any other model."""
    from runner.layout import CONFIG_FILE, MODEL_DIR

    final = checkpoint.parent.parent / MODEL_DIR  # the run's final model folder, when the run finished
    if checkpoint.parent.name == "checkpoints" and (final / HF_FILES[0]).is_file():
        written = []
        for name in HF_FILES:
            if (final / name).is_file():
                text = (final / name).read_text()
                if name == HF_FILES[0] and dtype is not None:
                    config = json.loads(text)
                    config["dtype"] = DTYPES[dtype]
                    config.pop("torch_dtype", None)
                    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
                (to / name).write_text(text)
                written.append(to / name)
        return written
    if (checkpoint / CONFIG_FILE).is_file():
        return _built_config(checkpoint / CONFIG_FILE, to, state, dtype)
    return []


def _built_config(config_file: Path, to: Path, state: dict[str, Any], dtype: str | None) -> list[Path]:
    """config.json from the run's ``model`` node, for ``_target_: transformers.<Model>`` with a ``config`` node
    naming ``transformers.<Config>``: the only class built is that config class, checked to be one."""
    from omegaconf import OmegaConf

    model = OmegaConf.select(OmegaConf.load(config_file), "model")
    node = model.get("config") if OmegaConf.is_dict(model) else None
    if not OmegaConf.is_dict(node):
        return []
    model_class, config_class = (_transformers_class(n.get("_target_")) for n in (model, node))
    if model_class is None or config_class is None:
        return []
    import transformers

    if not issubclass(model_class, transformers.PreTrainedModel):
        return []
    if not issubclass(config_class, transformers.PretrainedConfig):
        return []
    values = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "_target_"}
    config = config_class(**values)
    config.architectures = [model_class.__name__]
    floating = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    config.dtype = DTYPES[dtype] if dtype is not None else str(floating).removeprefix("torch.")
    config.save_pretrained(to)
    written = [to / HF_FILES[0]]
    if model_class.can_generate():
        transformers.GenerationConfig.from_model_config(config).save_pretrained(to)
        written.append(to / HF_FILES[1])
    return written


def _transformers_class(target: Any) -> type | None:
    """The class ``transformers.<Name>`` names (a top-level name of the installed package), else None."""
    if not isinstance(target, str) or target.count(".") != 1 or not target.startswith("transformers."):
        return None
    try:
        import transformers
    except ImportError:
        return None
    found = getattr(transformers, target.split(".")[1], None)
    return found if isinstance(found, type) else None
