"""What a run folder holds, each name defined once (the engine names ``checkpoints/`` and a checkpoint's own files).

<run>/run.log              every rank's log lines (rank 0's, and any rank's warnings)
<run>/logs/                TensorBoard events
<run>/metrics.json         the final metrics and step, and the command's wall time and time to its first step
<run>/curves.png           the logged curves over the steps (written at the end; `runner report <run>` redraws it)
<run>/samples.txt          text the language-model recipe generates at the end
<run>/trackers.json        the MLflow and W&B run ids (tracker=mlflow, wandb), which a resume continues
<run>/model/               the final weights (model.safetensors; Hugging Face's config.json for its models)
<run>/.hydra/              Hydra's record of the composed config and the overrides typed
<run>/checkpoints/checkpoint_N/config.yaml, overrides.yaml   the run's config and overrides, in every checkpoint
<sweep>/multirun.yaml      Hydra's record of a sweep (its sweeper and parameters)
<sweep>/<job>/job.json     each sweep job's record (runner.sweeps.jobs reads and writes it)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

LOG_FILE = "run.log"
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # run.log's lines (conf/hydra/job_logging)
LOGS_DIR = "logs"
METRICS_FILE = "metrics.json"
CURVES_PNG = "curves.png"
MODEL_DIR = "model"
SAMPLES_FILE = "samples.txt"
TRACKERS_FILE = "trackers.json"  # the MLflow / W&B run ids a resume continues
HYDRA_DIR = ".hydra"
HYDRA_OVERRIDES_FILE = "overrides.yaml"  # in HYDRA_DIR: the overrides as typed
CONFIG_FILE = "config.yaml"  # in each checkpoint: the resolved config a resume starts from
OVERRIDES_FILE = "overrides.yaml"  # in each checkpoint: the overrides a resume replays
MULTIRUN_FILE = "multirun.yaml"  # in a sweep folder: Hydra's record of the sweep
JOB_FILE = "job.json"  # in a sweep job's folder: its record


def saved_overrides(checkpoint: Path) -> list[str]:
    """The command-line overrides the checkpointed run was composed with, as written (nothing resolved).

    Raises:
        ConfigError: The file is not a YAML list of strings.
    """
    from omegaconf import OmegaConf

    from runner.config import ConfigError

    path = checkpoint / OVERRIDES_FILE
    if not path.is_file():
        return []
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # not YAML (OmegaConf and yaml raise several types)
        saved = None
    if not isinstance(saved, list) or not all(isinstance(override, str) for override in saved):
        raise ConfigError(f"{path} is not a list of overrides; the checkpoint is damaged, so resume another one.")
    return saved


def link_error(path: Path):
    """The one sentence (a ConfigError) for a symbolic link found at ``path`` inside a run folder."""
    from runner.config import ConfigError

    target = os.readlink(path)
    shown = target if os.path.isabs(target) else os.path.normpath(os.path.join(os.path.dirname(path), target))
    return ConfigError(
        f"{path} is a symbolic link (to {shown}); a run folder holds no links, so remove it or copy the run with "
        "links resolved (cp -rL)."
    )


WANDB_DIR = "wandb"  # tracker=wandb: W&B's own folder (it links latest-run and its logs, some to ~/.cache/wandb)
SUBMITIT_DIR = ".submitit"  # hydra/launcher=slurm: submitit's folder in a sweep (conf/hydra/launcher/slurm.yaml)


def check_no_links(folder: Path) -> None:
    """Raise :class:`ConfigError` naming a symbolic link anywhere inside ``folder`` (none if it does not exist).

    What is inside ``folder/wandb/`` and ``folder/.submitit/`` is not walked: W&B writes the one (links among
    them: ``latest-run``, its logs) and submitit the other (``.submission_file_*.sh``, a link to each job's
    script, in a sweep folder of ``hydra/launcher=slurm``), and the runner never reads or writes there. Neither
    folder may itself be a link.

    Raises:
        ConfigError: One sentence naming the link, where it points, and the fix.
    """
    unwalked = {Path(folder) / WANDB_DIR, Path(folder) / SUBMITIT_DIR}
    pending = [Path(folder)]
    while pending:
        current = pending.pop()
        try:
            entries = os.scandir(current)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet, or a file: check_writable and Hydra report those
        with entries:
            for entry in entries:
                if entry.is_symlink():
                    raise link_error(Path(entry.path))
                if entry.is_dir(follow_symlinks=False) and Path(entry.path) not in unwalked:
                    pending.append(Path(entry.path))


def resumed_run_folder(resume: str) -> Path:
    """The run folder ``resume=`` names, from the path as written: a run folder, or its ``checkpoints/<name>``."""
    from runner.engine.constants import CHECKPOINTS_DIR

    path = as_written(resume)
    return path.parent.parent if path.parent.name == CHECKPOINTS_DIR else path


def as_written(folder: str) -> Path:
    """``folder`` made absolute without following links (``..`` is taken as written, too)."""
    return Path(os.path.normpath(Path(folder).expanduser().absolute()))


def final_metrics(run_dir: Path) -> dict:
    """The run's metrics.json (its final metrics, step and times), or {} where there is none or it is not JSON."""
    try:
        found = json.loads((run_dir / METRICS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
