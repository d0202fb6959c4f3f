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
recipe that your installed config groups and config folders, or the current command line, name,
and may run code from the Hugging Face Hub (``trust_remote_code``) only where this command line
sets it; anything else is refused in one sentence, unless ``trust_resume=true`` accepts it
deliberately.

Nothing here imports the code it checks: the names are compared as strings, before anything of
the folder's config is imported, validated or composed.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from runner.config import CONF_DIR, RECIPES, TRUST_KEY, ConfigError
from runner.layout import CONFIG_FILE, OVERRIDES_FILE

logger = logging.getLogger("runner")

SIGNATURE_FILE = "signature.json"
KEY_FILE = "signing.key"
SIGNED_FILES = (CONFIG_FILE, OVERRIDES_FILE)


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
        info = os.stat(path, follow_symlinks=False)
        key = bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        if not create:
            return None
    except (OSError, ValueError):
        return None
    else:
        if info.st_uid != os.getuid() or info.st_mode & 0o077 or not stat.S_ISREG(info.st_mode):
            # Another user could read it (and sign as you) or plant it: it proves nothing.
            logger.warning("Ignoring %s: it must be a file of yours that only you can read (chmod 600).", path)
            return None
        return key if len(key) == 32 else None
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


# Resolvers a saved value may use: they read the environment or the clock. Any other (oc.create,
# oc.decode, a user's own) builds config, a _target_ node among it, at the moment it resolves.
PLAIN_RESOLVERS = ("oc.env", "now")
_RESOLVER = re.compile(r"\$\{\s*([A-Za-z_][\w.\-]*)\s*:")


def override_names(lines: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """``(kind, name, shown)`` for each ``_target_`` (kind ``target``), recipe (``recipe``) and resolver other than
    :data:`PLAIN_RESOLVERS` (``resolver``) that the override lines name, values included
    (``+metrics.m={_target_: ...}``); a line Hydra cannot parse is ``unparsed``, shown as it is."""
    from runner import overrides as parsed

    for line in lines:
        yield from _resolvers_in(line, line)
        try:
            (override,) = parsed.parse([line])
            key = override.key_or_group
            values = list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]
        except Exception:  # a line Hydra cannot parse (ConfigError), or a value it cannot build
            yield "unparsed", line, line
            continue
        for value in values:
            if key == "recipe":
                yield "recipe", str(value), f"recipe={value}"
            elif key == "_target_" or key.endswith("._target_"):
                yield "target", str(value), f"{key}={value}"
            else:
                for where, target in targets_in(value, key):
                    yield "target", target, f"{where}._target_={target}"
                yield from _remote_code_in({key.rpartition(".")[2]: value}, key.rpartition(".")[0])


def command_line_names(overrides: Iterable[str]) -> tuple[set[str], set[str]]:
    """The ``_target_``s and recipes that the overrides typed on this command line name."""
    found = list(override_names(overrides))
    return {name for kind, name, _ in found if kind == "target"}, {name for kind, name, _ in found if kind == "recipe"}


def saved_names(checkpoint: Path) -> list[tuple[str, str, str]]:
    """``(kind, name, shown)`` for what ``checkpoint``'s config and saved overrides name: each ``_target_``
    (``target``), the recipe (``recipe``), and each resolver beyond :data:`PLAIN_RESOLVERS` (``resolver``).

    Raises:
        ConfigError: ``config.yaml`` is not a mapping, or ``overrides.yaml`` not a list of strings.
    """
    from runner.layout import saved_overrides

    path = checkpoint / SIGNED_FILES[0]
    config = _plain(path)
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a config; the checkpoint is damaged, so resume another one.")
    names = [("target", target, f"{key}._target_={target}") for key, target in targets_in(config)]
    if config.get("recipe") is not None:
        names.append(("recipe", str(config["recipe"]), f"recipe={config['recipe']}"))
    names += list(_resolvers_in(config, ""))
    names += list(_remote_code_in(config, ""))
    return names + list(override_names(saved_overrides(checkpoint)))


REMOTE_CODE_KEY = "trust_remote_code"  # Hugging Face's switch that runs a model's or dataset's code from the Hub


def _remote_code_in(node: Any, key: str) -> Iterator[tuple[str, str, str]]:
    """``("remote code", key, shown)`` for each ``trust_remote_code`` set to anything but false or null.

    An interpolation counts as set: what it resolves to is not known before it runs.
    """
    if isinstance(node, dict):
        for name, value in node.items():
            where = f"{key}.{name}" if key else str(name)
            if (
                name == REMOTE_CODE_KEY
                and value not in (False, None, 0)
                and str(value).lower() not in ("false", "null")
            ):
                yield "remote code", where, f"{where}={str(value).lower() if isinstance(value, bool) else value}"
            else:
                yield from _remote_code_in(value, where)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _remote_code_in(value, f"{key}[{index}]")


def _resolvers_in(node: Any, key: str) -> Iterator[tuple[str, str, str]]:
    if isinstance(node, dict):
        for name, value in node.items():
            yield from _resolvers_in(str(name), key)
            yield from _resolvers_in(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _resolvers_in(value, f"{key}[{index}]")
    elif isinstance(node, str):
        for resolver in _RESOLVER.findall(node):
            if resolver not in PLAIN_RESOLVERS:
                yield "resolver", resolver, f"{key} uses the resolver {resolver}"


def check_resumable(
    checkpoint: Path, *, path: str, overrides: list[str], search_path: list[str], command: str = "resume"
) -> None:
    """Refuse to resume ``checkpoint`` if it is not your run and names code your configs and command line do not.

    Args:
        checkpoint: The checkpoint folder ``resume=path`` chose.
        path: What the user typed after ``resume=``, for the message.
        overrides: This command line's overrides (``trust_resume=true`` among them accepts any code).
        search_path: The current command line's config folders (``file://...``, ``pkg://...``), beside conf/.
        command: ``resume``, or the verb that rebuilds the run's model instead (``generate``), for the message.

    Raises:
        ConfigError: One sentence listing the unknown targets and how to accept them.
    """
    asked, doing = (f"resume={path}", "resuming") if command == "resume" else (f"runner {command} {path}", command)
    if _trusted(overrides) or signed_by_you(checkpoint):
        return
    run_dir = checkpoint.resolve().parent.parent
    if Path.cwd().resolve().is_relative_to(run_dir):
        raise ConfigError(
            f"{asked}: {run_dir} was not written by you and this command runs inside it, where Python imports "
            f"the folder's own modules first; run it from outside the folder (cd {run_dir.parent})."
        )
    targets, recipes = installed_names([CONF_DIR, *search_path_folders(search_path)])
    typed_targets, typed_recipes = command_line_names(overrides)
    typed_remote_code = {name for kind, name, _ in override_names(overrides) if kind == "remote code"}
    allowed = {"target": targets | typed_targets, "recipe": recipes | typed_recipes, "remote code": typed_remote_code}
    unknown = []
    for kind, name, shown in saved_names(checkpoint):
        if name not in allowed.get(kind, ()) and shown not in unknown:
            unknown.append(shown)
    if unknown:
        raise ConfigError(
            f"{asked}: {checkpoint} was not written by you (it carries no signature of your key "
            f"{key_path()}) and names code that your config groups and this command line do not "
            f"({', '.join(unknown)}); {doing} would run it, so read that code first and add "
            f"{TRUST_KEY}=true to accept it."
        )


def _trusted(overrides: Iterable[str]) -> bool:
    """Whether this command line's last ``trust_resume=`` says true."""
    from runner import overrides as parsed

    value = parsed.value(overrides, TRUST_KEY)
    return value is not None and value.lower() in ("true", "yes", "1", "on")
