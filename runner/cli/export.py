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
(checked to be one), from values that reach nothing outside the config: other keys (``${a.b}``) and the
resolvers that read only the config (a ``${oc.env:...}`` would copy this machine's environment into a
``config.json`` meant to be shared). A folder someone handed you is data: a symbolic link or a hard link in the
checkpoint, the run's ``checkpoints/`` or its ``model/`` is refused (export would copy the file it leads to, a
key in your home, say), and the files copied are opened without following links and checked on the open file.

DIR must be new or empty, and outside the run's ``checkpoints/`` and ``model/``. It is written into a new folder
of an unpredictable name beside it (``.DIR.partial-<host>-<pid>-<random>``), renamed into place once whole.
That folder is removed on any failure, and on SIGTERM or SIGINT (exit codes 143 and 130); one that a killed
export (SIGKILL) left behind is removed by the next export into the same folder on the same machine.

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
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from runner.cli.export_files import (
    ExportError,
    ExportStopped,
    _check_own_files,
    _check_plain_values,
    _commit,
    _new_staging,
    _read_own_files,
    _run_folder,
    _StopSignals,
)

USAGE_ERROR = 2
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
HF_FILES = ("config.json", "generation_config.json")


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
    except ExportStopped as stopped:
        print(f"runner export: error: {stopped}", file=sys.stderr)
        return stopped.exit_code
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
        ExportError: One sentence naming the folder, file or option and the fix; nothing is written.
        ExportStopped: SIGTERM or SIGINT arrived (when called on the main thread); nothing is written.
    """
    from runner.engine.checkpoint.serialization import parse_size

    destination = _destination(Path(to))
    try:
        parse_size(max_shard_size)
    except ValueError:
        raise ExportError(
            f"--max-shard-size {max_shard_size} is not a size; write it like 10GB, 500MiB or 1000000."
        ) from None
    with _StopSignals(destination) as stop:
        checkpoint, manifest, state, merged = _model_to_export(
            folder, destination, model_index=model_index, merge_lora=merge_lora, trust=trust, dtype=dtype
        )
        staging = _new_staging(destination)
        try:
            written = _write_export(
                staging, state, destination=destination, checkpoint=checkpoint, merged=merged,
                model_index=model_index, dtype=dtype, max_shard_size=max_shard_size,
            )  # fmt: skip
            stop.stoppable = False  # from the rename on, the export is whole or fails by itself
            _commit(staging, destination)
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


def _model_to_export(
    folder: str | os.PathLike, destination: Path, *, model_index: int, merge_lora: bool, trust: bool,
    dtype: str | None,
) -> tuple[Path, dict[str, Any], dict[str, Any], Any]:  # fmt: skip
    """The checkpoint ``folder`` names, its manifest, the state dict to write and the merged model (or None)."""
    import torch

    from runner.engine.checkpoint.errors import CheckpointError
    from runner.engine.checkpoint.model_weights import checkpoint_model_state, find_checkpoint

    try:
        checkpoint, manifest = find_checkpoint(folder)
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    _check_outside_run(destination, checkpoint)
    _check_own_files(checkpoint)
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
    return checkpoint, manifest, state, merged


def _write_export(
    staging: Path, state: dict[str, Any], *, destination: Path, checkpoint: Path, merged, model_index: int,
    dtype: str | None, max_shard_size: int | str,
) -> list[Path]:  # fmt: skip
    """The weights, and a transformers model's config.json, in ``staging``; returns the files written."""
    from runner.engine.checkpoint.serialization import save_model_files

    try:
        written = save_model_files(state, staging, max_shard_size=max_shard_size)
        if merged is not None:
            return written + _merged_config(merged, staging, dtype)
        if model_index == 0:  # the run's config.json, or its model node, describe its one declared model
            return written + _hugging_face_files(checkpoint, staging, state, dtype)
        return written
    except OSError as error:  # a full disk, say: what was written is removed
        raise ExportError(
            f"--to {destination}: writing the export failed ({error.strerror or error}); free some space or give a "
            "folder on another disk (nothing was written)."
        ) from None


def _size(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


# ------------------------------------------------------------------------------------------------ where --to may be
def _destination(to: Path) -> Path:
    to = to.expanduser().absolute()
    if to.is_symlink() or (to.exists() and not to.is_dir()):
        raise ExportError(f"--to {to} is a file; give a new or empty folder.")
    if to.is_dir() and any(to.iterdir()):
        raise ExportError(f"--to {to} already holds files; give a new or empty folder (nothing was written).")
    if not to.parent.is_dir():
        raise ExportError(f"--to {to}: its parent folder {to.parent} does not exist; create it first.")
    return to


def _check_outside_run(destination: Path, checkpoint: Path) -> None:
    """Refuse a ``--to`` inside the run's checkpoints or model folder (or inside the checkpoint exported): the run's
    saves, rotation and resume own those, and would take the export for one of theirs, or it them."""
    from runner.folders.layout import MODEL_DIR

    run = _run_folder(checkpoint)
    protected = [(checkpoint, "the checkpoint being exported")]
    if run is not None:
        protected = [(checkpoint.parent, "the run's checkpoints folder"), (run / MODEL_DIR, "the run's model folder")]
    for folder, what in protected:
        if destination.resolve().is_relative_to(folder.resolve()):
            raise ExportError(
                f"--to {destination} is inside {what} {folder}; export outside {what}, beside the run say."
            )


def _run_config(checkpoint: Path):
    """The run's config saved in ``checkpoint`` (unresolved; read as :func:`_read_own_files` reads), None without."""
    from omegaconf import DictConfig, OmegaConf

    from runner.folders.layout import CONFIG_FILE

    content = _read_own_files(checkpoint, [CONFIG_FILE]).get(CONFIG_FILE)
    if content is None:
        return None
    try:
        config = OmegaConf.create(content.decode())
    except Exception:  # not YAML, or not text: OmegaConf and yaml raise several types
        config = None
    if not isinstance(config, DictConfig):
        raise ExportError(
            f"{checkpoint / CONFIG_FILE} is not a config; the checkpoint is damaged, so export another one."
        )
    return config


# ------------------------------------------------------------------------- the model and config.json, from the run
def _merged_model(checkpoint: Path, state: dict[str, Any], folder, trust: bool):
    """The run's ``runner.models.with_peft`` model with the checkpoint's weights, its adapters merged into the base
    layers (``merge_and_unload``). The base model node is built as the run declared it; a ``from_run`` around it
    is not followed (the checkpoint holds every weight)."""
    from omegaconf import OmegaConf

    from runner.config import ConfigError
    from runner.folders.layout import CONFIG_FILE
    from runner.folders.provenance import check_resumable
    from runner.models.adapters import with_peft

    config = _run_config(checkpoint)
    if config is None:
        raise ExportError(
            f"--merge-lora: {checkpoint} has no {CONFIG_FILE}, so its model cannot be rebuilt; export it without "
            "--merge-lora."
        )
    raw = OmegaConf.to_container(config, resolve=False)
    node = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    target = node.get("_target_")
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
        plain = "give {key} a plain value in the run's config"
        _check_plain_values(config, raw, key="model", config_file=checkpoint / CONFIG_FILE, fix=plain)
        base = "model.model"
        if isinstance(node.get("model"), dict) and node["model"].get("_target_") == "runner.models.from_run":
            base = "model.model.model"
        adapters = _build(OmegaConf.select(config, "model.config"), key="model.config")
        model = with_peft(_build(OmegaConf.select(config, base), key=base), adapters)
        model.load_state_dict(state, strict=True)
    except (ConfigError, ValueError, RuntimeError) as error:  # a refusal, or weights of another model
        raise ExportError(f"--merge-lora: {str(error).splitlines()[0]}") from None
    return model.merge_and_unload()


def _build(node, *, key: str):
    """:func:`runner.training.components.build`, with a ``_target_`` that does not import as one sentence naming it."""
    from runner.training.components import build

    try:
        return build(node, key=key)
    except ImportError as error:  # Hydra's: "Error loading 'pkg.Name':\nModuleNotFoundError(...)\n..."
        named = re.match(r"Error loading '([^']+)'", str(error))
        missing = re.search(r"No module named '[^']+'", str(error))
        target = named.group(1) if named else node.get("_target_")
        reason = missing.group(0) if missing else str(error).splitlines()[0]
        raise ExportError(
            f"--merge-lora: {key} names {target}, which does not import here ({reason}); install the package that "
            "provides it, then export again."
        ) from None


def _merged_config(model, to: Path, dtype: str | None) -> list[Path]:
    """config.json (and generation_config.json) of a merged transformers model; [] for any other."""
    from runner.training.components import save_pretrained_config

    written = save_pretrained_config(model, to)
    if written and dtype is not None:
        config = json.loads(written[0].read_text())
        config["dtype"] = DTYPES[dtype]
        written[0].write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return written


def _hugging_face_files(checkpoint: Path, to: Path, state: dict[str, Any], dtype: str | None) -> list[Path]:
    """A transformers model's config.json (and generation_config.json) in ``to``; [] for any other model."""
    from runner.folders.layout import CONFIG_FILE, MODEL_DIR

    run = _run_folder(checkpoint)
    final = _read_own_files(run / MODEL_DIR, HF_FILES) if run is not None else {}  # when the run finished
    if HF_FILES[0] in final:
        return [_copied(run / MODEL_DIR / name, content, to=to, dtype=dtype) for name, content in final.items()]
    config = _run_config(checkpoint)
    if config is None:
        return []
    return _built_config(config, config_file=checkpoint / CONFIG_FILE, to=to, state=state, dtype=dtype)


def _copied(source: Path, content: bytes, *, to: Path, dtype: str | None) -> Path:
    """``source``'s ``content`` written under its name in ``to``; config.json's dtype set to ``dtype`` if given."""
    if source.name == HF_FILES[0] and dtype is not None:
        try:
            config = json.loads(content)
        except ValueError:  # not JSON, or not UTF-8
            config = None
        if not isinstance(config, dict):
            raise ExportError(
                f"{source} is not a JSON object; the run's model folder is damaged, so export without --dtype or "
                "write a valid config.json there."
            )
        config["dtype"] = DTYPES[dtype]
        config.pop("torch_dtype", None)
        content = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    (to / source.name).write_bytes(content)
    return to / source.name


def _built_config(config, *, config_file: Path, to: Path, state: dict[str, Any], dtype: str | None) -> list[Path]:
    """config.json from the run's ``model`` node, for ``_target_: transformers.<Model>`` with a ``config`` node
    naming ``transformers.<Config>``: the only class built is that config class, checked to be one, from values
    that read nothing outside the config (:func:`_check_plain_values`)."""
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(config, resolve=False)
    model = raw.get("model")
    node = model.get("config") if isinstance(model, dict) else None
    if not isinstance(node, dict):
        return []
    model_class, config_class = (_transformers_class(n.get("_target_")) for n in (model, node))
    if model_class is None or config_class is None:
        return []
    import transformers

    if not issubclass(model_class, transformers.PreTrainedModel):
        return []
    if not issubclass(config_class, transformers.PretrainedConfig):
        return []
    finished = "export the run once it has finished (its model/config.json is copied as is)"
    _check_plain_values(
        config, raw, key="model.config", config_file=config_file, fix=f"{finished}, or give {{key}} a plain value"
    )
    try:
        values = OmegaConf.to_container(OmegaConf.select(config, "model.config"), resolve=True)
        values.pop("_target_", None)
        built = config_class(**values)
    except Exception as error:  # OmegaConf raises several types, and a config class any for a value it rejects
        raise ExportError(
            f"{config_file}: model.config does not make a {config_class.__name__} ({str(error).splitlines()[0]}); the "
            "checkpoint's config is damaged, so export another checkpoint."
        ) from None
    built.architectures = [model_class.__name__]
    floating = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    built.dtype = DTYPES[dtype] if dtype is not None else str(floating).removeprefix("torch.")
    built.save_pretrained(to)
    written = [to / HF_FILES[0]]
    if model_class.can_generate():
        transformers.GenerationConfig.from_model_config(built).save_pretrained(to)
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
