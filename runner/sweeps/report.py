"""A sweep's summary: ``summary.csv``, ``summary.md`` and ``summary.png`` in the sweep folder.

    python -m runner.report outputs/multirun/2026-11-29/10-00-00

Written after every job and at the end of a multirun; this command rebuilds them at any time, also
while the sweep runs or after some jobs failed. Everything is read from the folders alone: each
job's ``job.json`` (overrides, status, error, wall time, objective; see runner.sweeps.job), its
``metrics.json`` (final metrics of a finished run) and its TensorBoard event files (the curves, and
the step where the objective was best), each in the job's own folder. Jobs of a grid sweep that have
not started yet are listed as pending. Configs are read as plain YAML: nothing in them is resolved.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import sys
import textwrap
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.config import overrides as parsed
from runner.files import write_atomically, write_text_atomically
from runner.folders.foreign_config import plain_config
from runner.folders.layout import HYDRA_DIR, HYDRA_OVERRIDES_FILE, LOGS_DIR, MULTIRUN_FILE, final_metrics
from runner.sweeps.jobs import JOB_FILE, read_job, swept_keys

SUMMARY_CSV, SUMMARY_MD, SUMMARY_PNG = "summary.csv", "summary.md", "summary.png"  # in the sweep folder
SUMMARY_FILES = (SUMMARY_CSV, SUMMARY_MD, SUMMARY_PNG)
LOSS = "train/loss"


@dataclass
class Job:
    """One row of the summary."""

    name: str  # the job's folder, relative to the sweep folder ("0", "1", ...)
    overrides: list[str]
    status: str  # finished, failed, running, interrupted, stopped, requeued, pending
    objective: str | None = None  # the metric a sweeper optimises, e.g. eval/accuracy
    direction: str = "maximize"
    metrics: dict[str, float] = field(default_factory=dict)  # final values
    best_step: int | None = None
    best_value: float | None = None
    wall_time_s: float | None = None
    error: str = ""
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    recorded_at: str | None = None  # when its record was last written (its end, else its start), ISO 8601

    @property
    def objective_value(self) -> float | None:
        return self.metrics.get(self.objective) if self.objective else None


def collect(sweep_dir: Path, *, objective_curves_only: bool = False) -> list[Job]:
    """Every job of the sweep in ``sweep_dir``: those with a folder, then the grid's pending ones.

    Each job is read from its own folder in ``sweep_dir``: the ``project_dir`` its job.json names is where it ran,
    which a moved or copied sweep no longer is (and a folder written elsewhere could name any path), so it is
    never followed. ``objective_curves_only``: read only each job's objective from its TensorBoard logs (its
    curves and metrics then hold that one), for a listing that shows nothing else.
    """
    from runner.launch.lock import is_locked

    jobs = []
    for folder in _job_folders(sweep_dir):
        record = read_job(folder) or {}
        overrides = _strings(record.get("overrides")) or _hydra_overrides(folder)
        status = record.get("status") if isinstance(record.get("status"), str) else "interrupted"
        if status == "running" and not is_locked(folder):
            status = "interrupted"  # its process is gone: killed, or its machine went away
        objective = record.get("objective") if isinstance(record.get("objective"), dict) else {}
        name, direction = objective.get("name"), objective.get("direction")
        ended_at, started_at = record.get("ended_at"), record.get("started_at")
        job = Job(
            name=str(folder.relative_to(sweep_dir)),
            overrides=overrides,
            status=status,
            objective=name if isinstance(name, str) and name else None,
            direction=direction if direction in ("maximize", "minimize") else "maximize",
            wall_time_s=_number(record.get("wall_time_s")),
            error=record.get("error") if isinstance(record.get("error"), str) else "",
            recorded_at=next((time for time in (ended_at, started_at) if isinstance(time, str) and time), None),
        )
        if not objective_curves_only:
            job.curves = read_scalars(folder / LOGS_DIR)
        elif job.objective:
            job.curves = read_scalars(folder / LOGS_DIR, tags={job.objective})
        job.metrics = {tag: points[-1][1] for tag, points in job.curves.items()}
        if status == "finished":
            job.metrics.update(final_metrics(folder))
        if job.objective and job.curves.get(job.objective):
            pick = max if job.direction == "maximize" else min
            job.best_step, job.best_value = pick(job.curves[job.objective], key=lambda point: point[1])
        jobs.append(job)
    started = {tuple(job.overrides) for job in jobs}
    for number, overrides in enumerate(grid(sweep_dir)):
        if tuple(overrides) not in started and not (sweep_dir / str(number)).exists():
            jobs.append(Job(name=str(number), overrides=overrides, status="pending"))
    return sorted(jobs, key=lambda job: (len(job.name), job.name))


def _job_folders(sweep_dir: Path) -> list[Path]:
    found = set()
    for marker in (JOB_FILE, f"{HYDRA_DIR}/{HYDRA_OVERRIDES_FILE}"):
        for path in sweep_dir.glob(f"*/{marker}"):
            found.add(path.parent if marker == JOB_FILE else path.parent.parent)
    return sorted(found)


def _hydra_overrides(folder: Path) -> list[str]:
    """The overrides Hydra recorded for a job, as written (an interpolation stays text); none if unreadable."""
    return _strings(plain_config(folder / HYDRA_DIR / HYDRA_OVERRIDES_FILE)) or []


def _strings(value: Any) -> list[str] | None:
    """``value`` if it is a list of strings (an override list as a record holds it), else None."""
    return list(value) if isinstance(value, list) and all(isinstance(line, str) for line in value) else None


def grid(sweep_dir: Path) -> list[list[str]]:
    """The overrides of every job of a grid sweep, from its multirun.yaml (none for other sweepers), read as plain
    YAML: nothing in it is resolved (``${oc.env:...}`` stays text)."""
    config = plain_config(sweep_dir / MULTIRUN_FILE)
    sweeper = _node(config, "hydra", "sweeper")
    target = sweeper.get("_target_")
    if not isinstance(target, str) or not target.endswith(("BasicSweeper", "ResumableSweeper")):
        return []
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = sweeper.get("params") if isinstance(sweeper.get("params"), dict) else {}
    task = _strings(_node(config, "hydra", "overrides").get("task")) or []
    arguments = [f"{key}={_text(value)}" for key, value in params.items()] + task
    try:
        grid = parsed.parse(arguments)
        return [job for batch in BasicSweeper.split_arguments(grid, None) for job in batch]
    except Exception:  # an override only the full config loader understands: list started jobs only
        return []


def _node(config: Any, *keys: str) -> dict:
    """The mapping at ``keys`` of a plain config, {} where there is none."""
    for key in keys:
        config = config.get(key) if isinstance(config, dict) else None
    return config if isinstance(config, dict) else {}


def _text(value: Any) -> str:
    """A sweeper parameter's value as the command line would give it (YAML's null and booleans spelled as Hydra
    reads them)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def read_scalars(logs: Path, *, tags: Collection[str] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``logs`` (only those of ``tags``, when given): tag ->
    [(step, value)] by step.

    A resumed run logs the steps between its checkpoint and the interruption again, with the same
    values (resume is exact): the last value read for a step wins. A resume from an earlier checkpoint
    purges what was logged after it, as TensorBoard does: its writer's session start at step N drops
    every value read so far at step N or later.
    """
    files = sorted(logs.rglob("events.out.tfevents.*")) if logs.is_dir() else []
    if not files:
        return {}
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(files, key=lambda p: p.stat().st_mtime):
        try:
            for event in LegacyEventFileLoader(str(path)).Load():
                if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                    for points in scalars.values():
                        for step in [step for step in points if step >= event.step]:
                            del points[step]
                for value in event.summary.value:
                    if tags is not None and value.tag not in tags:
                        continue
                    if value.WhichOneof("value") == "simple_value":
                        scalars.setdefault(value.tag, {})[event.step] = float(value.simple_value)
        except Exception:  # a file cut short by a kill: keep what was read
            continue
    return {tag: sorted(points.items()) for tag, points in scalars.items()}


# ---------------------------------------------------------------------------------------------- writing
def write_summary(sweep_dir: str | os.PathLike, *, plot: bool = True, jobs: list[Job] | None = None) -> list[Job]:
    """Write summary.csv and summary.md (and summary.png with ``plot``) into ``sweep_dir``; returns the jobs."""
    sweep_dir = Path(sweep_dir)
    jobs = collect(sweep_dir) if jobs is None else jobs
    keys = swept_keys([job.overrides for job in jobs])
    metric_names = sorted({name for job in jobs for name, value in job.metrics.items() if _is_number(value)})
    _write_atomic(sweep_dir / SUMMARY_CSV, _csv(jobs, keys, metric_names))
    _write_atomic(sweep_dir / SUMMARY_MD, _markdown(sweep_dir, jobs, keys))
    if plot:
        _plot(sweep_dir / SUMMARY_PNG, jobs, keys)
    return jobs


def _columns(job: Job, keys: list[str]) -> dict[str, Any]:
    values = parsed.as_typed(job.overrides)
    return {key: values.get(key, "") for key in keys}


def _csv(jobs: list[Job], keys: list[str], metric_names: list[str]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    header = ["job", "status", *keys, "objective", *metric_names, "best_step", "best_value", "wall_time_s"]
    writer.writerow([*header, "overrides", "error"])
    for job in jobs:
        row = [job.name, job.status, *_columns(job, keys).values(), job.objective or ""]
        row += [_plain(job.metrics.get(name)) for name in metric_names]
        row += [_plain(job.best_step), _plain(job.best_value), _plain(job.wall_time_s)]
        writer.writerow([*row, " ".join(job.overrides), job.error])
    return out.getvalue()


def _markdown(sweep_dir: Path, jobs: list[Job], keys: list[str]) -> str:
    counts = {}
    for job in jobs:
        counts[job.status] = counts.get(job.status, 0) + 1
    lines = [f"# Sweep {sweep_dir.name}", "", ", ".join(f"{n} {status}" for status, n in counts.items()) + ".", ""]
    scored = [job for job in jobs if job.objective_value is not None and job.status == "finished"]
    if scored:
        best = (max if scored[0].direction == "maximize" else min)(scored, key=lambda job: job.objective_value)
        chosen = ", ".join(f"{k}={_fmt(v)}" for k, v in _columns(best, keys).items()) or "no overrides"
        lines += [f"Best: job {best.name} ({chosen}), {best.objective} {_fmt(best.objective_value)}.", ""]
    objective = next((job.objective for job in jobs if job.objective), "objective")
    header = ["job", "status", *keys, objective, "loss", "best step", "wall time"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for job in jobs:
        cells = [job.name, job.status, *(_fmt(v) for v in _columns(job, keys).values())]
        cells += [_fmt(job.objective_value), _fmt(job.metrics.get(LOSS)), _fmt(job.best_step)]
        cells.append(f"{job.wall_time_s:.0f} s" if job.wall_time_s is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    failed = [job for job in jobs if job.error]
    if failed:
        lines += ["", "## Errors", ""]
        lines += [f"- job {job.name} ({' '.join(job.overrides)}): {job.error}" for job in failed]
    return "\n".join(lines) + "\n"


def _plot(path: Path, jobs: list[Job], keys: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = max(len(keys), 1)
    figure, axes = plt.subplots(2, panels, figsize=(4.5 * panels, 7.5), squeeze=False)
    scored = [job for job in jobs if job.objective_value is not None]
    objective = next((job.objective for job in jobs if job.objective), "objective")
    best = None
    if scored:
        best = (max if scored[0].direction == "maximize" else min)(scored, key=lambda job: job.objective_value)
    for axis, key in zip(axes[0], keys or [None], strict=True):
        if key is None:
            axis.set_axis_off()
            continue
        raw = [_columns(job, [key])[key] for job in scored]
        numbers = [_number(value) for value in raw]
        if raw and all(value is not None for value in numbers):
            positions = numbers
            positive = [v for v in numbers if v > 0]
            if len(positive) == len(numbers) and max(positive) / min(positive) >= 10:
                axis.set_xscale("log")
            if len(set(numbers)) <= 8:  # a grid's few values: label each one as it was given
                values = sorted(set(numbers))
                axis.set_xticks(values, [_fmt(raw[numbers.index(v)]) for v in values])
                axis.minorticks_off()
        else:  # categorical values: one position each
            labels = sorted(set(raw), key=str)
            positions = [labels.index(v) for v in raw]
            axis.set_xticks(range(len(labels)), [str(label) for label in labels])
        axis.scatter(positions, [job.objective_value for job in scored])
        if best is not None:
            where = positions[scored.index(best)]
            axis.scatter([where], [best.objective_value], marker="*", s=220, color="tab:red", label=f"job {best.name}")
            axis.legend(fontsize="small")
        axis.set_xlabel(key)
        axis.set_ylabel(objective)
        axis.grid(alpha=0.3)
    _plot_curves(figure, axes, jobs, keys)
    figure.suptitle(
        fitted_title(f"Sweep {path.parent.name}: {objective} per parameter, and every job's {LOSS}", figure)
    )
    figure.tight_layout()
    try:
        # Jobs of a sweep that end at once may all rewrite it: each under a temporary name of its own.
        write_atomically(path, lambda partial: figure.savefig(partial, format="png", dpi=100), shared=True)
    finally:
        plt.close(figure)


def fitted_title(text: str, figure) -> str:
    """``text`` wrapped to the figure's width (about 11 characters of a title's size per inch), never clipped."""
    return textwrap.fill(text, width=max(20, int(figure.get_figwidth() * 11)))


def _plot_curves(figure, axes, jobs: list[Job], keys: list[str]) -> None:
    """The lower half of the figure: every job's training loss over the optimizer steps."""
    curves = figure.add_subplot(2, 1, 2)
    for axis in axes[1]:
        axis.remove()
    for job in jobs:
        points = job.curves.get(LOSS)
        if points:
            label = f"{job.name}: " + ", ".join(f"{k}={v}" for k, v in _columns(job, keys).items())
            curves.plot(
                [s for s, _ in points],
                [v for _, v in points],
                label=label + ("" if job.status == "finished" else f" ({job.status})"),
            )
    curves.set_xlabel("optimizer step")
    curves.set_ylabel(LOSS)
    curves.grid(alpha=0.3)
    if curves.lines:
        curves.legend(fontsize="small")


def _write_atomic(path: Path, text: str) -> None:
    write_text_atomically(path, text, shared=True)  # jobs running at once may all rewrite it


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _plain(value: Any) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):  # an override's value: numbers shortened, text as given
        number = _number(value)
        return value if number is None or value.isdigit() else _fmt(number)
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", help="a multirun folder, e.g. outputs/multirun/2026-11-29/10-00-00")
    parser.add_argument("--no-plot", action="store_true", help="write summary.csv and summary.md only")
    args = parser.parse_args(argv)
    sweep_dir = Path(args.sweep_dir)
    if not sweep_dir.is_dir():
        print(
            f"runner.report: error: {sweep_dir} is not a folder; pass a sweep folder (hydra.sweep.dir).",
            file=sys.stderr,
        )
        return 2
    jobs = collect(sweep_dir)
    if not jobs:
        print(f"runner.report: error: {sweep_dir} holds no sweep jobs (no */job.json or */.hydra); pass a sweep "
              "folder.", file=sys.stderr)  # fmt: skip
        return 2
    write_summary(sweep_dir, plot=not args.no_plot, jobs=jobs)
    print((sweep_dir / SUMMARY_MD).read_text(), end="")
    return 0
