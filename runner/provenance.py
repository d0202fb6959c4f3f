"""Who wrote a run folder, and which code resuming it may run.

A run folder is data. Resuming one rebuilds its config, and a config names code: every ``_target_``
is called, and ``recipe`` is imported. A folder handed over by someone else (a colleague's share, a
downloaded experiment) could name anything, ``torch.hub.load`` of a ``hubconf.py`` lying beside it
or a module inside the folder, and its manifest's checksums prove nothing: whoever crafts the
folder rewrites them too.

So every checkpoint the runner writes carries ``signature.json``: an HMAC-SHA256 of its
``config.yaml`` and ``overrides.yaml`` under a key that never leaves this user's home
(``$RUNNER_HOME/signing.key``, by default ``~/.config/runner/``). A checkpoint signed with your key
is one of your runs and resumes as it was started. Any other may only call the ``_target_``s and
recipe that your installed config groups and config folders, or the current command line, name;
anything else is refused in one sentence, unless ``trust_resume=true`` accepts it deliberately.

Nothing here imports the code it checks: the names are compared as strings, before anything of
the folder's config is imported, validated or composed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner.config import RECIPES, ConfigError

SIGNATURE_FILE = "signature.json"
KEY_FILE = "signing.key"
TRUST_KEY = "trust_resume"  # the override that accepts a folder's code deliberately
SIGNED_FILES = ("config.yaml", "overrides.yaml")  # runner.worker's CONFIG_FILE and OVERRIDES_FILE


def key_path() -> Path:
    """``$RUNNER_HOME/signing.key``; ``RUNNER_HOME`` defaults to ``$XDG_CONFIG_HOME/runner`` (``~/.config/runner``)."""
    home = os.environ.get("RUNNER_HOME")
    if not home:
        config_home = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
        home = os.path.join(config_home, "runner")
    return Path(home) / KEY_FILE


def signing_key(*, create: bool) -> bytes | None:
    """This user's key (made on first use, readable by the user only); None if there is none and cannot be one."""
    path = key_path()
    try:
        key = bytes.fromhex(path.read_text().strip())
        return key if len(key) == 32 else None
    except FileNotFoundError:
        if not create:
            return None
    except (OSError, ValueError):
        return None
    key = secrets.token_bytes(32)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(descriptor, "w") as f:
            f.write(key.hex())
        os.link(partial, path)  # appears whole, and only if no other process made one first
    except FileExistsError:
        return signing_key(create=False)
    except OSError:  # a read-only home: runs are not signed, and resuming them checks their code
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)
    return key


def _digest(folder: Path, key: bytes) -> str:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for name in SIGNED_FILES:
        content = (folder / name).read_bytes()
        mac.update(name.encode() + b"\0" + len(content).to_bytes(8, "little") + content)
    return mac.hexdigest()


def sign(folder: Path) -> None:
    """Write ``folder/signature.json`` for the config files in it (nothing when no key can be made)."""
    key = signing_key(create=True)
    if key is not None:
        (folder / SIGNATURE_FILE).write_text(json.dumps({"hmac_sha256": _digest(folder, key)}))


def signed_by_you(checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s config files carry a valid signature made with this user's key."""
    key = signing_key(create=False)
    try:
        expected = json.loads((checkpoint / SIGNATURE_FILE).read_text())["hmac_sha256"]
        return key is not None and isinstance(expected, str) and hmac.compare_digest(_digest(checkpoint, key), expected)
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ---------------------------------------------------------------------------------------- what code is named
def targets_in(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(key, target)`` for every ``_target_`` in a plain (container) config, at any depth."""
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{prefix}.{key}" if prefix else str(key)
            if key == "_target_":
                yield prefix or "_target_", str(value)
            else:
                yield from targets_in(value, where)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from targets_in(value, f"{prefix}[{index}]")


def _plain(path: Path) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:  # a YAML file that is not a config (OmegaConf raises several types): it names nothing
        return None


def _config_files(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.rglob("*")):
        if path.suffix in (".yaml", ".yml") and path.is_file():
            yield path


def search_path_folders(entries: Iterable[str]) -> list[Path]:
    """The folders of Hydra search-path entries (``file://...``, ``pkg://...`` or a plain path)."""
    import importlib.util

    folders = []
    for entry in entries:
        if entry.startswith("pkg://"):
            try:
                spec = importlib.util.find_spec(entry[len("pkg://") :].replace("/", "."))
            except (ImportError, ValueError):
                spec = None
            folders += [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
        else:
            folders.append(Path(entry.removeprefix("file://")).expanduser().resolve())
    return [folder for folder in folders if folder.is_dir()]


def installed_names(folders: Iterable[Path]) -> tuple[set[str], set[str]]:
    """The ``_target_``s and recipes that the config groups in ``folders`` and the registered schemas name."""
    from hydra.core.config_store import ConfigStore

    from runner.config import register_configs

    register_configs()  # the schemas name the built-in options' targets
    targets, recipes = set(), set(RECIPES) | set(RECIPES.values())
    for folder in folders:
        for path in _config_files(folder):
            config = _plain(path)
            targets.update(target for _, target in targets_in(config))
            if isinstance(config, dict) and isinstance(config.get("recipe"), str):
                recipes.add(config["recipe"])

    def walk(repo: dict) -> None:
        for value in repo.values():
            if isinstance(value, dict):
                walk(value)
            else:  # a ConfigNode: a registered schema
                targets.update(target for _, target in targets_in(_container(value.node)))

    walk(ConfigStore.instance().repo)
    return targets, recipes


def _container(node: Any) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.create(node), resolve=False)
    except Exception:  # a schema OmegaConf cannot turn into a container names no target
        return None


def command_line_names(overrides: Iterable[str]) -> tuple[set[str], set[str]]:
    """The ``_target_``s and recipes that the overrides typed on this command line name."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    targets, recipes = set(), set()
    parser = OverridesParser.create()
    for line in overrides:
        try:
            (override,) = parser.parse_overrides([line])
        except Exception:  # Hydra's OverrideParseException: the command-line check reports it
            continue
        key = override.key_or_group.lstrip("+~")
        if override.is_sweep_override():
            values = list(override.sweep_iterator())
        else:
            values = [override.value()]
        for value in values:
            if key == "recipe" and isinstance(value, str):
                recipes.add(value)
            elif key == "_target_" or key.endswith("._target_"):
                targets.add(str(value))
            else:
                targets.update(target for _, target in targets_in(value))
    return targets, recipes


def saved_names(checkpoint: Path) -> list[tuple[str, str]]:
    """``(key, name)`` for each target and the recipe that ``checkpoint``'s config and overrides name."""
    config = _plain(checkpoint / SIGNED_FILES[0])
    names = list(targets_in(config)) if isinstance(config, dict) else []
    if isinstance(config, dict) and config.get("recipe") is not None:
        names.append(("recipe", str(config["recipe"])))
    saved = _plain(checkpoint / SIGNED_FILES[1])
    if isinstance(saved, list):
        for line in map(str, saved):
            key, _, value = line.lstrip("+~").partition("=")
            if key == "recipe" or key == "_target_" or key.endswith("._target_"):
                names.append((key.removesuffix("._target_"), value.strip("'\"")))
    return names


def check_resumable(checkpoint: Path, *, path: str, overrides: list[str], search_path: list[str]) -> None:
    """Refuse to resume ``checkpoint`` if it is not your run and names code your configs and command line do not.

    Args:
        checkpoint: The checkpoint folder ``resume=path`` chose.
        path: What the user typed after ``resume=``, for the message.
        overrides: This command line's overrides (``trust_resume=true`` among them accepts any code).
        search_path: The current command line's config folders (``file://...``, ``pkg://...``), beside conf/.

    Raises:
        ConfigError: One sentence listing the unknown targets and how to accept them.
    """
    if _trusted(overrides) or signed_by_you(checkpoint):
        return
    from runner.app import CONF_DIR

    targets, recipes = installed_names([CONF_DIR, *search_path_folders(search_path)])
    typed_targets, typed_recipes = command_line_names(overrides)
    targets |= typed_targets
    recipes |= typed_recipes
    unknown = []
    for key, name in saved_names(checkpoint):
        allowed = recipes if key == "recipe" else targets
        shown = f"recipe={name}" if key == "recipe" else f"{key}._target_={name}"
        if name not in allowed and shown not in unknown:
            unknown.append(shown)
    if unknown:
        raise ConfigError(
            f"resume={path}: {checkpoint} was not written by you (it carries no signature of your key "
            f"{key_path()}) and names code that your config groups and this command line do not "
            f"({', '.join(unknown)}); resuming would run it, so read that code first and add "
            f"{TRUST_KEY}=true to accept it."
        )


def _trusted(overrides: Iterable[str]) -> bool:
    """Whether this command line's last ``trust_resume=`` says true."""
    values = [line.partition("=")[2] for line in overrides if line.partition("=")[0].lstrip("+") == TRUST_KEY]
    return bool(values) and values[-1].strip("'\"").lower() in ("true", "yes", "1", "on")
