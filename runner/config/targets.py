"""Check every Hydra ``_target_`` node of a composed config before any process is launched.

Hydra finds a misspelled class or keyword only when ``instantiate`` runs: inside the workers, after
processes are spawned and data is downloading, and as a long traceback. :func:`check_targets` finds
the same mistakes first, as one sentence: it walks the config as plain containers (unresolved, so an
interpolation like ``${data.root}`` stays as written and nothing is evaluated), imports each dotted
path with :func:`locate`, and compares the node's keys with the parameters its callable takes.

A torch extension built for another torch than the installed one (torchvision, torchaudio: their import
fails with a missing operator, symbol or CUDA library) gets the ``pip install`` that matches, not "fix that
module".

Importing this module imports no torch; checking a config imports each target's module, which may
(``torch.optim.AdamW`` does), so call :func:`check_targets` once, where the launch is decided.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import re
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from runner.config import ConfigError
from runner.config.value_checks import SYNONYMS

KEYWORD_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
# Packages whose compiled part is built against one torch release: the release of each that matches torch
# major.minor.patch (torchvision 0.28.0 for torch 2.13.0; torchaudio shares torch's number).
TORCH_EXTENSIONS = {
    "torchvision": lambda major, minor, patch: f"0.{minor + 15}.{patch}",
    "torchaudio": lambda major, minor, patch: f"{major}.{minor}.{patch}",
}
# How such a package fails to import against another torch build: its operators are missing (its library did
# not load), a symbol of torch's is missing, or one of torch's libraries (libtorch_cuda, libc10_cuda) is absent.
_BUILT_FOR_ANOTHER_TORCH = re.compile(
    r"operator \w+::\w+ does not exist|undefined symbol|cannot open shared object file|Library not loaded|"
    r"DLL load failed"
)
_TORCH_INDEX = "https://download.pytorch.org/whl"


def locate(path: str, *, key: str) -> Any:
    """The object at dotted ``path`` (module attribute, class, classmethod, function), importing its module.

    The longest importable prefix of ``path`` is imported as a module and the rest is read with getattr,
    so ``torch.nn.CrossEntropyLoss`` and ``pkg.mod.Class.from_config`` both resolve.

    Raises:
        ConfigError: one sentence naming ``key`` (e.g. ``'model._target_'``) and ``path``.
    """
    parts = path.split(".")
    if not all(part.isidentifier() for part in parts):
        raise ConfigError(f"{key}={path!r} is not a dotted path; write one like 'package.module.Class'.")
    obj, imported = _import_longest_prefix(parts, key=key, path=path)
    for depth in range(imported, len(parts)):
        owner, name = obj, parts[depth]
        try:
            obj = getattr(owner, name)
        except AttributeError:
            owner_path = ".".join(parts[:depth])
            close = _close_match(name, _public_names(owner))
            hint = f" (did you mean '{owner_path}.{close}'?)" if close else ""
            raise ConfigError(
                f"{key}={path!r} does not import: {owner_path} has no {name!r}{hint}; fix the dotted path."
            ) from None
    return obj


def check_targets(cfg: Any) -> None:
    """Check that every ``_target_`` node of ``cfg`` imports and accepts its keys.

    Args:
        cfg: the composed config, a DictConfig or a plain dict; its ``hydra`` key is skipped.

    Raises:
        ConfigError: one sentence naming the full key (e.g. ``'data.train.transform._target_'``) and the fix.
    """
    if not isinstance(cfg, dict):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(cfg, resolve=False)
    _walk({name: value for name, value in cfg.items() if name != "hydra"}, key="")
    if isinstance(cfg.get("recipe"), str):
        check_recipe(cfg["recipe"])
    _check_tracker_targets(cfg)


def _check_tracker_targets(cfg: Any) -> None:
    """Each tracker node with a ``_target_`` names a GeneralTracker subclass and sets every parameter its
    constructor requires (its import and keys are checked with every target's).

    Only trackers are checked for missing parameters: the runner builds a tracker from its node alone, whereas
    a recipe completes other nodes itself (an optimizer's parameters, a GPT's vocabulary size)."""
    from runner.config import TRACKERS

    trackers = (cfg.get("tracker") if hasattr(cfg, "get") else None) or {}
    for name, node in trackers.items():
        if name in TRACKERS or not hasattr(node, "get") or not isinstance(node.get("_target_"), str):
            continue
        target = locate(node["_target_"], key=f"tracker.{name}._target_")
        bases = {f"{base.__module__}.{base.__qualname__}" for base in getattr(target, "__mro__", ())}
        if "runner.engine.tracking.base.GeneralTracker" not in bases:  # by name: checks never import torch
            raise ConfigError(
                f"tracker.{name}._target_={node['_target_']} is not a tracker; name a subclass of "
                "runner.engine.GeneralTracker (with a name, and log(values, step))."
            )
        if node.get("_partial_"):
            raise ConfigError(
                f"tracker.{name}._partial_=true: the runner builds the tracker itself, whole; remove _partial_ and "
                "set its parameters in the node."
            )
        _check_required_parameters(target, node, key=f"tracker.{name}", path=node["_target_"])


def _check_required_parameters(target: Any, node: dict, *, key: str, path: str) -> None:
    """Raise :class:`ConfigError` naming the parameters of ``target`` without a default that ``node`` neither sets
    nor passes in ``_args_``."""
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return  # no signature to compare with
    given = node.get("_args_")
    positional = len(given) if isinstance(given, (list, tuple)) else 0
    missing = [
        parameter
        for index, parameter in enumerate(parameters)
        if parameter.default is inspect.Parameter.empty
        and parameter.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and not (index < positional and parameter.kind is not inspect.Parameter.KEYWORD_ONLY)
        and not (parameter.name in node and parameter.kind is not inspect.Parameter.POSITIONAL_ONLY)
    ]
    if not missing:
        return
    names = [parameter.name for parameter in missing]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    first = missing[0]
    example = f"{key}._args_=[...]" if first.kind is inspect.Parameter.POSITIONAL_ONLY else f"{key}.{first.name}=..."
    raise ConfigError(
        f"{key}: {path} requires {listed}, which the node does not set (no default); set "
        f"{'it' if len(names) == 1 else 'them'} in the node, e.g. +{example}"
    )


def check_recipe(recipe: str) -> None:
    """Check that ``recipe`` imports and has a ``train(cfg, accelerator)``.

    Raises:
        ConfigError: one sentence naming the recipe and the fix.
    """
    from runner.config.recipe_validation import recipe_module

    module_name = recipe_module(recipe)
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise _broken_import(error, module=module_name, key="recipe", path=recipe) from error
    train = getattr(module, "train", None)
    if not callable(train):
        raise ConfigError(
            f"recipe={recipe!r} names the module {module_name}, which has no train(cfg, accelerator); point recipe "
            "at a module that defines one."
        )
    try:
        takes = inspect.signature(train).bind(None, None)
    except TypeError:
        takes = None
    except ValueError:  # no signature to compare with
        return
    if takes is None:
        raise ConfigError(
            f"recipe={recipe!r}: {module_name}.train must take (cfg, accelerator); change its parameters."
        )


def _walk(value: Any, *, key: str) -> None:
    if isinstance(value, dict):
        if "_target_" in value:
            _check_node(value, key=key)
        for name, child in value.items():
            _walk(child, key=_join(key, str(name)))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            _walk(child, key=f"{key}[{index}]")


def _check_node(node: dict, *, key: str) -> None:
    path, target_key = node["_target_"], _join(key, "_target_")
    if not isinstance(path, str):
        raise ConfigError(f"{target_key}={path!r} must be a dotted path, like 'package.module.Class'.")
    if "${" in path:
        return  # an interpolation: known only once resolved, and we never resolve
    target = locate(path, key=target_key)
    if not callable(target):
        raise ConfigError(
            f"{target_key}={path!r} is not callable (it is a {type(target).__name__}); "
            "point it at a class or a function."
        )
    _check_keywords(target, node, key=key, path=path)


def _check_keywords(target: Any, node: dict, *, key: str, path: str) -> None:
    try:
        kinds = {name: parameter.kind for name, parameter in inspect.signature(target).parameters.items()}
    except (TypeError, ValueError):
        return  # some builtins have no signature: nothing to compare with
    if inspect.Parameter.VAR_KEYWORD in kinds.values():
        return
    accepted = [name for name, kind in kinds.items() if kind in KEYWORD_KINDS]
    for name in map(str, node):
        if name.startswith("_") or name in accepted:
            continue
        takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no keyword arguments"
        close = _close_match(name, accepted)
        if kinds.get(name) is inspect.Parameter.POSITIONAL_ONLY:
            hint = f" ({name} is positional-only; pass it in {_join(key, '_args_')})"
        else:
            hint = f" (did you mean '{_join(key, close)}'?)" if close else ""
        raise ConfigError(f"{_join(key, name)} is not a parameter of {path}; {takes}{hint}.")


_EXTRAS = {"transformers": "hf", "datasets": "hf", "peft": "peft", "torchvision": "vision"}  # pyproject's extras


def _import_longest_prefix(parts: list[str], *, key: str, path: str) -> tuple[ModuleType, int]:
    """Import ``parts[:1]``, ``parts[:2]``, ...; return the last that is a module, and how many parts it spans."""
    module = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:  # the module exists, but something it imports does not
                raise _broken_import(error, module=name, key=key, path=path) from error
            if module is None and name in _EXTRAS:  # a package of one of our extras
                raise ConfigError(
                    f"{key}={path!r} does not import: {name} is not installed; install it with pip install -e "
                    f'".[{_EXTRAS[name]}]" (or pip install {name}).'
                ) from None
            if module is None:
                raise ConfigError(
                    f"{key}={path!r} does not import: there is no module named {name!r}; fix the dotted path, "
                    "or install the package (or run from the folder that holds it)."
                ) from None
            return module, depth - 1
        except Exception as error:
            raise _broken_import(error, module=name, key=key, path=path) from error
    return module, len(parts)


def _broken_import(error: Exception, *, module: str, key: str, path: str) -> ConfigError:
    lines = str(error).strip().splitlines()
    what = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename != __file__]
    frames = [frame for frame in frames if not frame.filename.startswith("<frozen")]
    mismatch = _built_for_another_torch(error, module=module, frames=frames, what=what)
    if mismatch is not None:
        return ConfigError(f"{key}={path!r} does not import: {mismatch}")
    where = "" if isinstance(error, SyntaxError) or not frames else f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return ConfigError(f"{key}={path!r} does not import: importing {module} raised {what}{where}; fix that module.")


def _built_for_another_torch(
    error: Exception, *, module: str, frames: list[traceback.FrameSummary], what: str
) -> str | None:
    """What to install when ``error`` says a torch extension (torchvision, torchaudio) does not fit the torch
    installed here, or None when it says something else.

    Its fix is a reinstall, not an edit of "that module": the generic sentence would send the user into
    torchvision's sources. Versions are read from the installed metadata; the broken package is not imported.
    """
    if not _BUILT_FOR_ANOTHER_TORCH.search(str(error)):
        return None
    package = _torch_extension_of(error, module=module, frames=frames)
    torch_version = _installed_version("torch")
    release = re.match(r"(\d+)\.(\d+)\.(\d+)", torch_version or "")
    if package is None or release is None:
        return None
    matching = TORCH_EXTENSIONS[package](*map(int, release.groups()))
    build = torch_version.partition("+")[2]  # cpu, cu126, rocm6.4, ...: the index that torch came from
    if build:  # pinned with its local label, so pip replaces an installed build of the same number
        command = f'pip install "{package}=={matching}+{build}" --index-url {_TORCH_INDEX}/{build}'
    else:
        command = f'pip install "{package}=={matching}"'
    installed = _installed_version(package)
    which = f"{package} {installed}" if installed else f"this {package}"
    return (
        f"{which} was built for another torch than the {torch_version} installed here ({what}); install the "
        f"{package} build that matches your torch: `{command}`."
    )


def _torch_extension_of(error: Exception, *, module: str, frames: list[traceback.FrameSummary]) -> str | None:
    """The torch extension that failed: the one the missing operator belongs to, else the innermost one the
    traceback passes through (a user's module may import it), else the one being imported."""
    named = re.search(r"operator (\w+)::", str(error))
    suspects = [named.group(1)] if named else []
    suspects += [part for frame in reversed(frames) for part in reversed(Path(frame.filename).parts)]
    suspects.append(module.split(".")[0])
    return next((name for name in suspects if name in TORCH_EXTENSIONS), None)


def _installed_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _public_names(owner: Any) -> list[str]:
    names = [name for name in dir(owner) if not name.startswith("_")]
    if isinstance(owner, ModuleType) and hasattr(owner, "__path__"):  # a package: its submodules too
        names += [info.name for info in pkgutil.iter_modules(owner.__path__)]
    return names


def _close_match(name: str, candidates: list[str]) -> str | None:
    """The closest of ``candidates`` to ``name``, ignoring case (or the name ``name`` means elsewhere, e.g.
    ``learning_rate`` for ``lr``), or None when none is close."""
    if SYNONYMS.get(name.lower()) in candidates:
        return SYNONYMS[name.lower()]
    by_lower = {candidate.lower(): candidate for candidate in candidates}
    close = difflib.get_close_matches(name.lower(), by_lower, n=1)
    return by_lower[close[0]] if close else None


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name
