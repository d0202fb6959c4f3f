"""``runner diff RUN_A RUN_B``: what differs between two runs, section by section, read from their folders alone.

    runner diff outputs/2026-12-07/10-00-00 outputs/2026-12-07/10-05-00
    a: /home/me/project/outputs/2026-12-07/10-00-00 (run; 1 launch)
    b: /home/me/project/outputs/2026-12-07/10-05-00 (run; 1 launch)
    config: 1 key differs
      key           a                b
      optimizer.lr  0.001 (default)  0.01 (optimizer.lr=0.01)
    code: same
    packages: same
    hardware and launch: same
    environment: same
    data order: same (4 batches from batch 0, digest e4816e4b4d4c)
    metrics: first differ at step 1 (train/lr)
      not compared: train/samples_per_second (speed, which differs between any two runs)
      tag            step  a             b            b - a    relative
      train/lr       1     0.0009330127  0.009330127  +0.0084  +900%
      train/loss     2     2.2972355     11.871767    +9.57    +417%
      ...

Each side is a run folder, a sweep job's folder (a run folder inside a sweep), or a checkpoint folder
(<run>/checkpoints/checkpoint_N: its own config.yaml and overrides.yaml, its run's records and logs, and the
metrics up to the step it saved). The sections:

  config       each key (dotted) whose value differs, or that one side lacks, with the override that set it on
               each side, or "(default)" where the config files gave it; project.project_dir (where each run
               writes) is left out, and said so
  code         the runner's version, commit and uncommitted changes (a digest), and those of each repository the
               config's code comes from
  packages     installed packages whose versions differ, or that one side lacks (-)
  hardware and launch
               Python, torch, CUDA, the devices, the numerics switches, and the launch's shape (processes, nodes,
               precision, accumulation, parallel strategy, hosts)
  environment  the recorded environment variables that change what a run computes (- : unset)
  data order   whether the first training batches were read alike (their digests), else the first that differs
               (a side that read fewer of the same batches is no difference, and is said so)
  state        two checkpoints' states, bit for bit: their position first (step, epoch, each loader's data
               position), then the first tensors that differ (at most 20); compared only when both sides are
               checkpoints, and a damaged checkpoint gets one line
  metrics      per TensorBoard scalar, the first step at which its values differ (compared exactly) or that only
               one side logged, both values and the difference; scalars only one side logged; the final values in
               metrics.json that differ. A checkpoint's side ends at its step: what the other side logged after
               it is not compared. Speed (train/*_per_second, train/mfu) and times are left out

Code, packages, hardware, environment and data order come from each run's first launch record
(provenance/attempt_1.json), and a later launch (a resume) that changed them is named; for a run written before
records were kept those sections say "no launch record in <folder>" (or why its first launch has none: a record
that is not JSON, records that begin with a resume), and its config and metrics are still compared. A section
where nothing differs says "same". --json prints one JSON object with the same content (a value that is not a
finite number as the string "NaN", "Infinity" or "-Infinity").

Exit status, as diff's: 0 when nothing differs, 1 when something does, 2 for a bad folder or command line
(an unknown option is named, with the usage).
Nothing in either folder is imported, run or resolved (a config is read as plain YAML; a ${key} naming another
key of it is read as that key's value, and no resolver is called), and a folder holding a symbolic link is
refused.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from runner.folders.kinds import is_run_folder
from runner.folders.layout import CONFIG_FILE, HYDRA_DIR, HYDRA_OVERRIDES_FILE, LOGS_DIR, METRICS_FILE, OVERRIDES_FILE
from runner.folders.state_compare import is_timing, same_value

USAGE = "usage: runner diff [--json] RUN_A RUN_B"
FOLDERS = "pass a run folder, a sweep job's folder or a checkpoint folder"
IGNORED_KEYS = ("project.project_dir",)  # each run's own folder: differs between any two runs, and means nothing
IGNORED_PREFIXES = ("hydra.",)
ABSENT = "-"
DEFAULT = "(default)"  # a value no override set: the config files gave it
STATE_LIMIT = 20  # the state section's differences, at most: the position, then the first tensors
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.\-\[\]]*)\}")  # ${key}: another key of the config, no resolver
_HEX = re.compile(r"[0-9a-f]{40,}")
_MISSING = object()  # a key one config lacks


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(f"{USAGE}\n\n{__doc__.split(chr(10) * 2, 1)[1]}", end="")
        return 0
    as_json = "--json" in argv
    folders = [arg for arg in argv if arg != "--json"]
    unknown = next((arg for arg in folders if arg.startswith("-") and not Path(arg).exists()), None)
    if unknown is not None:
        print(f"runner: error: {unknown} is not an option of runner diff; {USAGE}", file=sys.stderr)
        return 2
    if len(folders) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    from runner.config import ConfigError
    from runner.engine.checkpoint import CheckpointError

    try:
        sides = [read_side(Path(folder)) for folder in folders]
    except (ConfigError, CheckpointError) as error:
        print(f"runner: error: {error}", file=sys.stderr)
        return 2
    report = compare(*sides)
    print(json.dumps(as_plain_json(report), indent=1, allow_nan=False) if as_json else render(report))
    return 0 if report["same"] else 1


# ------------------------------------------------------------------------------------------------------ sides
@dataclass
class Side:
    """One side of the comparison, as read from its folder."""

    folder: Path  # as given, made absolute
    kind: str  # "run", "job N of sweep S" or "checkpoint at step N of run R"
    run_dir: Path | None  # where the records and logs are: None for a checkpoint outside a run folder
    config: dict | None
    overrides: list[str]
    step: int | None = None  # a checkpoint's step: its metrics are compared up to it
    records: list[dict] = field(default_factory=list)  # the launch records that made it, first launch first
    is_checkpoint: bool = False
    no_first_record: str | None = None  # why the first launch's record cannot be read, where it has one
    unread_records: list[str] = field(default_factory=list)  # a sentence for each later record that is not one

    def record_notes(self) -> list[str]:
        """Why this side's first launch record cannot be compared (none when it can)."""
        if self.no_first_record:
            return [self.no_first_record]
        return [] if self.records else [f"no launch record in {self.run_dir or self.folder}"]


def read_side(folder: Path) -> Side:
    """Read one side: a run folder, a sweep job's folder, or a checkpoint folder.

    Raises:
        ConfigError: Not a folder, neither a run nor a checkpoint, or a folder holding a symbolic link.
        CheckpointError: A checkpoint folder whose manifest does not hold.
    """
    from runner.config import ConfigError
    from runner.engine.checkpoint import checkpoint_number
    from runner.engine.constants import MANIFEST_NAME
    from runner.folders.layout import as_written, link_error

    folder = as_written(str(folder))
    if folder.is_symlink():
        raise link_error(folder)
    if not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder; {FOLDERS}.")
    if checkpoint_number(folder) is not None and (folder / MANIFEST_NAME).is_file():
        return _checkpoint_side(folder)
    if is_run_folder(folder):
        return _run_side(folder)
    raise ConfigError(
        f"{folder} is neither a run (.hydra/, run.log, checkpoints/, provenance/) nor a checkpoint "
        f"(checkpoints/checkpoint_N with its manifest.json); {FOLDERS}."
    )


def _run_side(folder: Path) -> Side:
    from runner.engine.checkpoint.folders import checkpoints_dir, committed_checkpoints
    from runner.folders.layout import JOB_FILE, check_no_links

    check_no_links(folder)
    records, no_first_record, unread = launch_records(folder)
    config_file, overrides_file = folder / HYDRA_DIR / CONFIG_FILE, folder / HYDRA_DIR / HYDRA_OVERRIDES_FILE
    if not config_file.is_file() and (saved := committed_checkpoints(checkpoints_dir(folder))):
        config_file, overrides_file = saved[-1] / CONFIG_FILE, saved[-1] / OVERRIDES_FILE
    overrides = _overrides(overrides_file)
    if overrides is None:
        recorded = records[0].get("overrides") if records else None
        overrides = [str(line) for line in recorded] if isinstance(recorded, list) else []
    kind = f"job {folder.name} of sweep {folder.parent}" if (folder / JOB_FILE).is_file() else "run"
    return Side(folder, kind, folder, _config(config_file), overrides, records=records,
                no_first_record=no_first_record, unread_records=unread)  # fmt: skip


def _checkpoint_side(folder: Path) -> Side:
    from runner.engine.checkpoint import read_manifest
    from runner.engine.constants import CHECKPOINTS_DIR
    from runner.folders.layout import check_no_links

    run_dir = folder.parent.parent if folder.parent.name == CHECKPOINTS_DIR else None
    if run_dir is not None and not is_run_folder(run_dir, counting_checkpoints=False):
        run_dir = None  # a checkpoint copied out of its run: no records or logs to read
    check_no_links(run_dir or folder)
    manifest = read_manifest(folder, verify_checksums=False)
    step = manifest.get("step") if isinstance(manifest.get("step"), int) else None
    kind = f"checkpoint at step {step} of run {run_dir}" if run_dir else f"checkpoint at step {step}"
    records, no_first_record, unread = launch_records(run_dir) if run_dir else ([], None, [])
    created = manifest.get("created") if isinstance(manifest.get("created"), str) else None
    records = [record for record in records if _started_before(record, created)] or records[:1]
    overrides = _overrides(folder / OVERRIDES_FILE) or []
    return Side(folder, kind, run_dir, _config(folder / CONFIG_FILE), overrides, step, records, is_checkpoint=True,
                no_first_record=no_first_record, unread_records=unread)  # fmt: skip


def launch_records(run_dir: Path) -> tuple[list[dict], str | None, list[str]]:
    """The run's launch records that read as JSON objects, first launch first; why its first launch's record
    cannot be compared (None when it can); and a sentence for each later record that does not read as one."""
    from runner.folders.launch_record import attempt_files

    records, no_first_record, unread, first_file = [], None, [], None
    for path in attempt_files(run_dir):
        try:
            record = json.loads(path.read_text())
            problem = None if isinstance(record, dict) else f"{path} is not a JSON object"
        except OSError as error:
            problem = f"{path} cannot be read ({error.strerror or error})"
        except ValueError:
            problem = f"{path} is not JSON"
        if problem is None:
            records.append(record)
            first_file = first_file or path.name
        elif path.name == "attempt_1.json":
            no_first_record = problem
        else:
            unread.append(problem)
    if no_first_record is None and records and (first_file != "attempt_1.json" or records[0].get("resume")):
        no_first_record = f"no record of the first launch of {run_dir}: its records begin with a resume ({first_file})"
    return records, no_first_record, unread


def _started_before(record: dict, created: str | None) -> bool:
    """Whether the launch ``record`` started before a checkpoint written at ``created`` (True when unknown)."""

    def parsed(text: str) -> datetime:
        return datetime.fromisoformat(re.sub(r"([+-]\d\d)(\d\d)$", r"\1:\2", text))  # +0000: as Python 3.10 reads it

    try:
        return parsed(record["started_at"]) <= parsed(created)
    except (KeyError, TypeError, ValueError):
        return True


def _config(path: Path) -> dict | None:
    from runner.folders.foreign_config import plain_config

    config = plain_config(path) if path.is_file() else None
    return config if isinstance(config, dict) else None


def _overrides(path: Path) -> list[str] | None:
    from runner.folders.foreign_config import plain_config

    lines = plain_config(path) if path.is_file() else None
    return [str(line) for line in lines] if isinstance(lines, list) else None


# ------------------------------------------------------------------------------------------------- comparison
def compare(a: Side, b: Side) -> dict[str, Any]:
    """The whole comparison, as the JSON object ``--json`` prints."""
    sections = {
        "config": config_section(a, b),
        "code": records_section(a, b, _code),
        "packages": records_section(a, b, lambda record: _mapping(record.get("packages"))),
        "launch": records_section(a, b, _launch),
        "environment": records_section(a, b, lambda record: _mapping(record.get("environment"))),
        "data_order": data_order_section(a, b),
        "state": state_section(a, b),
        "metrics": metrics_section(a, b),
    }
    same = all(section["same"] is not False for section in sections.values())
    return {"a": _described(a), "b": _described(b), "same": same, **sections}


def _described(side: Side) -> dict[str, Any]:
    return {
        "folder": str(side.folder),
        "kind": side.kind,
        "run_folder": str(side.run_dir) if side.run_dir else None,
        "step": side.step,
        "checkpoint": side.is_checkpoint,
        "launches": len(side.records),
    }


def config_section(a: Side, b: Side) -> dict[str, Any]:
    notes = [f"no config in {side.folder}" for side in (a, b) if side.config is None]
    if notes:
        return {"same": None, "differences": [], "ignored": [], "notes": notes}
    flat_a, flat_b = flatten(a.config), flatten(b.config)
    keys_a, keys_b = override_keys(a.overrides), override_keys(b.overrides)
    differences, ignored = [], []
    for key in [*flat_a, *(key for key in flat_b if key not in flat_a)]:
        value_a, value_b = flat_a.get(key, _MISSING), flat_b.get(key, _MISSING)
        if same_value(value_a, value_b):
            continue
        value_a, value_b = _expanded(value_a, flat_a), _expanded(value_b, flat_b)
        if same_value(value_a, value_b):
            continue
        if key in IGNORED_KEYS or key.startswith(IGNORED_PREFIXES):
            ignored.append(key)
            continue
        change = "added" if key not in flat_a else "removed" if key not in flat_b else "changed"
        reference = _reference(flat_a.get(key), flat_b.get(key))
        differences.append({
            "key": key, "change": change,
            "a": None if key not in flat_a else value_a, "b": None if key not in flat_b else value_b,
            "a_set_by": set_by(key, keys_a, reference=reference), "b_set_by": set_by(key, keys_b, reference=reference),
        })  # fmt: skip
    return {"same": not differences, "differences": differences, "ignored": ignored, "notes": []}


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A config's values by dotted key; a list, and an empty mapping, is one value."""
    if not isinstance(node, dict) or (not node and prefix):
        return {prefix: node}
    flat = {}
    for name, value in node.items():
        flat.update(flatten(value, f"{prefix}.{name}" if prefix else str(name)))
    return flat


def _expanded(value: Any, flat: dict[str, Any], depth: int = 0) -> Any:
    """``value`` with each ``${key}`` naming another key of the same config replaced by its value (as Hydra would
    resolve it; no resolver is called): a run's .hydra/config.yaml keeps them, a checkpoint's config.yaml not."""
    if not isinstance(value, str) or "${" not in value or depth > 10:
        return value
    whole = _REFERENCE.fullmatch(value)
    if whole is not None:
        return _expanded(flat[whole.group(1)], flat, depth + 1) if whole.group(1) in flat else value
    return _REFERENCE.sub(
        lambda found: str(_expanded(flat[found.group(1)], flat, depth + 1)) if found.group(1) in flat else found[0],
        value,
    )


def _reference(*values: Any) -> str | None:
    """The key that a value written as ``${key}`` names, on either side (a checkpoint's config has none left)."""
    for value in values:
        if isinstance(value, str) and (found := _REFERENCE.fullmatch(value)):
            return found.group(1)
    return None


def set_by(key: str, overrides: list[tuple[str, str]], *, reference: str | None = None) -> str:
    """The override that set ``key`` (the last of the most specific ones: the key itself, else a node or config
    group above it), else the one that set ``reference`` (the key that ``key``'s value ``${reference}`` names),
    else :data:`DEFAULT`. ``overrides``: :func:`override_keys` of the side's override lines."""
    best, depth = None, -1
    for name, line in overrides:
        if (key == name or key.startswith(name + ".")) and len(name) >= depth:
            best, depth = line, len(name)
    if best is None and reference is not None:
        return set_by(reference, overrides)
    return best or DEFAULT


def override_keys(lines: list[str]) -> list[tuple[str, str]]:
    """``(dotted key or config group, line)`` for each override line, as Hydra's parser reads its key."""
    from runner.config import ConfigError
    from runner.config import overrides as parsed

    found = []
    for line in lines:
        try:
            name = parsed.key(line)
        except ConfigError:  # a line Hydra cannot read: its text before "="
            name = line.split("=", 1)[0].lstrip("+~")
        found.append((name.split("@", 1)[0].replace("/", "."), line))
    return found


def _code(record: dict) -> dict[str, Any]:
    """The code a launch ran, by field: the runner's, then each repository's (named by its packages, not by where
    it was checked out)."""
    code = _mapping(record.get("code"))
    found = {f"runner.{name}": value for name, value in _mapping(code.get("runner")).items() if name != "root"}
    for root, repository in _mapping(code.get("repositories")).items():
        if not isinstance(repository, dict):
            continue
        packages = repository.get("packages") if isinstance(repository.get("packages"), list) else []
        name = ",".join(package for package in packages if isinstance(package, str)) or root
        found.update({f"{name}.{field}": repository.get(field) for field in ("commit", "dirty", "diff_sha256")})
    return found


def _launch(record: dict) -> dict[str, Any]:
    return {
        **flatten(_mapping(record.get("platform")), "platform"),
        **flatten(_mapping(record.get("launch")), "launch"),
    }


def _mapping(value: Any) -> dict:
    """A record's field that should be a mapping; {} for anything else (a record is data someone else wrote)."""
    return value if isinstance(value, dict) else {}


def records_section(a: Side, b: Side, facts) -> dict[str, Any]:
    """The ``facts`` of each side's first launch record that differ, and each later launch that changed them."""
    notes = a.record_notes() + b.record_notes()
    if notes:
        return {"same": None, "differences": [], "notes": notes}
    notes = [*a.unread_records, *b.unread_records]
    found_a, found_b = facts(a.records[0]), facts(b.records[0])
    differences = [
        {"name": name, "a": found_a.get(name), "b": found_b.get(name)}
        for name in sorted({*found_a, *found_b})
        if found_a.get(name) != found_b.get(name)
    ]
    for label, side in (("a", a), ("b", b)):
        resumes = [str(record.get("attempt", number)) for number, record in enumerate(side.records[1:], start=2)
                   if facts(record) != facts(side.records[0])]  # fmt: skip
        if len(resumes) == 1:
            notes.append(f"{label}: launch {resumes[0]} (a resume) differs from its first launch")
        elif resumes:
            notes.append(f"{label}: launches {', '.join(resumes)} (resumes) differ from its first launch")
    return {"same": not differences, "differences": differences, "notes": notes}


def data_order_section(a: Side, b: Side) -> dict[str, Any]:
    """Whether the first launches read their first batches alike, else the first batch that differs."""
    notes = a.record_notes() + b.record_notes()
    orders = [side.records[0].get("data_order") if side.records else None for side in (a, b)]
    for side, order in zip((a, b), orders, strict=True):
        if side.records and not isinstance(order, dict):
            notes.append(f"no data order in the first launch record of {side.run_dir}")
    if notes:
        return {"same": None, "a": None, "b": None, "first_different_batch": None, "notes": notes}
    order_a, order_b = orders
    same = order_a.get("digest") == order_b.get("digest") and order_a.get("first_batch") == order_b.get("first_batch")
    first_different, fewer = None, None
    if not same:
        batches_a, batches_b = _batches(order_a), _batches(order_b)
        index = next((i for i, (x, y) in enumerate(zip(batches_a, batches_b, strict=False)) if x != y), None)
        same_start = order_a.get("first_batch") == order_b.get("first_batch")
        if index is None and same_start and len(batches_a) != len(batches_b):
            # The same batches as far as both read: one side read fewer (a shorter run, or fewer digested).
            same, fewer = True, "a" if len(batches_a) < len(batches_b) else "b"
        elif index is not None:
            first = order_a.get("first_batch")
            first_different = (first if isinstance(first, int) else 0) + index
    shown = [{"first_batch": order.get("first_batch"), "digest": order.get("digest"),
              "batches": len(_batches(order))} for order in orders]  # fmt: skip
    return {"same": same, "a": shown[0], "b": shown[1], "first_different_batch": first_different,
            "fewer_batches": fewer, "notes": []}  # fmt: skip


def _batches(order: dict) -> list:
    return order["batches"] if isinstance(order.get("batches"), list) else []


def state_section(a: Side, b: Side) -> dict[str, Any]:
    """Two checkpoints' states and positions, bit for bit
    (:func:`~runner.folders.state_compare.checkpoint_differences`): the position first, then the first tensors
    that differ, at most :data:`STATE_LIMIT`."""
    from runner.engine.checkpoint import CheckpointError
    from runner.folders.state_compare import checkpoint_differences

    if not (a.is_checkpoint and b.is_checkpoint):
        runs = [label for label, side in (("a", a), ("b", b)) if not side.is_checkpoint]
        note = (f"{' and '.join(runs)} {'is a run' if len(runs) == 1 else 'are runs'}, not a checkpoint: name "
                "checkpoints (<run>/checkpoints/checkpoint_N) to compare their states")  # fmt: skip
        return {"same": None, "differences": [], "limited": False, "notes": [note]}
    try:
        found = checkpoint_differences(a.folder, b.folder, limit=STATE_LIMIT)
    except (CheckpointError, OSError, ValueError, RuntimeError) as error:  # damaged since its manifest was read
        return {"same": None, "differences": [], "limited": False, "notes": [f"not compared: {_sentence(error)}"]}
    rows = [{"what": found.what, "where": found.where, "detail": found.detail} for found in found]
    return {"same": not rows, "differences": rows, "limited": len(rows) >= STATE_LIMIT, "notes": []}


def _sentence(error: Exception) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def metrics_section(a: Side, b: Side) -> dict[str, Any]:
    """Per scalar both logged, the first step at which their values differ or that only one side logged (up to a
    checkpoint side's step); scalars one side lacks; final values."""
    scalars_a, scalars_b = _scalars(a), _scalars(b)
    notes = [f"no TensorBoard scalars in {side.run_dir or side.folder}/{LOGS_DIR}"
             for side, scalars in ((a, scalars_a), (b, scalars_b)) if not scalars]  # fmt: skip
    timings = sorted(tag for tag in {*scalars_a, *scalars_b} if is_timing(tag))
    if timings:
        notes.append(f"not compared: {', '.join(timings)} (speed and time, which differ between any two runs)")
    scalars_a, scalars_b = ({tag: points for tag, points in scalars.items() if tag not in timings}
                            for scalars in (scalars_a, scalars_b))  # fmt: skip
    cut_off = min((side.step for side in (a, b) if side.is_checkpoint and side.step is not None), default=None)
    differences, beyond = [], False
    for tag in (tag for tag in scalars_a if tag in scalars_b):
        values_a, values_b = dict(scalars_a[tag]), dict(scalars_b[tag])
        for step in sorted({*values_a, *values_b}):
            if cut_off is not None and step > cut_off:
                beyond = beyond or (step in values_a) != (step in values_b)
                break
            value_a, value_b = values_a.get(step), values_b.get(step)
            if step not in values_a or step not in values_b or not same_value(value_a, value_b):
                differences.append(_divergence(tag, step, value_a, value_b))
                break
    differences.sort(key=lambda row: (row["step"], row["tag"]))
    if beyond:
        which = "the earlier checkpoint" if a.is_checkpoint and b.is_checkpoint else "the checkpoint"
        notes.append(f"steps after {cut_off}, where {which} was saved, are not compared")
    final, final_notes = _final_differences(a, b)
    only_a, only_b = sorted(set(scalars_a) - set(scalars_b)), sorted(set(scalars_b) - set(scalars_a))
    return {
        "same": not (differences or only_a or only_b or final),
        "first_divergence": differences[0] if differences else None,
        "differences": differences,
        "only_in_a": only_a,
        "only_in_b": only_b,
        "final": final,
        "notes": notes + final_notes,
    }


def _scalars(side: Side) -> dict[str, list[tuple[int, float]]]:
    from runner.sweeps.report import read_scalars

    if side.run_dir is None:
        return {}
    found = read_scalars(side.run_dir / LOGS_DIR)
    if side.step is not None:
        found = {tag: [point for point in points if point[0] <= side.step] for tag, points in found.items()}
    return {tag: points for tag, points in found.items() if points}


def _divergence(tag: str, step: int, value_a: float | None, value_b: float | None) -> dict[str, Any]:
    """A scalar's first difference: both values (None for the side that did not log the step), and by how much."""
    difference = value_b - value_a if value_a is not None and value_b is not None else None
    relative = difference / abs(value_a) if difference is not None and value_a and math.isfinite(value_a) else None
    return {"tag": tag, "step": step, "a": value_a, "b": value_b, "difference": difference, "relative": relative}


def _final_differences(a: Side, b: Side) -> tuple[list[dict[str, Any]], list[str]]:
    """The metrics.json values that differ (its times left out); a checkpoint's side only where its run ended at
    the checkpoint's step."""
    from runner.folders.layout import final_metrics

    finals, notes = [], []
    for side in (a, b):
        found = final_metrics(side.run_dir) if side.run_dir else {}
        if found and side.step is not None and found.get("step") != side.step:
            notes.append(f"{side.run_dir / METRICS_FILE} is of step {found.get('step')}, not the checkpoint's "
                         f"{side.step}: final metrics not compared")  # fmt: skip
            found = {}
        finals.append(found)
    if not (finals[0] and finals[1]):
        return [], notes
    names = [*finals[0], *(name for name in finals[1] if name not in finals[0])]
    return [
        {"metric": name, "a": finals[0].get(name), "b": finals[1].get(name)}
        for name in names
        if not is_timing(name) and not same_value(finals[0].get(name), finals[1].get(name))
    ], notes


# -------------------------------------------------------------------------------------------------- rendering
def render(report: dict[str, Any]) -> str:
    """The comparison for a terminal: the two sides, then one heading per section, its differences indented."""
    lines = [f"{label}: {report[label]['folder']} ({_kind(report[label])})" for label in ("a", "b")]
    config = report["config"]
    lines += _heading("config", config, "key", "keys")
    lines += _rows([["key", "a", "b"]] + [
        [row["key"], _setting(row, "a"), _setting(row, "b")] for row in config["differences"]
    ])  # fmt: skip
    if config["ignored"]:
        lines.append(f"  not compared: {', '.join(config['ignored'])} (where each run writes)")
    for name, title, column in (("code", "code", "field"), ("packages", "packages", "package"),
                                ("launch", "hardware and launch", "field"),
                                ("environment", "environment", "variable")):  # fmt: skip
        section = report[name]
        lines += _heading(title, section, column, f"{column}s" if name != "packages" else "packages")
        short = name == "code"
        lines += _rows([[column, "a", "b"]] + [
            [row["name"], _shown(row["a"], short_digests=short), _shown(row["b"], short_digests=short)]
            for row in section["differences"]
        ])  # fmt: skip
    lines += _data_order_lines(report["data_order"])
    if report["a"]["checkpoint"] or report["b"]["checkpoint"]:  # two runs: no state to compare, nothing to say
        lines += _state_lines(report["state"])
    lines += _metrics_lines(report["metrics"])
    return "\n".join(lines)


def _kind(side: dict[str, Any]) -> str:
    launches = side["launches"]
    return f"{side['kind']}; {launches} launch{'es' if launches != 1 else ''}" if launches else side["kind"]


def _heading(title: str, section: dict[str, Any], one: str, many: str) -> list[str]:
    count = len(section["differences"])
    if section["same"] is None:
        state = "not compared"
    elif count:
        state = f"{count} {one if count == 1 else many} differ{'s' if count == 1 else ''}"
    else:
        state = "same"
    return [f"{title}: {state}", *(f"  {note}" for note in section["notes"])]


def _rows(rows: list[list[str]]) -> list[str]:
    from runner.cli import status

    return [f"  {line}" for line in status.table(rows).splitlines()] if len(rows) > 1 else []


def _setting(row: dict[str, Any], label: str) -> str:
    absent = row["change"] == ("added" if label == "a" else "removed")
    value = "(absent)" if absent else _shown(row[label], none="null")
    setter = row[f"{label}_set_by"]
    if setter == DEFAULT:
        return value if absent else f"{value} {DEFAULT}"
    return f"{value} ({setter})"


def _shown(value: Any, *, none: str = ABSENT, short_digests: bool = False) -> str:
    """A value in a table: ``none`` for None, YAML's spelling of booleans, digests and commits to 12 characters with
    ``short_digests``, lists and mappings as JSON, floats as short as they read back the same."""
    if value is None:
        return none
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value[:12] if short_digests and _HEX.fullmatch(value) else value or '""'
    if isinstance(value, (list, dict)):
        return json.dumps(value, default=str)
    return _number(value) if isinstance(value, float) else str(value)


def _number(value: float) -> str:
    """A logged value as short as it reads back the same (TensorBoard keeps 32-bit floats)."""
    import numpy

    single = numpy.float32(value)
    return str(single) if float(single) == value else repr(value)


def _logged(value: float | None) -> str:
    """A logged value in the metrics table; ``-`` where that side did not log the step."""
    return ABSENT if value is None else _number(value)


def as_plain_json(value: Any) -> Any:
    """``value`` as strict JSON holds it: a float that is not finite as the string "NaN", "Infinity" or "-Infinity"
    (JSON has no such numbers), any other value that is not JSON's as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {str(key): as_plain_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_plain_json(item) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _data_order_lines(section: dict[str, Any]) -> list[str]:
    notes = [f"  {note}" for note in section["notes"]]
    if section["same"] is None:
        return ["data order: not compared", *notes]
    a, b = section["a"], section["b"]
    if section["same"] and section.get("fewer_batches"):
        fewer = section["fewer_batches"]
        counts = f"{section[fewer]['batches']} vs {section['b' if fewer == 'a' else 'a']['batches']}"
        return [f"data order: same as far as both read, from batch {a['first_batch']}; {fewer} read fewer batches "
                f"({counts})"]  # fmt: skip
    if section["same"]:
        digest = _shown(a["digest"], short_digests=True)
        return [f"data order: same ({a['batches']} batches from batch {a['first_batch']}, digest {digest})"]
    first = section["first_different_batch"]
    where = f"from batch {first}" if first is not None else f"a from batch {a['first_batch']}, b {b['first_batch']}"
    rows = [["", "first batch", "batches", "digest"]]
    for label, side in (("a", a), ("b", b)):
        rows.append([label, str(side["first_batch"]), str(side["batches"]), _shown(side["digest"], short_digests=True)])
    return [f"data order: differs {where}", *_rows(rows)]


def _state_lines(section: dict[str, Any]) -> list[str]:
    count = len(section["differences"])
    if section["same"] is None:
        state = "not compared"
    elif count:
        state = f"{count} difference{'s' if count != 1 else ''}" + (" (the first ones)" if section["limited"] else "")
    else:
        state = "same"
    notes = [f"  {note}" for note in section["notes"]]
    rows = [f"  {row['what']}: {row['where']}: {row['detail']}" if row["where"] else f"  {row['what']}: {row['detail']}"
            for row in section["differences"]]  # fmt: skip
    return [f"state: {state}", *notes, *rows]


def _metrics_lines(section: dict[str, Any]) -> list[str]:
    first = section["first_divergence"]
    if section["same"]:
        state = "same"
    elif first is not None:
        state = f"first differ at step {first['step']} ({first['tag']})"
    else:
        reasons = []
        if section["only_in_a"] or section["only_in_b"]:
            reasons.append("scalars one side lacks")
        if section["final"]:
            reasons.append("final values")
        state = f"differ in {' and '.join(reasons)}"
    lines = [f"metrics: {state}", *(f"  {note}" for note in section["notes"])]
    lines += _rows([["tag", "step", "a", "b", "b - a", "relative"]] + [
        [row["tag"], str(row["step"]), _logged(row["a"]), _logged(row["b"]),
         f"{row['difference']:+.3g}" if row["difference"] is not None else ABSENT,
         f"{100 * row['relative']:+.3g}%" if row["relative"] is not None else ABSENT]
        for row in section["differences"]
    ])  # fmt: skip
    for label in ("a", "b"):
        if section[f"only_in_{label}"]:
            lines.append(f"  only {label} logged: {', '.join(section[f'only_in_{label}'])}")
    if section["final"]:
        lines.append(f"  final values ({METRICS_FILE}):")
        lines += [f"  {line}" for line in _rows([["metric", "a", "b"]] + [
            [row["metric"], _shown(row["a"]), _shown(row["b"])] for row in section["final"]
        ])]  # fmt: skip
    return lines
