"""Who wrote a run folder, and which code resuming it may run.

A run folder is data. Resuming one rebuilds its config, and a config names code: every ``_target_``
is called, and ``recipe`` is imported. A folder handed over by someone else (a colleague's share, a
downloaded experiment) could name anything, ``torch.hub.load`` of a ``hubconf.py`` lying beside it
or a module inside the folder, and its manifest's checksums prove nothing: whoever crafts the
folder rewrites them too.

So every checkpoint the runner writes carries ``signature.json``: an HMAC-SHA256 of its
``config.yaml``, ``overrides.yaml`` and ``manifest.json`` under a key that never leaves this user's
home (``$RUNNER_HOME/signing.key``, by default ``~/.config/runner/``), written once the manifest is
(:func:`sign`, a commit hook of the save). The manifest holds every other file's digest and the
run's position (steps, data streams), so the signature covers everything the checkpoint means. It
also names the key (``key_id``), so a checkpoint of yours that was changed afterwards, even into a
self-consistent one with its digests recomputed, is told apart from one somebody else wrote, and
refused as damaged (:func:`check_unchanged`).

A checkpoint signed with your key is one of your runs and resumes as it was started. Any other may
only call the code (``_target_``s, the paths ``hydra.utils.get_object`` and its kin are given, the
recipe) that your installed config groups and config folders, or the current command line, name,
and may run code from the Hugging Face Hub (``trust_remote_code``) only where this command line
sets it; anything else is refused in one sentence, unless ``trust_resume=true`` accepts it
deliberately. What such a folder reads from your environment or where it would send the run
(:mod:`runner.folders.foreign_config`) is refused unless this command line gives those keys.

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

from runner.config import CONF_DIR, RECIPES, TRUST_KEY, ConfigError
from runner.engine.constants import MANIFEST_NAME
from runner.folders.foreign_config import (
    ENVIRONMENT_RESOLVERS,
    PURE_RESOLVERS,
    config_files,
    destinations,
    environment_reads,
    installed_values,
    join,
    plain_config,
    plain_schema,
    resolvers_in,
)
from runner.folders.layout import CONFIG_FILE, OVERRIDES_FILE

logger = logging.getLogger("runner")

SIGNATURE_FILE = "signature.json"
KEY_FILE = "signing.key"
SIGNED_FILES = (CONFIG_FILE, OVERRIDES_FILE, MANIFEST_NAME)
SIGNATURE_FORMAT = 2  # 1 (no format field) signed the two config files only: it proves nothing about the manifest


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
        content = read_unlinked(folder / name)
        size = b"absent" if content is None else len(content).to_bytes(8, "little")  # a file may not be removed
        mac.update(name.encode() + b"\0" + size + (content or b""))
    return mac.hexdigest()


def read_unlinked(path: Path) -> bytes | None:
    """The bytes of ``path``, or None if it is absent; never through a link (a link is an OSError)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(descriptor, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return file.read()


def _key_id(key: bytes) -> str:
    """Names the key in a signature without revealing anything of it."""
    return hmac.new(key, b"runner signing key id", hashlib.sha256).hexdigest()[:16]


def sign(folder: str | os.PathLike) -> None:
    """Write ``folder/signature.json`` for its config files and manifest (nothing when no key can be made).

    A checkpoint's commit hook: it runs once the manifest is written, before the folder is committed.
    """
    key = signing_key(create=True)
    if key is not None:
        signature = {"format": SIGNATURE_FORMAT, "key_id": _key_id(key), "hmac_sha256": _digest(Path(folder), key)}
        (Path(folder) / SIGNATURE_FILE).write_text(json.dumps(signature))


def signature_of(checkpoint: Path) -> str:
    """``"yours"``: signed with this user's key, as it was saved; ``"changed"``: signed with this user's key but
    changed since; ``"other"``: signed with another key, with an older kind of signature, or not at all."""
    key = signing_key(create=False)
    try:
        signature = json.loads(read_unlinked(checkpoint / SIGNATURE_FILE) or b"null")
        expected, key_id = signature["hmac_sha256"], signature["key_id"]
        if key is None or signature.get("format") != SIGNATURE_FORMAT or key_id != _key_id(key):
            return "other"
        if isinstance(expected, str) and hmac.compare_digest(_digest(checkpoint, key), expected):
            return "yours"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "other"
    return "changed"


def signed_by_you(checkpoint: Path) -> bool:
    """Whether ``checkpoint``'s config files and manifest carry a valid signature made with this user's key."""
    return signature_of(checkpoint) == "yours"


def check_unchanged(checkpoint: Path) -> None:
    """Refuse a checkpoint signed with this user's key whose signed files changed since (a damaged checkpoint).

    Raises:
        CheckpointError: One sentence naming the checkpoint.
    """
    from runner.engine.checkpoint.errors import CheckpointError

    if signature_of(checkpoint) == "changed":
        raise CheckpointError(
            f"{SIGNATURE_FILE} was made with your key ({key_path()}) for other contents of "
            f"{', '.join(SIGNED_FILES[:-1])} and {SIGNED_FILES[-1]}: the checkpoint was changed after it was saved, so "
            "it is treated as damaged"
        )


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


# Hydra's functions that return the object at a dotted path: that path names code as a _target_ does.
GETTERS = ("hydra.utils.get_object", "hydra.utils.get_method", "hydra.utils.get_class", "hydra.utils.get_static_method")


def object_paths_in(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(key, path)`` for every dotted path a :data:`GETTERS` node is given (``path:``, or its first ``_args_``)."""
    for key, target in targets_in(node):
        found, where = (node, prefix) if key == "_target_" else (_select(node, key), join(prefix, key))
        if target in GETTERS and isinstance(found, dict):
            args = found.get("_args_")
            if "path" in found:
                yield join(where, "path"), str(found["path"])
            elif isinstance(args, list) and args:
                yield join(where, "_args_[0]"), str(args[0])


def _select(node: Any, key: str) -> Any:
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("["):
            node = node[int(part[1:-1])] if isinstance(node, list) else None
        else:
            node = node.get(part) if isinstance(node, dict) else None
    return node


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
        for path in config_files(folder):
            config = plain_config(path)
            targets.update(target for _, target in targets_in(config))
            targets.update(name for _, name in object_paths_in(config))
            if isinstance(config, dict) and isinstance(config.get("recipe"), str):
                recipes.add(config["recipe"])

    def walk(repo: dict) -> None:
        for value in repo.values():
            if isinstance(value, dict):
                walk(value)
            else:  # a ConfigNode: a registered schema
                targets.update(target for _, target in targets_in(plain_schema(value.node)))
                targets.update(name for _, name in object_paths_in(plain_schema(value.node)))

    walk(ConfigStore.instance().repo)
    return targets, recipes


def override_names(lines: Iterable[str]) -> Iterator[tuple[str, str, str]]:
    """``(kind, name, shown)`` for each ``_target_`` (kind ``target``), recipe (``recipe``) and resolver other than
    the pure ones and those that read the environment (``resolver``) that the override lines name, values included
    (``+metrics.m={_target_: ...}``); a line Hydra cannot parse is ``unparsed``, shown as it is."""
    from runner.config import overrides as parsed

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
                for where, name in object_paths_in(value, key):
                    yield "target", name, f"{where}={name}"
                yield from _remote_code_in({key.rpartition(".")[2]: value}, key.rpartition(".")[0])


def command_line_names(overrides: Iterable[str]) -> tuple[set[str], set[str]]:
    """The ``_target_``s and recipes that the overrides typed on this command line name."""
    found = list(override_names(overrides))
    return {name for kind, name, _ in found if kind == "target"}, {name for kind, name, _ in found if kind == "recipe"}


def saved_names(checkpoint: Path) -> list[tuple[str, str, str]]:
    """``(kind, name, shown)`` for what ``checkpoint``'s config and saved overrides name: each ``_target_``
    (``target``) and path given to a getter (:data:`GETTERS`), the recipe (``recipe``), and each resolver that may
    build config (``resolver``).

    Raises:
        ConfigError: ``config.yaml`` is not a mapping, or ``overrides.yaml`` not a list of strings.
    """
    from runner.folders.layout import saved_overrides

    path = checkpoint / SIGNED_FILES[0]
    config = plain_config(path)
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a config; the checkpoint is damaged, so resume another one.")
    names = [("target", target, f"{key}._target_={target}") for key, target in targets_in(config)]
    names += [("target", name, f"{key}={name}") for key, name in object_paths_in(config)]
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
    """``("resolver", name, shown)`` for each resolver that may build config (neither pure nor one that reads the
    environment, which :func:`runner.folders.foreign_config.environment_reads` reports)."""
    for where, resolver in resolvers_in(node, key):
        if resolver not in PURE_RESOLVERS + ENVIRONMENT_RESOLVERS:
            yield "resolver", resolver, f"{where} uses the resolver {resolver}"


def check_resumable(
    checkpoint: Path, *, path: str, overrides: list[str], search_path: list[str], command: str = "resume"
) -> None:
    """Refuse to resume ``checkpoint`` if it is not your run and names code, reads your environment or sends the run
    somewhere that your configs and command line do not; refuse one of yours that was changed since it was saved.

    Args:
        checkpoint: The checkpoint folder ``resume=path`` chose.
        path: What the user typed after ``resume=``, for the message.
        overrides: This command line's overrides (``trust_resume=true`` among them accepts any code).
        search_path: The current command line's config folders (``file://...``, ``pkg://...``), beside conf/.
        command: ``resume``, or the verb that rebuilds the run's model instead (``generate``), for the message.

    Raises:
        ConfigError: One sentence listing what is refused and how to accept it.
    """
    from runner.engine.checkpoint.errors import CheckpointError

    asked, doing = (f"resume={path}", "resuming") if command == "resume" else (f"runner {command} {path}", command)
    try:
        check_unchanged(checkpoint)
    except CheckpointError as error:
        raise ConfigError(
            f"{asked}: {error}; resume an earlier checkpoint, or the run folder, which skips it."
        ) from None
    if signed_by_you(checkpoint):
        return
    folders = [CONF_DIR, *search_path_folders(search_path)]
    if not _trusted(overrides):
        _check_code(checkpoint, asked=asked, doing=doing, overrides=overrides, folders=folders)
    typed = _typed_keys(overrides)
    config, run_dir = plain_config(checkpoint / CONFIG_FILE), checkpoint.resolve().parent.parent
    from runner.folders.layout import saved_overrides

    reaches = environment_reads(config, saved_overrides(checkpoint), typed=typed)
    reaches += destinations(config, run_dir=run_dir, typed=typed, installed=installed_values(folders))
    if reaches:
        raise ConfigError(
            f"{asked}: {checkpoint} was not written by you (it carries no signature of your key {key_path()}) and "
            f"its config reaches past the folder ({', '.join(reaches)}); {doing} would read your environment or send "
            "the run there, so give each of those keys on this command line (the value you want, or null) to accept "
            "or replace it."
        )


def _check_code(checkpoint: Path, *, asked: str, doing: str, overrides: list[str], folders: list[Path]) -> None:
    """Refuse a folder (not yours) that names code your config groups and this command line do not."""
    run_dir = checkpoint.resolve().parent.parent
    if Path.cwd().resolve().is_relative_to(run_dir):
        raise ConfigError(
            f"{asked}: {run_dir} was not written by you and this command runs inside it, where Python imports "
            f"the folder's own modules first; run it from outside the folder (cd {run_dir.parent})."
        )
    targets, recipes = installed_names(folders)
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


def _typed_keys(overrides: Iterable[str]) -> list[str]:
    """The keys this command line's overrides set (``+``/``++`` dropped)."""
    from runner.config import overrides as parsed

    keys = []
    for line in overrides:
        try:
            keys.append(parsed.key(line))
        except ConfigError:  # the command line was parsed before this: a line that does not parse sets nothing
            continue
    return keys


def _trusted(overrides: Iterable[str]) -> bool:
    """Whether this command line's last ``trust_resume=`` says true."""
    from runner.config import overrides as parsed

    value = parsed.value(overrides, TRUST_KEY)
    return value is not None and value.lower() in ("true", "yes", "1", "on")
