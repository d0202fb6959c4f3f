"""What a config you did not write reads from your environment, and where it would send the run.

A run folder someone else wrote (:mod:`runner.folders.provenance` tells) is resumed, evaluated, exported or
sampled with the config saved in it. Besides the code it names, that config can reach past the folder
in two ways, and both are refused unless this command line gives the key:

* **Reading your environment.** ``${oc.env:HF_TOKEN}`` in a tracker tag or a model node resolves in
  your shell, and the value goes wherever the config sends it (a tracker's parameters, an exported
  ``config.json``). So does Hydra's ``${hydra:...}`` (your working folder, your paths). Only the
  resolvers that read nothing but the config itself (:data:`PURE_RESOLVERS`) pass.
* **Sending the run elsewhere.** An MLflow ``tracking_uri`` that is not the SQLite file of the folder
  itself (or of its sweep), W&B in ``online`` mode, a rendezvous endpoint, or any other URL in the
  config would contact a machine the user never chose, with the run's parameters, metrics and
  model, and with the user's own credentials. When the command line does give a destination, the
  folder's names within it (MLflow's experiment and parent run, W&B's entity, project and group,
  whether the model is uploaded) must be the values the user's own config groups use, or typed too:
  otherwise they would file the run into somebody else's project.

Everything here reads the configs as plain containers: nothing is resolved, imported or contacted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

# Resolvers that read nothing but the config itself (and the clock); any other reads the environment
# (ENVIRONMENT_RESOLVERS) or builds config, a _target_ node among it, when it resolves.
PURE_RESOLVERS = ("now", "oc.select", "oc.dict.keys", "oc.dict.values", "oc.deprecated")
ENVIRONMENT_RESOLVERS = ("oc.env", "hydra")
RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.\-]*)\s*:")
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.\-]*)://\S+")
_LOCAL_SCHEMES = ("file", "sqlite")

# Where a tracker would send the run, and its names inside that destination.
MLFLOW, WANDB = "tracker.mlflow", "tracker.wandb"
MLFLOW_NAMES = ("experiment_name", "group", "log_model")
WANDB_NAMES = ("entity", "project", "group", "log_model")
RENDEZVOUS = "trainer.rdzv_endpoint"


def resolvers_in(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """``(key, resolver)`` for every ``${resolver:...}`` in a plain config, in its values and its keys."""
    if isinstance(node, dict):
        for name, value in node.items():
            yield from resolvers_in(str(name), key)
            yield from resolvers_in(value, join(key, str(name)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from resolvers_in(value, f"{key}[{index}]")
    elif isinstance(node, str):
        for resolver in RESOLVER.findall(node):
            yield key, resolver


def given(key: str, typed: Iterable[str]) -> bool:
    """Whether one of the ``typed`` keys (this command line's) sets ``key``, or a node above it."""
    return any(key == name or key.startswith((f"{name}.", f"{name}[")) for name in typed)


def environment_reads(config: Any, saved_overrides: Iterable[str], *, typed: Iterable[str]) -> list[str]:
    """``"<key> uses the resolver <name>"`` for each value of the saved config or saved overrides that reads the
    environment (:data:`ENVIRONMENT_RESOLVERS`) and that the ``typed`` keys do not replace."""
    from runner.config import ConfigError
    from runner.config import overrides as parsed

    typed = list(typed)
    found = list(resolvers_in(config))
    for line in saved_overrides:
        try:
            key = parsed.key(line)
        except ConfigError:  # a line Hydra cannot parse is reported with the code a folder names
            continue
        found += [(key, resolver) for _, resolver in resolvers_in(line)]
    reads = []
    for key, resolver in found:
        shown = f"{key} uses the resolver {resolver}"
        if resolver in ENVIRONMENT_RESOLVERS and not given(key, typed) and shown not in reads:
            reads.append(shown)
    return reads


def destinations(config: Any, *, run_dir: Path, typed: Iterable[str], installed: dict[str, set]) -> list[str]:
    """``"<key>=<value>"`` for each place outside this machine (or outside the run folder's own tracker store)
    that the saved ``config`` would send the run to, and that the ``typed`` keys do not give.

    Args:
        config: The saved config, a plain container.
        run_dir: The run folder being resumed; its own ``mlflow.db`` (and its sweep folder's) stays local.
        typed: The keys this command line sets.
        installed: :func:`installed_values` of the user's own config groups.
    """
    typed = list(typed)
    sent = []
    trackers = config.get("tracker") if isinstance(config.get("tracker"), dict) else {}
    if isinstance(mlflow := trackers.get("mlflow"), dict):
        uri = mlflow.get("tracking_uri")
        if not given(f"{MLFLOW}.tracking_uri", typed) and not _local_store(uri, run_dir):
            sent.append(f"{MLFLOW}.tracking_uri={uri}")
        if given(f"{MLFLOW}.tracking_uri", typed):  # your destination: the run's names in it must be yours too
            sent += _foreign_names(mlflow, MLFLOW, MLFLOW_NAMES, typed=typed, installed=installed)
    if isinstance(wandb := trackers.get("wandb"), dict):
        mode = wandb.get("mode")
        if not given(f"{WANDB}.mode", typed) and mode not in ("offline", "disabled"):
            sent.append(f"{WANDB}.mode={mode}")
        if given(f"{WANDB}.mode", typed):
            sent += _foreign_names(wandb, WANDB, WANDB_NAMES, typed=typed, installed=installed)
    trainer = config.get("trainer") if isinstance(config.get("trainer"), dict) else {}
    if trainer.get("rdzv_endpoint") not in (None, "") and not given(RENDEZVOUS, typed):
        sent.append(f"{RENDEZVOUS}={trainer['rdzv_endpoint']}")
    known_urls = installed.get("", set())
    for key, value in _strings(config, ""):
        urls = [match for match in _URL.finditer(value) if match.group(1).lower() not in _LOCAL_SCHEMES]
        if urls and not key.startswith(("tracker.", "hydra.")) and not given(key, typed) and value not in known_urls:
            sent.append(f"{key}={value}")
    return sent


def _local_store(uri: Any, run_dir: Path) -> bool:
    """Whether ``uri`` is MLflow's default store of this run folder or of its sweep (or null: it will be)."""
    if uri is None:
        return True
    if not isinstance(uri, str) or not uri.startswith("sqlite:///"):
        return False
    path = os.path.normpath(uri.removeprefix("sqlite:///"))
    return path in {os.path.join(folder, "mlflow.db") for folder in (str(run_dir), str(run_dir.parent))}


def _foreign_names(node: dict, prefix: str, names: tuple[str, ...], *, typed: list[str], installed: dict) -> list[str]:
    foreign = []
    for name in names:
        key, value = f"{prefix}.{name}", node.get(name)
        if value is not None and not given(key, typed) and value not in installed.get(name, ()):
            foreign.append(f"{key}={value}")
    return foreign


def _strings(node: Any, key: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _strings(value, join(key, str(name)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _strings(value, f"{key}[{index}]")
    elif isinstance(node, str):
        yield key, node


def installed_values(folders: Iterable[Path]) -> dict[str, set]:
    """The scalar values the config files in ``folders`` and the registered schemas give, by key name (the last
    part of the key), and under ``""`` every string among them (the URLs a user's own configs name)."""
    from hydra.core.config_store import ConfigStore

    from runner.config import register_configs

    register_configs()
    values: dict[str, set] = {"": set()}

    def collect(node: Any, name: str = "") -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                collect(value, str(key))
        elif isinstance(node, list):
            for value in node:
                collect(value, name)
        elif isinstance(node, (str, int, float, bool)):
            values.setdefault(name, set()).add(node)
            if isinstance(node, str):
                values[""].add(node)

    for folder in folders:
        for path in config_files(folder):
            collect(plain_config(path))

    def walk(repo: dict) -> None:
        for value in repo.values():
            if isinstance(value, dict):
                walk(value)
            else:  # a ConfigNode: a registered schema
                collect(plain_schema(value.node))

    walk(ConfigStore.instance().repo)
    return values


def plain_config(path: Path) -> Any:
    """A YAML config file as plain containers, unresolved; None for a YAML file that is not a config."""
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # OmegaConf raises several types for a file that is not a config: it names nothing
        return None


def plain_schema(node: Any) -> Any:
    """A registered schema as plain containers, unresolved; None if OmegaConf cannot make it one."""
    try:
        return OmegaConf.to_container(OmegaConf.create(node), resolve=False)
    except Exception:  # a schema OmegaConf cannot turn into a container names nothing
        return None


def config_files(folder: Path) -> Iterator[Path]:
    """Every YAML file under ``folder``, in order."""
    for path in sorted(folder.rglob("*")):
        if path.suffix in (".yaml", ".yml") and path.is_file():
            yield path


def join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name
