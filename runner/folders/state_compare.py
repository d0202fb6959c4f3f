"""Two checkpoints, or two runs' logged values, compared bit for bit; each difference named as a user reads it.

- :func:`checkpoint_differences`: every state a checkpoint holds (weights, optimizer, scheduler, loss scaler, each
  process's RNG states, the registered objects, accumulated gradients) and its position (step, epoch, each
  loader's data position), read as data only (safetensors, ``torch.load(weights_only=True)``, DCP through the
  engine's reader) and compared tensor by tensor, bit for bit.
- :func:`logged_differences`: every logged scalar (TensorBoard's), step by step, exactly; throughput and timings
  left out, since they differ between any two runs.

The files are read as the engine reads a checkpoint someone else wrote: nothing in them is called.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.engine.constants import DCP_METADATA_NAME, MANIFEST_NAME
from runner.folders.layout import CONFIG_FILE, OVERRIDES_FILE

# Files that say what a checkpoint is, not what the run computed: compared through the manifest's fields instead.
_NOT_STATE = {CONFIG_FILE, OVERRIDES_FILE, MANIFEST_NAME, "signature.json"}
# The manifest's fields that place a checkpoint in its run: where it is, and each loader's data position.
POSITION_FIELDS = ("step", "epoch", "optimizer_steps", "accumulation_step", "accumulation_steps", "dataloaders")
# Logged values that measure the machine, not the training: they differ between any two runs.
_TIMINGS = re.compile(r"per_second|mfu|seconds|_time|time_", re.IGNORECASE)


def is_timing(name: str) -> bool:
    """Whether a logged value or metrics.json key measures the machine (throughput, MFU, wall time), not the
    training: it differs between any two runs, so no comparison counts it."""
    return bool(_TIMINGS.search(name))


@dataclass(frozen=True)
class Difference:
    """One thing that differs: ``what`` (``model weights``, ``logged train/loss``, ...), ``where`` in it (a tensor's
    name, a key, a step) and ``detail`` (the values, and by how much)."""

    what: str
    where: str
    detail: str
    step: int | None = None  # for a logged value: the step it was logged at

    def sentence(self) -> str:
        return f"{self.what}: {self.where}: {self.detail}" if self.where else f"{self.what}: {self.detail}"


def describe_file(name: str) -> str:
    """What a checkpoint's file (or DCP folder) holds, in words."""
    stem = name.split("/")[0]
    patterns = (
        (r"model(_\d+)?(\.safetensors)?$", "model weights"),
        (r"optimizer(_\d+)?(\.bin)?$", "optimizer state"),
        (r"scheduler(_\d+)?(\.bin)?$", "scheduler state"),
        (r"scaler\.pt$", "loss scaler"),
        (r"random_states_(\d+)\.pt$", "RNG states of process {0}"),
        (r"custom_checkpoint_(\d+)\.pt$", "registered object {0}"),
        (r"gradients_(\d+)\.safetensors$", "accumulated gradients of process {0}"),
    )
    for pattern, words in patterns:
        found = re.fullmatch(pattern, stem)
        if found:
            index = found.group(1)
            words = words.format(index) if "{0}" in words else words
            if words.startswith(("model", "optimizer", "scheduler")) and index:
                words += f" {index.lstrip('_')}"
            return words + (" (sharded)" if "/" in name else "")
    return f"file {name}"


def checkpoint_differences(first: Path, second: Path, *, limit: int = 20) -> list[Difference]:
    """What differs between two checkpoints' states and positions (at most ``limit`` differences, the position
    first); both folders' manifests are read and their files checked against them first.

    Raises:
        CheckpointError: A checkpoint is damaged or not one.
    """
    from runner.engine.checkpoint import read_manifest

    manifests = read_manifest(first), read_manifest(second)
    found: list[Difference] = []
    for field in POSITION_FIELDS:
        a, b = (manifest.get(field) for manifest in manifests)
        if a != b:
            what = "data position" if field == "dataloaders" else "position"
            where = field
            if field == "dataloaders" and isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
                index = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
                where, a, b = f"loader {index}", a[index], b[index]
            found.append(Difference(what, where, f"{_shown(a)} vs {_shown(b)}"))
    units = [_units(manifest) for manifest in manifests]
    for unit in sorted(set(units[0]) | set(units[1]), key=_unit_order):
        if len(found) >= limit:
            break
        what = describe_file(unit)
        if unit not in units[0] or unit not in units[1]:
            holder = second if unit not in units[0] else first
            found.append(Difference(what, "", f"only {holder} holds it"))
            continue
        a, b = (_read_unit(folder, unit, names) for folder, names in zip((first, second), units, strict=True))
        for where, detail in itertools.islice(differences(a, b), limit - len(found)):
            found.append(Difference(what, where, detail))
    return found[:limit]


def _units(manifest: dict[str, Any]) -> dict[str, list[str]]:
    """The checkpoint's state, by unit: each file, or each DCP folder with its files."""
    units: dict[str, list[str]] = {}
    for name in manifest.get("files", {}):
        if name in _NOT_STATE:
            continue
        folder, _, inner = name.partition("/")
        units.setdefault(folder + "/" if inner else name, []).append(inner or name)
    return units


def _unit_order(unit: str) -> tuple[int, str]:
    order = ("model", "optimizer", "scheduler", "scaler", "gradients", "random_states", "custom_checkpoint")
    return next((i for i, prefix in enumerate(order) if unit.startswith(prefix)), len(order)), unit


def _read_unit(folder: Path, unit: str, names: dict[str, list[str]] | list[str]) -> Any:
    from runner.engine.checkpoint.serialization import load_safetensors
    from runner.engine.checkpoint.sharded_state import load_whole_dcp_state
    from runner.engine.checkpoint.torch_files import torch_load

    if unit.endswith("/"):
        listed = [name for name in names[unit] if name != DCP_METADATA_NAME] if isinstance(names, dict) else []
        return load_whole_dcp_state(folder / unit.rstrip("/"), listed)
    path = folder / unit
    if unit.endswith(".safetensors"):
        return load_safetensors(path)
    if unit.endswith((".pt", ".bin")):
        return torch_load(path)
    if unit.endswith(".json"):
        return json.loads(path.read_text())
    return path.read_bytes()


def differences(a: Any, b: Any, *, where: str = "") -> Iterator[tuple[str, str]]:
    """``(where, detail)`` for each place two nested states (dicts, lists, tensors, numbers) differ, bit for bit."""
    import torch

    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            inner = f"{where}.{key}" if where else str(key)
            if key not in a or key not in b:
                yield inner, f"only in the {'second' if key not in a else 'first'}"
            else:
                yield from differences(a[key], b[key], where=inner)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield where, f"{len(a)} entries vs {len(b)}"
            return
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from differences(x, y, where=f"{where}[{index}]")
    elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        detail = tensor_difference(a, b)
        if detail is not None:
            yield where, detail
    elif type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
        import numpy

        if not (numpy.shape(a) == numpy.shape(b) and numpy.array_equal(a, b)):
            yield where, "the arrays differ"
    elif not same_value(a, b):
        yield where, f"{_shown(a)} vs {_shown(b)}"


def same_value(a: Any, b: Any) -> bool:
    """Equal values of one type, NaN equal to NaN (a logged NaN repeated is no difference)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def tensor_difference(a, b) -> str | None:
    """None if the tensors are the same bits; else how many values differ, by how much at most, and the first."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    x, y = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
        return None
    if x.dtype.is_floating_point or x.dtype.is_complex:
        differ = ~((x == y) | (torch.isnan(x) & torch.isnan(y)))
    else:
        differ = x != y
    count = int(differ.sum())
    if count == 0:  # the same values in other bits: +0.0 and -0.0, NaNs of other payloads
        return "the same values in other bits (signed zeros or NaN payloads)"
    first = int(differ.nonzero()[0])
    detail = f"{count} of {x.numel()} values differ"
    if x.dtype.is_floating_point:
        largest = float((x.double() - y.double()).abs().nan_to_num(math.inf).max())
        detail += f", by up to {largest:.3g}"
    return f"{detail} (first at index {first}: {x[first].item()!r} vs {y[first].item()!r})"


def logged_differences(
    a: dict[str, list[tuple[int, float]]], b: dict[str, list[tuple[int, float]]]
) -> list[Difference]:
    """For each logged tag (timings left out), the first step at which the two runs logged different values, or
    logged at different steps; in the order of those steps."""
    found = []
    for tag in sorted(set(a) | set(b)):
        if is_timing(tag):
            continue
        if tag not in a or tag not in b:
            found.append(
                Difference(f"logged {tag}", "", f"only the {'second' if tag not in a else 'first'} run logs it")
            )
            continue
        x, y = dict(a[tag]), dict(b[tag])
        for step in sorted(set(x) | set(y)):
            if step not in x or step not in y:
                found.append(
                    Difference(
                        f"logged {tag}",
                        f"step {step}",
                        f"only the {'second' if step not in x else 'first'} run logged it",
                        step,
                    )
                )
                break
            if not same_value(x[step], y[step]):
                gap = abs(x[step] - y[step])
                relative = gap / max(abs(x[step]), abs(y[step]), 1e-300)
                detail = f"{x[step]!r} vs {y[step]!r} (by {gap:.3g}, {relative:.2e} relative)"
                found.append(Difference(f"logged {tag}", f"step {step}", detail, step))
                break
    return sorted(found, key=lambda difference: (difference.step is None, difference.step or 0, difference.what))


def _shown(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
