"""``runner runs [FOLDER]``: every run under a folder (``outputs/`` unless named), newest first, one row each.

    runner runs
    folder               experiment  status                step     objective      last  best  duration     resumes
    2026-12-07/09-12-40  mnist_ddp   running               120/300  eval/accuracy  0.87  0.87  4 min 10 s   0
    lr_sweep             mnist       3 finished, 1 failed  -        eval/accuracy  -     0.94  12 min 03 s  1
    2026-12-04/18-30-02  -           preempted             125/300  eval/loss      0.81  0.62  2 h 01 min   2

    runner runs --status failed,preempted --since 2d
    runner runs outputs/multirun/2026-12-05/10-00-00     (a sweep: its row, then one row per job)
    runner runs --expand optimizer.lr=0.001 --json

A run folder holds run.log, .hydra/, checkpoints/, provenance/ or metrics.json; a sweep folder holds multirun.yaml or
job folders (job.json), and shows as one row (its jobs counted by status, the best objective of any job) that
``--expand`` opens into one row per job; a sweep named as FOLDER is always expanded (see
:mod:`runner.folders.kinds`).

A run is running (a live process holds its folder's lock), finished (its last launch logged "Finished", or it has
a metrics.json), failed (its last launch logged "Failed: ..."), preempted (stopped by a scheduler's signal at a
step all processes agreed on, with a checkpoint saved: ``runner resume=RUN`` continues it) or interrupted (none of
these: killed, or its machine went away). A sweep's job takes its status from its job.json (stopped and requeued
jobs are preempted; a job of the grid that has not started is pending). step is the furthest step logged or
checkpointed, of the max steps; last and best are the values of the config's objective (objective.metric, in its
direction) from the TensorBoard logs (that tag alone is read), else metrics.json; duration is the wall time
metrics.json or job.json records, else the time from the first launch to run.log's last line (the time the line
gives, which a copy keeps); resumes counts the launches after the first (provenance/, else, for a run begun
before launch records were kept, the "Resumed at step" lines of run.log).

Filters (a sweep is listed when any of its jobs passes all of them, and expanded to those jobs):
  --status STATUS[,STATUS]  running, finished, failed, preempted, interrupted or pending (repeatable)
  --since DATE|AGE          started since 2026-12-01 (or 2026-12-01T10:00, local time), or within 30m, 3h, 2d, 1w
  key=value                 the run's config, as written in .hydra/config.yaml, has that value (compared as text and
                            as numbers: optimizer.lr=1e-3 matches 0.001; key=a,b matches either; experiment=NAME too)
Output:
  --expand                  every sweep's jobs, each under its sweep's row
  --json                    a JSON list of the rows (sweeps with their jobs), for scripts

Everything is read from the folders as data (JSON, YAML, run.log, TensorBoard's event files): nothing in them is
imported, resolved or run, and nothing is written; a sweep job is read from its own folder, wherever its job.json
says it ran. Links are not followed: a run or sweep holding a symbolic link is skipped with a note (refused, when it
is FOLDER itself; see :func:`runner.folders.layout.check_no_links`), and so is a folder that cannot be read. Hidden
folders (.git, .venv) and Python's own trees (__pycache__, site-packages, a virtual environment) are not searched.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.config import ConfigError
from runner.folders.kinds import is_run_folder, is_sweep_folder
from runner.folders.layout import CONFIG_FILE, HYDRA_DIR, HYDRA_OVERRIDES_FILE, LOGS_DIR, MULTIRUN_FILE
from runner.folders.run_log import first_logged, last_logged, messages

if TYPE_CHECKING:
    from runner.sweeps.report import Job

USAGE = "usage: runner runs [FOLDER] [--status STATUS[,STATUS]] [--since DATE|AGE] [--expand] [--json] [key=value ...]"
DEFAULT_FOLDER = "outputs"
RUNNING, FINISHED, FAILED, PREEMPTED, INTERRUPTED, PENDING = (
    "running", "finished", "failed", "preempted", "interrupted", "pending",
)  # fmt: skip
STATUSES = (RUNNING, FINISHED, FAILED, PREEMPTED, INTERRUPTED, PENDING)  # also the order a sweep counts them in
COLUMNS = ("folder", "experiment", "status", "step", "objective", "last", "best", "duration", "resumes")
AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}

# run.log's messages that mark where a launch starts and how it ended (runner.launch.worker, the recipes,
# runner.cli.app and runner.cli.report write them).
LAUNCH_STARTS = ("Running recipe ", "Resumed at step ")
RESUMED, RUN_FOLDER = "Resumed at step ", "Run folder: "
FAILED_LINE, STOPPED_LINE, FINISHED_LINE = "Failed: ", "Stopped after ", "Finished"
NOT_SEARCHED = ("__pycache__", "node_modules", "site-packages")  # trees of code, never of runs (nor hidden ones)
_MISSING = object()  # a key the config does not have: no filter value matches it
_AGE = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


@dataclass(frozen=True)
class Query:
    """What to list: the folder, the filters, and how."""

    folder: Path
    statuses: frozenset[str] = frozenset()
    since: float | None = None  # seconds since the epoch
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (key, the values it may have)
    expand: bool = False
    as_json: bool = False


@dataclass
class Row:
    """One run, sweep or sweep job, as listed."""

    folder: Path
    name: str  # as shown: relative to the folder listed
    kind: str  # run, sweep or job
    experiment: str = "-"
    status: str = INTERRUPTED  # a sweep's: its jobs counted by status, "3 finished, 1 failed"
    step: int | None = None
    max_steps: int | None = None
    objective: str | None = None
    direction: str = "maximize"
    last: float | None = None
    best: float | None = None
    started: float | None = None  # seconds since the epoch: its first launch (provenance/, run.log's first line)
    ended: float | None = None  # its last record: run.log's last line, or a job's end in job.json
    duration_s: float | None = None
    resumes: int = 0
    config: Any = None  # the run's .hydra/config.yaml, plain and unresolved (the filters read it)
    jobs: list[Row] = field(default_factory=list)  # a sweep's, those that pass the filters
    job_counts: dict[str, int] = field(default_factory=dict)  # a sweep's jobs by status, all of them


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(f"{USAGE}\n\n{__doc__.split(chr(10) * 2, 1)[1]}", end="")
        return 0
    from runner.folders.layout import check_no_links

    try:
        query = read_query(argv, now=time.time())
    except ConfigError as error:
        print(f"runner: error: {error}", file=sys.stderr)
        return 2
    folder = query.folder
    if not folder.is_dir():
        print(f"runner: error: {folder} is not a folder; pass a folder of runs (outputs/ by default), a run folder "
              "or a sweep folder.", file=sys.stderr)  # fmt: skip
        return 2
    found, skipped = find(folder)
    if not found:
        for note in skipped:
            print(f"runner: skipped {note}", file=sys.stderr)
        print(
            f"runner: error: {folder} holds no run (run.log, checkpoints/, .hydra/) and no sweep (multirun.yaml, job "
            "folders); pass a folder of runs, a run folder or a sweep folder.",
            file=sys.stderr,
        )
        return 2
    rows = []
    for path in found:
        try:
            check_no_links(path)
        except ConfigError as error:
            if path == folder:
                print(f"runner: error: {error}", file=sys.stderr)
                return 2
            skipped.append(f"{path}: {error}")
            continue
        except OSError as error:  # a folder inside it we may not look into
            skipped.append(f"{path}: {_unreadable(error, path)}")
            continue
        try:
            rows.append(read_sweep(path, root=folder) if is_sweep_folder(path) else read_run(path, root=folder))
        except OSError as error:
            skipped.append(f"{path}: {_unreadable(error, path)}")
        except ConfigError as error:  # a record it holds says something no run of ours writes
            skipped.append(f"{path}: {error}")
    for note in skipped:
        print(f"runner: skipped {note}", file=sys.stderr)
    listed = sorted(filter(None, (matching(row, query) for row in rows)), key=_newest_first)
    if query.as_json:
        print(json.dumps([as_json(row) for row in listed], indent=1))
    elif listed:
        print(table(listed, expand=query.expand or folder in found and is_sweep_folder(folder)))
    if rows and not listed:
        print(f"runner: no run under {folder} passes the filters.", file=sys.stderr)
    return 0


def read_query(argv: list[str], *, now: float) -> Query:
    """The command line as a :class:`Query`.

    Raises:
        ConfigError: An unknown option, a bad value, or a second folder (one sentence).
    """
    folder, statuses, since, where, expand, as_json = None, set(), None, [], False, False
    arguments = iter(argv)
    for argument in arguments:
        option, has_value, value = argument.partition("=")
        if option in ("--status", "--since"):
            if not has_value:
                value = next(arguments, None)
                if value is None or value.startswith("--"):
                    example = "failed" if option == "--status" else "2d"
                    raise ConfigError(f"{option} needs a value, e.g. {option} {example}.")
            if option == "--status":
                statuses |= _statuses(value)
            else:
                since = _since(value, now=now)
        elif argument in ("--expand", "--json"):
            expand, as_json = expand or argument == "--expand", as_json or argument == "--json"
        elif argument.startswith("-"):
            raise ConfigError(f"{argument} is not an option of runner runs; {USAGE}")
        elif has_value and not os.path.isdir(argument):  # a sweep job's folder may be named lr=0.1
            where.append(_filter(argument))
        elif folder is None:
            folder = argument
        else:
            raise ConfigError(
                f"runner runs lists one folder, and {argument} is a second one; list each in its own command."
            )
    folder = Path(folder or DEFAULT_FOLDER)
    try:
        folder = folder.expanduser()
    except RuntimeError:  # ~name of no user: a folder named so, or none
        pass
    return Query(
        folder=folder.absolute(),
        statuses=frozenset(statuses),
        since=since,
        where=tuple(where),
        expand=expand,
        as_json=as_json,
    )


def _statuses(value: str) -> set[str]:
    given = {status.strip() for status in value.split(",") if status.strip()}
    unknown = sorted(given - set(STATUSES))
    if unknown or not given:
        raise ConfigError(
            f"--status {value} is not a status; pass one or more of {', '.join(STATUSES)} (e.g. --status "
            "failed,preempted)."
        )
    return given


def _since(value: str, *, now: float) -> float:
    if (age := _AGE.fullmatch(value.strip())) is not None:
        return now - float(age.group(1)) * AGE_UNITS[age.group(2)]
    try:
        return datetime.fromisoformat(value.strip()).timestamp()  # without an offset: local time
    except ValueError:
        raise ConfigError(
            f"--since {value} is neither a date (2026-12-01, 2026-12-01T10:00) nor an age (30m, 3h, 2d, 1w); pass "
            "one of those."
        ) from None


def _filter(line: str) -> tuple[str, tuple[str, ...]]:
    """``key=value`` read with Hydra's grammar (quotes, ``1e-3``), ``key=a,b`` as either value."""
    from runner.config import overrides as parsed

    override = parsed.parse([line])[0]
    if override.is_delete() or override.is_add() or override.is_force_add():
        raise ConfigError(f"{line} is not a filter; filter on a key's value with key=value, e.g. optimizer.lr=0.001.")
    if override.is_sweep_override():
        try:
            return override.key_or_group, tuple(str(value) for value in override.sweep_string_iterator())
        except Exception:  # a range or an interval: not a list of values
            raise ConfigError(f"{line} is not a filter; give a value, or values separated by commas.") from None
    return override.key_or_group, (parsed.text(override),)


# ---------------------------------------------------------------------------------------------------- finding
def find(folder: Path) -> tuple[list[Path], list[str]]:
    """The run and sweep folders in ``folder`` (``folder`` itself, if it is one), and a note for each link to a
    folder that was not followed and each folder that could not be read. The folders inside a run or a sweep are
    its own (checkpoints, jobs); hidden folders and trees of code (:data:`NOT_SEARCHED`, a virtual environment)
    hold no runs and are not searched."""
    found, skipped, pending = [], [], [folder]
    while pending:
        current = pending.pop()
        if is_sweep_folder(current) or is_run(current):
            found.append(current)
            continue
        try:
            entries = sorted(os.scandir(current), key=lambda entry: entry.name, reverse=True)
        except OSError as error:
            skipped.append(f"{current}: {_unreadable(error, current)}")
            continue
        for entry in entries:
            if entry.is_symlink():
                if os.path.isdir(entry.path):
                    skipped.append(f"{entry.path}: it is a symbolic link (to {os.readlink(entry.path)}), not followed.")
            elif entry.is_dir() and _searched(entry):
                pending.append(Path(entry.path))
    return found, skipped


def _searched(entry: os.DirEntry) -> bool:
    """Whether a folder met in the walk may hold runs: not a hidden one, a tree of code or a virtual environment."""
    if entry.name.startswith(".") or entry.name in NOT_SEARCHED:
        return False
    try:
        return not os.path.isfile(os.path.join(entry.path, "pyvenv.cfg"))
    except OSError:
        return True


def _unreadable(error: OSError, folder: Path) -> str:
    """The note for ``folder``, which could not be read (``error``: what reading it, or a file in it, raised)."""
    what = "it" if error.filename in (None, str(folder)) else str(error.filename)
    return f"{what} cannot be read ({error.strerror or error})."


def is_run(folder: Path) -> bool:
    """A run folder (:func:`~runner.folders.kinds.is_run_folder`), or one a run starting has just claimed (its lock
    is held, and nothing is written yet)."""
    from runner.launch.lock import is_locked

    return is_run_folder(folder) or is_locked(folder)


# ---------------------------------------------------------------------------------------------------- reading
def read_run(run: Path, *, root: Path, job: Job | None = None, name: str | None = None) -> Row:
    """One run folder as a row; a sweep's ``job`` (from :func:`runner.sweeps.report.collect`) gives its status,
    objective, curves and wall time."""
    from runner.folders.foreign_config import plain_config
    from runner.folders.layout import final_metrics
    from runner.folders.run_log import latest_step
    from runner.sweeps.report import read_scalars

    config = plain_config(run / HYDRA_DIR / CONFIG_FILE)
    config = config if isinstance(config, dict) else {}
    metrics = final_metrics(run)
    metric, direction = _select(config, "objective.metric"), _select(config, "objective.direction")
    if job is not None and job.objective:  # what the sweeper optimised, as the job recorded it
        metric, direction = job.objective, job.direction
    row = Row(
        folder=run,
        name=name or _shown(run, root),
        kind="run" if job is None else "job",
        experiment=experiment(run),
        objective=metric if isinstance(metric, str) else None,
        direction=direction if direction in ("maximize", "minimize") else "maximize",
        config=config,
    )
    step, values = latest_step(run)
    done, _, most = step.partition("/")
    steps = [int(done) if done.isdigit() else None, _integer(metrics.get("step")), _checkpoint_step(run)]
    row.step = max((step for step in steps if step is not None), default=None)
    row.max_steps = int(most) if most.isdigit() else _integer(_select(config, "trainer.max_steps"))
    if job is not None:
        curves = job.curves
    else:  # the objective's tag alone: a run's logs may hold thousands of other points
        curves = read_scalars(run / LOGS_DIR, tags={row.objective}) if row.objective else {}
    row.last, row.best = _objective_values(row, curves=curves, metrics=metrics, logged=values)
    _place_in_time(row, job=job, metrics=metrics)
    row.status = run_status(run, metrics=metrics) if job is None else _job_status(job.status, locked=True)
    return row


def _place_in_time(row: Row, *, job: Job | None, metrics: dict) -> None:
    """The run's start (its first launch's record, or run.log's first line), end (run.log's last line, or a job's
    recorded end), duration and resumes."""
    run = row.folder
    first_record = _first_launch_record(run)
    starts = [_time(first_record.get("started_at")) if first_record else None, first_logged(run)]
    row.started = min((start for start in starts if start is not None), default=_mtime(run))
    ends = [last_logged(run), _time(job.recorded_at) if job is not None and job.status != RUNNING else None]
    row.ended = max((end for end in ends if end is not None), default=None)
    row.resumes = _resumes(run, first_record=first_record)
    wall_time = _number(job.wall_time_s) if job is not None else None
    wall_time = wall_time if wall_time is not None else _number(metrics.get("wall_time_s"))
    if wall_time is None and row.started is not None and row.ended is not None and row.ended >= row.started:
        wall_time = row.ended - row.started  # no record of it: from its first launch to its last log line
    row.duration_s = wall_time


def _first_launch_record(run: Path) -> dict | None:
    """The record of the run's first launch (provenance/attempt_1.json), None where there is none: the run began
    before records were kept (its first record is of a resume), or the record is not a JSON object."""
    from runner.folders.launch_record import attempt_files

    files = attempt_files(run)
    if not files or files[0].name != "attempt_1.json":
        return None
    try:
        record = json.loads(files[0].read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and not record.get("resume") else None


def _resumes(run: Path, *, first_record: dict | None) -> int:
    """The launches after the first: one record each, where the first launch left one; else run.log's "Resumed
    at step" lines (a run begun before records were kept has records of its later launches only)."""
    from runner.folders.launch_record import attempt_files

    if first_record is not None:
        return len(attempt_files(run)) - 1
    return sum(message.startswith(RESUMED) for _, message in messages(run))


def _objective_values(row: Row, *, curves: dict, metrics: dict, logged: dict) -> tuple[float | None, float | None]:
    """The objective's last and best values: from its curve, else metrics.json's final value (both), else the last
    value run.log shows (no best: one value is not a curve)."""
    curve = curves.get(row.objective) if row.objective else None
    if curve:
        pick = max if row.direction == "maximize" else min
        return curve[-1][1], pick(value for _, value in curve)
    final = _number(metrics.get(row.objective)) if row.objective else None
    if final is not None:
        return final, final
    return _number(logged.get(row.objective)) if row.objective else None, None


def _checkpoint_step(run: Path) -> int | None:
    """The step of the run's newest complete checkpoint (its manifest's), e.g. of a run stopped between two logged
    steps."""
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint, read_manifest
    from runner.engine.checkpoint.errors import CheckpointError

    try:
        newest, _ = newest_intact_checkpoint(checkpoints_dir(run), verify_checksums=False)
        return _integer(read_manifest(newest, verify_checksums=False).get("step")) if newest is not None else None
    except (CheckpointError, OSError):  # damaged since, or unreadable: the log's step stands
        return None


def run_status(run: Path, *, metrics: dict) -> str:
    """running, finished, failed, preempted or interrupted: what its lock, its last launch's lines in run.log and
    its metrics.json say (a sweep job's folder: its job.json)."""
    from runner.launch.lock import is_locked
    from runner.sweeps.jobs import read_job

    if is_locked(run):
        return RUNNING
    if (record := read_job(run)) is not None and isinstance(record.get("status"), str):
        return _job_status(record["status"], locked=False)  # a sweep job records its end there, not in run.log
    ended = [message for message in _last_launch(run) if message.startswith((FAILED_LINE, STOPPED_LINE, FINISHED_LINE))]
    if ended and ended[-1].startswith(FAILED_LINE):
        return FAILED
    if ended and ended[-1].startswith(STOPPED_LINE):
        return PREEMPTED
    return FINISHED if ended or metrics else INTERRUPTED


def _job_status(status: str, *, locked: bool) -> str:
    """A job.json status as a run's: stopped and requeued jobs were preempted; a record left saying running by a
    process that no longer holds the job's lock was interrupted (:func:`runner.sweeps.report.collect` says running
    only while it is ``locked``)."""
    from runner.sweeps.jobs import REQUEUED, STOPPED

    if status == RUNNING:
        return RUNNING if locked else INTERRUPTED
    return {STOPPED: PREEMPTED, REQUEUED: PREEMPTED}.get(status, status)


def read_sweep(sweep: Path, *, root: Path) -> Row:
    """A sweep folder as a row (its jobs counted by status, the best objective of any job), with its jobs."""
    from runner.config import overrides as parsed
    from runner.sweeps.report import collect

    name = _shown(sweep, root)
    jobs = []
    for job in collect(sweep, objective_curves_only=True):
        folder = sweep / job.name
        if job.status == PENDING or not folder.is_dir():
            try:
                chosen = parsed.value(job.overrides, "experiment")
            except ConfigError:
                chosen = None
            jobs.append(Row(folder=folder, name=f"{name}/{job.name}", kind="job", status=PENDING,
                            experiment=chosen or "-", objective=job.objective))  # fmt: skip
        else:
            jobs.append(read_run(folder, root=root, job=job, name=f"{name}/{job.name}"))
    return summarize(Row(folder=sweep, name=name, kind="sweep"), jobs)


def summarize(sweep: Row, jobs: list[Row]) -> Row:
    """``sweep`` with what its ``jobs`` add up to: their statuses counted, the best of their objectives, the span
    from the first start to the last end, and every resume."""
    sweep.jobs = jobs
    sweep.job_counts = dict(_in_order(Counter(job.status for job in jobs)))
    sweep.status = ", ".join(f"{n} {status}" for status, n in sweep.job_counts.items()) or "no jobs"
    experiments = sorted({job.experiment for job in jobs if job.experiment != "-"})
    sweep.experiment = ",".join(experiments) or "-"
    objectives = [job.objective for job in jobs if job.objective]
    sweep.objective = objectives[0] if objectives else None
    sweep.direction = next((job.direction for job in jobs if job.objective == sweep.objective), "maximize")
    scored = [job.best for job in jobs if job.objective == sweep.objective and job.best is not None]
    sweep.best = (max if sweep.direction == "maximize" else min)(scored) if scored else None
    starts = [job.started for job in jobs if job.started is not None]
    ends = [job.ended for job in jobs if job.ended is not None]
    sweep.started = min(starts) if starts else _mtime(sweep.folder / MULTIRUN_FILE) or _mtime(sweep.folder)
    sweep.ended = max(ends) if ends else None
    if sweep.started is not None and sweep.ended is not None and sweep.ended >= sweep.started:
        sweep.duration_s = sweep.ended - sweep.started
    sweep.resumes = sum(job.resumes for job in jobs)
    return sweep


def _in_order(counts: Counter) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda item: STATUSES.index(item[0]) if item[0] in STATUSES else len(STATUSES))


def experiment(run: Path) -> str:
    """The experiment the run was composed with (the config itself does not keep it): the ``experiment=`` it was
    given, else Hydra's record of its choices; ``-`` for none."""
    from runner.config import overrides as parsed
    from runner.folders.foreign_config import plain_config

    overrides = plain_config(run / HYDRA_DIR / HYDRA_OVERRIDES_FILE)
    if isinstance(overrides, list) and all(isinstance(line, str) for line in overrides):
        try:
            chosen = parsed.value(overrides, "experiment")
        except ConfigError:  # a line Hydra cannot read: Hydra's record below says what was composed
            chosen = None
        if chosen not in (None, "null"):
            return chosen
    hydra = plain_config(run / HYDRA_DIR / "hydra.yaml")
    chosen = _select(hydra, "hydra.runtime.choices.experiment") if isinstance(hydra, dict) else None
    return chosen if isinstance(chosen, str) and chosen else "-"


def _last_launch(run: Path) -> list[str]:
    """The messages the run's last launch logged: those after the last line that starts one."""
    lines = []
    for _, message in messages(run, tail=True):
        if message.startswith(LAUNCH_STARTS) or _opens_launch(message):
            lines = []
        lines.append(message)
    return lines


def _opens_launch(message: str) -> bool:
    """Whether ``message`` is a launch's first line, ``Run folder: <run>`` (a closing line names its checkpoint)."""
    return message.startswith(RUN_FOLDER) and "; newest checkpoint" not in message


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _time(text: Any) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None


def _shown(path: Path, root: Path) -> str:
    return path.name if path == root else str(path.relative_to(root))


def _select(config: Any, key: str, default: Any = None) -> Any:
    """The value at a dotted ``key`` of a plain config (list items by index), or ``default`` where it has none."""
    node = config
    for part in key.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return default
    return node


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -------------------------------------------------------------------------------------------------- filtering
def matching(row: Row, query: Query) -> Row | None:
    """``row`` if it passes the query's filters (a sweep: with those of its jobs that pass), else None."""
    if row.kind != "sweep":
        return row if passes(row, query) else None
    jobs = [job for job in row.jobs if passes(job, query)]
    if not jobs:
        return None
    row.jobs = jobs
    return row


def passes(row: Row, query: Query) -> bool:
    if query.statuses and row.status not in query.statuses:
        return False
    if query.since is not None and (row.started is None or row.started < query.since):
        return False
    for key, wanted in query.where:
        found = row.experiment if key == "experiment" else _select(row.config, key, default=_MISSING)
        if not any(_equal(value, found) for value in wanted):
            return False
    return True


def _equal(wanted: str | None, found: Any) -> bool:
    """Whether a filter's value is the config's, as text or as a number (``1e-3`` is ``0.001``)."""
    if wanted is None or found is _MISSING or isinstance(found, (dict, list)):
        return False
    if found is None:
        return wanted.lower() in ("null", "none")
    if isinstance(found, bool):
        return wanted.lower() == str(found).lower()
    if str(found) == wanted:
        return True
    number, other = _number(wanted), _number(found)
    return number is not None and other is not None and number == other


# --------------------------------------------------------------------------------------------------- showing
def _newest_first(row: Row) -> float:
    return -(row.started if row.started is not None else -math.inf)


def table(rows: list[Row], *, expand: bool) -> str:
    """The rows under a header; each sweep's jobs under it with ``expand``."""
    from runner.cli import status

    lines = [list(COLUMNS)]
    for row in rows:
        lines.append(_cells(row))
        if expand:
            lines += [_cells(job, indent="  ") for job in row.jobs]
    return status.table(lines)


def _cells(row: Row, *, indent: str = "") -> list[str]:
    from runner.cli.report import duration

    step = "-" if row.step is None else f"{row.step}/{row.max_steps if row.max_steps is not None else '?'}"
    return [
        indent + row.name,
        row.experiment,
        row.status,
        step,
        row.objective or "-",
        _short(row.last),
        _short(row.best),
        duration(row.duration_s) if row.duration_s is not None else "-",
        str(row.resumes),
    ]


def _short(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def as_json(row: Row) -> dict[str, Any]:
    """A row as plain JSON values (times in ISO 8601, local; values that are not finite as null)."""
    listed = {
        "folder": str(row.folder),
        "kind": row.kind,
        "experiment": None if row.experiment == "-" else row.experiment,
        "status": row.status,
        "step": row.step,
        "max_steps": row.max_steps,
        "objective": row.objective,
        "direction": row.direction if row.objective else None,
        "last": _finite(row.last),
        "best": _finite(row.best),
        "started_at": None
        if row.started is None
        else datetime.fromtimestamp(row.started).astimezone().isoformat(timespec="seconds"),  # fmt: skip
        "duration_s": None if row.duration_s is None else round(row.duration_s, 3),
        "resumes": row.resumes,
    }
    if row.kind == "sweep":
        listed["jobs_by_status"] = row.job_counts
        listed["jobs"] = [as_json(job) for job in row.jobs]
    return listed


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
