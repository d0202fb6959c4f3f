"""The run's trackers, as its ``tracker`` node declares them (conf/tracker/: tensorboard, csv, mlflow, wandb).

- :func:`settle` (launching process): fills the keys that depend on where the run is (MLflow's SQLite
  file and run name, W&B's folder and name, a sweep's group) in the config handed to the workers, so
  every checkpoint records them and a resume finds the same store.
- :func:`build` (every worker): the tracker objects, cheap to make; the Accelerator starts them on
  the main process.
- :func:`start` (every worker): starts them, records the config, and writes ``trackers.json`` (the
  MLflow and W&B run ids) in the run folder; a resumed run reads it back and continues those runs.
- :func:`finish`: metrics.json, and the model folder where the tracker keeps files.
- :func:`check_reachable` (launching process): an MLflow store that cannot be used (a server or W&B that cannot be
  reached, a SQLite file or a folder this user cannot write) is one sentence before anything starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.config import ConfigError
from runner.folders.layout import LOGS_DIR, METRICS_FILE, MODEL_DIR, TRACKERS_FILE

logger = logging.getLogger("runner")


def settle(config: dict[str, Any], project_dir: Path, *, sweep_dir: Path | None, job_name: str | None) -> None:
    """Fill, in place, the null tracker keys that depend on the run's folder and its sweep."""
    trackers = config.get("tracker") or {}
    name = job_name or f"{project_dir.parent.name}/{project_dir.name}"
    group = None if sweep_dir is None else f"{sweep_dir.parent.name}/{sweep_dir.name}"
    if (mlflow := trackers.get("mlflow")) is not None:
        if not mlflow.get("tracking_uri"):
            mlflow["tracking_uri"] = f"sqlite:///{(sweep_dir or project_dir) / 'mlflow.db'}"
        mlflow["run_name"] = mlflow.get("run_name") or name
        mlflow["group"] = mlflow.get("group") or group
    if (wandb := trackers.get("wandb")) is not None:
        wandb["dir"] = wandb.get("dir") or str(project_dir)
        wandb["name"] = wandb.get("name") or name
        wandb["group"] = wandb.get("group") or group


def build(cfg: DictConfig) -> list:
    """The run's tracker objects, unstarted (every rank makes them; only the main process starts them)."""
    from runner.engine.tracking import CSVTracker, GeneralTracker, MLflowTracker, TensorBoardTracker, WandBTracker

    project_dir = Path(cfg.project.project_dir)
    previous = _recorded(project_dir) if cfg.resume and _continues_own_run(Path(cfg.resume)) else {}
    trackers: list[GeneralTracker] = []
    for name, node in (cfg.get("tracker") or {}).items():
        keys = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})
        if name == "tensorboard":
            # A resume hides what the run logged after its checkpoint, as TensorBoard does after a crash: from an
            # earlier checkpoint, those steps belong to a history the run no longer has.
            step = _resumed_step(cfg)
            purge = {} if step is None else {"purge_step": step + 1}
            trackers.append(TensorBoardTracker("", project_dir / LOGS_DIR, **purge))
        elif name == "csv":
            trackers.append(CSVTracker("", project_dir / LOGS_DIR))
        elif name == "mlflow":
            uri = keys["tracking_uri"]
            sqlite = uri.startswith("sqlite:///") and uri.removeprefix("sqlite:///")
            trackers.append(
                MLflowTracker(
                    keys["experiment_name"],
                    logging_dir=Path(sqlite).parent / "mlartifacts" if sqlite else None,  # beside the database
                    run_id=previous.get("mlflow", {}).get("run_id"),
                    tags=keys["tags"],
                    run_name=keys["run_name"],
                    tracking_uri=keys["tracking_uri"],
                    group=keys["group"],
                    store_lock=f"{sqlite}.lock" if sqlite else None,  # a sweep's parallel jobs share the file
                )
            )
        elif name == "wandb":
            run_id = previous.get("wandb", {}).get("run_id")
            options = {key: keys[key] for key in ("entity", "mode", "dir", "name", "group", "tags")}
            if run_id:  # continue the run an earlier attempt started
                options.update(id=run_id, resume="allow")
            trackers.append(WandBTracker(keys["project"], **options))
        else:  # your own: a node with a _target_ (checked before launch to be a GeneralTracker)
            from hydra.utils import instantiate

            trackers.append(instantiate(node))
    return trackers


def _resumed_step(cfg: DictConfig) -> int | None:
    """The step of the checkpoint the run resumes (its manifest's, verified before launch), or None."""
    from runner.engine.constants import MANIFEST_NAME

    if not cfg.resume:
        return None
    try:
        step = json.loads((Path(cfg.resume) / MANIFEST_NAME).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _continues_own_run(checkpoint: Path) -> bool:
    """Whether the resumed checkpoint is this user's own: only then are the tracker runs trackers.json names
    continued. Someone else's folder may name anybody's runs there (a colleague's finished MLflow run, say), and
    the resume would add its parameters, metrics and model to them: it starts new runs instead."""
    from runner.folders.provenance import signed_by_you

    if signed_by_you(checkpoint):
        return True
    if (checkpoint.parent.parent / TRACKERS_FILE).is_file():
        logger.warning(
            "%s was not written by you: the trackers start new runs rather than continuing those %s names.",
            checkpoint, TRACKERS_FILE,
        )  # fmt: skip
    return False


def start(accelerator, cfg: DictConfig) -> None:
    """Start the trackers (main process), record the resolved config, and keep their run ids in the run folder."""
    accelerator.init_trackers("", config=OmegaConf.to_container(cfg, resolve=True))
    if not accelerator.is_main_process:
        return
    ids = {}
    for tracker in accelerator.trackers:
        if tracker.name == "mlflow":
            ids["mlflow"] = {"run_id": tracker.run_id, "tracking_uri": tracker.tracking_uri}
        elif tracker.name == "wandb":
            ids["wandb"] = {"run_id": tracker.run_id, "project": tracker.run_name}
    if ids:
        from runner.files import write_text_atomically

        path = Path(cfg.project.project_dir) / TRACKERS_FILE
        write_text_atomically(path, json.dumps({**_recorded(path.parent), **ids}, indent=2) + "\n")


def _recorded(project_dir: Path) -> dict[str, Any]:
    """The run ids an earlier attempt of this run recorded (trackers.json), or {} (a damaged file: warned)."""
    path = project_dir / TRACKERS_FILE
    if not path.is_file():
        return {}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        logger.warning("Ignoring %s (%s): the trackers start new runs.", path, error)
        return {}
    return recorded if isinstance(recorded, dict) else {}


def finish(accelerator, cfg: DictConfig) -> None:
    """Main process, after metrics.json and model/ are written: keep them with the tracked runs."""
    project_dir = Path(cfg.project.project_dir)
    accelerator.log_artifact(project_dir / METRICS_FILE)
    keeps_model = [name for name in ("mlflow", "wandb") if OmegaConf.select(cfg, f"tracker.{name}.log_model")]
    if keeps_model and (project_dir / MODEL_DIR).is_dir():
        accelerator.log_artifact(project_dir / MODEL_DIR, MODEL_DIR, trackers=keeps_model)


def check_reachable(cfg: DictConfig, *, timeout: float = 5.0) -> None:
    """An MLflow store that cannot be used (a server that cannot be reached, a SQLite file or a folder that cannot
    be written), W&B that cannot be reached, or W&B online without a login: one sentence, now.

    Raises:
        ConfigError: Naming the key and the fix.
    """
    import socket
    import urllib.error
    import urllib.parse
    import urllib.request

    uri = OmegaConf.select(cfg, "tracker.mlflow.tracking_uri")
    if isinstance(uri, str) and uri.lower().startswith(("sqlite:", "file:")):
        _check_local_store(uri)
    if isinstance(uri, str) and uri.lower().startswith(("http://", "https://")):
        try:
            urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout).close()
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            raise ConfigError(
                f"tracker.mlflow.tracking_uri={uri} cannot be reached ({reason}); start the MLflow server or fix "
                "the address, or leave it null for a SQLite file in the run folder."
            ) from None
    if "wandb" in (cfg.get("tracker") or {}) and OmegaConf.select(cfg, "tracker.wandb.mode") == "online":
        base = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        host = urllib.parse.urlparse(base).hostname or "api.wandb.ai"
        if not os.environ.get("WANDB_API_KEY") and not _netrc_has(host):
            raise ConfigError(
                "tracker=wandb in mode online needs a W&B login: run `wandb login` or set WANDB_API_KEY, or set "
                "tracker.wandb.mode=offline (then `wandb sync <run folder>/wandb/offline-run-*`)."
            )
        port = urllib.parse.urlparse(base).port or (443 if base.startswith("https") else 80)
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as error:
            raise ConfigError(
                f"tracker=wandb cannot reach {base} ({error.strerror or error}); check the network, or set "
                "tracker.wandb.mode=offline (then `wandb sync` later)."
            ) from None


def _check_local_store(uri: str) -> None:
    """The SQLite file of ``sqlite:///<file>`` (its folder may be made), or the folder of ``file:<folder>``, can
    be written by this user, without following a link; a folder store is one the installed MLflow still opens.

    Nothing is made here: the nearest folder that exists is probed with a file created and removed at once.
    """
    from urllib.parse import urlsplit

    key = f"tracker.mlflow.tracking_uri={uri}"
    if uri.lower().startswith("sqlite:"):
        store = Path(uri[len("sqlite:///") :].partition("?")[0])
        folder = store.parent
        if store.is_symlink() or (store.exists() and not store.is_file()):
            what = "a link" if store.is_symlink() else "not a file"
            raise ConfigError(
                f"{key}: {store} is {what}; point tracking_uri at a SQLite file of its own, or leave it null for a "
                "SQLite file in the run folder."
            )
    else:
        folder = Path(urlsplit(uri).path)
        _check_folder_store_allowed(key)
    existing = next(parent for parent in (folder, *folder.parents) if parent.exists() or parent.is_symlink())
    probe = existing / f".write-test-{uuid.uuid4().hex[:8]}"
    try:
        if not existing.is_dir():
            raise NotADirectoryError(0, f"{existing} is not a folder")
        probe.touch(exist_ok=False)  # created exclusively: never through a link of that name
        probe.unlink()
    except OSError as error:
        what = "cannot be written" if existing == folder else f"does not exist and cannot be made in {existing}"
        raise ConfigError(
            f"{key}: the folder {folder} {what} ({error.strerror or error}); choose a folder this user can write, or "
            "leave tracking_uri null for a SQLite file in the run folder."
        ) from None


def _check_folder_store_allowed(key: str) -> None:
    """MLflow 3 keeps a folder store (``file:``) in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE
    is set."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow from before the maintenance mode: it opens folders
        return
    if not MLFLOW_ALLOW_FILE_STORE.get():
        raise ConfigError(
            f"{key}: the installed MLflow no longer opens a folder store unless MLFLOW_ALLOW_FILE_STORE=true is set; "
            "set it, or use sqlite:///<file>.db (or leave tracking_uri null for a SQLite file in the run folder)."
        )


def _netrc_has(host: str) -> bool:
    import netrc

    with contextlib.suppress(OSError, netrc.NetrcParseError):
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    return False
