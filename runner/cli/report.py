"""A single run's account of itself: ``curves.png`` in its folder, and the closing lines of its log.

    runner report outputs/2026-11-29/10-00-00      # redraw a run's curves.png (a sweep folder: its summary)

The picture is drawn from the run's TensorBoard event files (``logs/``) at the end of the run, and again
by ``runner report`` at any time, also while the run trains: the losses (train and eval) on one panel,
every other ``eval/*`` metric and the learning rate on one panel each, over the optimizer steps.

The closing lines say what happened (finished, failed, stopped), where the run is, how long it took,
its final metrics, its newest intact checkpoint, and the commands that evaluate or continue it.
Everything is read from the folder alone, as data (:mod:`runner.folders.layout`).
"""

from __future__ import annotations

import math
from pathlib import Path

from runner.files import write_atomically
from runner.folders.layout import CURVES_PNG, LOGS_DIR, METRICS_FILE, final_metrics

LOSSES = ("train/loss", "eval/loss")
LEARNING_RATE = "train/lr"
TIMES = ("wall_time_s", "time_to_first_step_s")  # metrics.json's account of this command's time


def panels(scalars: dict[str, list[tuple[int, float]]]) -> list[tuple[str, list[str]]]:
    """The figure's panels: (title, tags), the losses first, then each eval metric, then the learning rate."""
    found = []
    losses = [tag for tag in LOSSES if scalars.get(tag)]
    if losses:
        found.append(("loss", losses))
    metrics = sorted(tag for tag in scalars if tag.startswith("eval/") and tag not in LOSSES and scalars[tag])
    found += [(tag, [tag]) for tag in metrics]
    if scalars.get(LEARNING_RATE):
        found.append(("learning rate", [LEARNING_RATE]))
    return found


def draw_curves(run_dir: Path) -> Path | None:
    """Write ``run_dir/curves.png`` from its TensorBoard logs; None (nothing written) when it logged no curves
    (``tracker=none``, or no step logged yet)."""
    from runner.sweeps.report import fitted_title, read_scalars

    scalars = read_scalars(run_dir / LOGS_DIR)
    shown = panels(scalars)
    if not shown:
        return None
    from matplotlib.figure import Figure  # a figure of its own, drawn by Agg: no pyplot, no global state

    columns = min(len(shown), 3)
    rows = math.ceil(len(shown) / columns)
    figure = Figure(figsize=(4.5 * columns, 3.6 * rows + 0.6))
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis, (title, tags) in zip(axes.flat, shown, strict=False):
        for tag in tags:
            points = scalars[tag]
            style = {"marker": "o", "markersize": 3} if len(points) < 30 else {}
            axis.plot([step for step, _ in points], [value for _, value in points], label=tag, **style)
        axis.set_title(title, fontsize="medium")
        axis.set_xlabel("optimizer step")
        axis.grid(alpha=0.3)
        if len(tags) > 1:
            axis.legend(fontsize="small")
        if title == "learning rate":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for axis in list(axes.flat)[len(shown) :]:
        axis.set_axis_off()
    last = max(step for tags in (tags for _, tags in shown) for tag in tags for step, _ in scalars[tag])
    figure.suptitle(fitted_title(f"{run_dir.name}: every logged curve to step {last}", figure))
    figure.tight_layout()
    path = run_dir / CURVES_PNG
    write_atomically(path, lambda partial: figure.savefig(partial, format="png", dpi=100))
    return path


def newest_checkpoint(run_dir: Path) -> str:
    """``checkpoint_N (step S)`` for the run's newest intact checkpoint (sizes checked, not hashes), or a phrase
    saying there is none."""
    from runner.engine.checkpoint import checkpoints_dir, newest_intact_checkpoint, read_manifest
    from runner.engine.checkpoint.errors import CheckpointError

    newest, _ = newest_intact_checkpoint(checkpoints_dir(str(run_dir)), verify_checksums=False)
    if newest is None:
        return "no complete checkpoint"
    try:
        step = read_manifest(newest, verify_checksums=False).get("step")
    except CheckpointError:  # damaged since: the name is still the truth about the folder
        step = None
    return newest.name if step is None else f"{newest.name} (step {step})"


def finished(run_dir: Path, *, seconds: float | None, curves: Path | None) -> list[str]:
    """The closing lines of a run that finished: its folder, time, final metrics, checkpoint, and what to run next."""
    metrics = final_metrics(run_dir)
    shown = ", ".join(
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in sorted(metrics.items())
        if key not in (*TIMES, "step", "epoch")
    )
    took = "" if seconds is None else f" in {duration(seconds)}"
    at = f" at step {metrics['step']}" if "step" in metrics else ""
    lines = [f"Finished{at}{took}: {shown or 'no metrics were written'}."]
    lines.append(f"Run folder: {run_dir}; newest checkpoint: {newest_checkpoint(run_dir)}.")
    if curves is not None:
        lines.append(f"Curves: {curves} (runner report {run_dir} redraws them).")
    lines.append(
        f"Evaluate it with `runner eval {run_dir}`; train it further with `runner resume={run_dir} "
        "trainer.max_steps=<more steps>`."
    )
    return lines


def ended_early(run_dir: Path, what: str, *, seconds: float | None) -> list[str]:
    """The closing lines of a run that ended before its last step (``what`` happened): how long it ran, its newest
    intact checkpoint, and the command that continues it."""
    took = "" if seconds is None else f" after {duration(seconds)}"
    checkpoint = newest_checkpoint(run_dir)
    lines = [f"{what}{took}.", f"Run folder: {run_dir}; newest checkpoint: {checkpoint}."]
    if checkpoint != "no complete checkpoint":
        lines.append(f"Continue it with `runner resume={run_dir}`.")
    return lines


def duration(seconds: float) -> str:
    """``4.2 s``, ``3 min 05 s``, ``2 h 01 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def main(argv: list[str]) -> int:
    """``runner report FOLDER``: redraw a run's curves.png, or rebuild a sweep's summary; returns the exit code."""
    import argparse
    import sys

    from runner.config import ConfigError
    from runner.folders.layout import check_no_links

    parser = argparse.ArgumentParser(
        prog="runner report", description="Redraw a run's curves.png, or rebuild a sweep's summary.csv, .md, .png."
    )
    parser.add_argument("folder", help="a run folder (outputs/<date>/<time>) or a sweep folder (hydra.sweep.dir)")
    parser.add_argument("--no-plot", action="store_true", help="a sweep: write summary.csv and summary.md only")
    args = parser.parse_args(argv)
    folder = Path(args.folder).expanduser().absolute()
    try:
        if not folder.is_dir():
            raise ConfigError(f"{args.folder} is not a folder; pass a run folder or a sweep folder.")
        check_no_links(folder)
    except ConfigError as error:
        print(f"runner report: error: {error}", file=sys.stderr)
        return 2
    if any((folder / name).exists() for name in (LOGS_DIR, METRICS_FILE, "checkpoints")):
        path = draw_curves(folder)
        if path is None:
            print(f"runner report: error: {folder / LOGS_DIR} holds no logged curves yet (a run with tracker=none logs "
                  "none); nothing was drawn.", file=sys.stderr)  # fmt: skip
            return 1
        print(f"Wrote {path}")
        return 0
    from runner.sweeps.report import SUMMARY_MD, collect, write_summary

    jobs = collect(folder)
    if not jobs:
        print(f"runner report: error: {folder} is neither a run folder (no logs/, metrics.json or checkpoints/) nor a "
              "sweep folder (no */job.json or */.hydra); pass one of those.", file=sys.stderr)  # fmt: skip
        return 2
    write_summary(folder, plot=not args.no_plot, jobs=jobs)
    print((folder / SUMMARY_MD).read_text(), end="")
    return 0
