"""Sweeps (Hydra multiruns) that record every job, resume where they stopped, and report.

Each job writes ``job.json`` in its folder: its overrides, status (running, finished, failed,
stopped), error, wall time and objective. From these records:

- ``hydra_plugins.runner_sweeper.ResumableSweeper`` (the default, conf/hydra/sweeper/basic.yaml) runs a grid like
  Hydra's basic sweeper, but a job that fails is recorded and the others still run, and re-running
  the same command on the same sweep folder (``hydra.sweep.dir=...``) skips finished jobs without
  touching their folders, resumes unfinished ones from their newest checkpoint, and runs the rest.
- :class:`~runner.sweeps.summary.SweepSummary`, a Hydra callback, rewrites ``summary.csv`` /
  ``summary.md`` after each job and ``summary.png`` at the end (runner.sweeps.report;
  ``python -m runner.report`` does the same by hand).

jobs.py (the record), job.py (this process's job), plan.py (what a re-run skips), summary.py,
report.py (``python -m runner.report``).

Hydra's own sweepers (Optuna's, say) restart their numbering and overwrite; with them jobs are
recorded and summarised, but not skipped or resumed.

It may import the launch and what is below it (the config, run folders, the engine's checkpoint room,
:mod:`runner.files`); never the command line.
"""
