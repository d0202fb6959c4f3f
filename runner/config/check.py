"""Check a command line's overrides before any process starts: compose once, one sentence per mistake.

A typo becomes ``trainer.max_stepz is not a key of 'trainer' (did you mean 'trainer.max_steps'?)``
and exit code 2, before Hydra writes a run folder or a worker imports torch.
"""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Callable

from omegaconf import DictConfig, OmegaConf

from runner.config import CONF_DIR, CONFIG_NAME, ConfigError, RunnerConfig
from runner.config import overrides as parsed
from runner.config.search_path import search_path_overrides
from runner.config.validation import check_hardware, validate
from runner.config.value_checks import not_a_key
from runner.training.startup import stamp

# Options that need one of Hydra's plugins, which come with the project's extras.
_PLUGINS = {
    ("hydra/launcher", "joblib"): ("hydra_plugins.hydra_joblib_launcher", "joblib"),
    ("hydra/launcher", "slurm"): ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    ("hydra/launcher", "slurm_cpu"): ("hydra_plugins.hydra_submitit_launcher", "slurm"),
    ("hydra/sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
    ("hparams_search", None): ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
}


def check_plugins(overrides: list[str]) -> None:
    """Raise ConfigError, with the pip command, for an option whose Hydra plugin is not installed."""
    for override in parsed.parse(overrides):
        group, option = override.key_or_group, parsed.text(override)
        needed = _PLUGINS.get((group, option)) or _PLUGINS.get((group, None))
        if needed is None or option in (None, "", "null"):
            continue
        module, extra = needed
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(
                f"{group}={option} needs a Hydra plugin that is not installed ({module}); install it with "
                f"pip install -e '.[{extra}]'."
            )


def check_overrides(
    overrides: list[str],
    *,
    config_name: str = CONFIG_NAME,
    config_dir: str | None = None,
    targets: bool = True,
    before_targets: Callable[[DictConfig], None] | None = None,
    composed: DictConfig | None = None,
    refused: Exception | None = None,
) -> DictConfig:
    """Compose the config once with ``overrides`` (sweeps reduced to their first value), or take the one
    ``overrides`` already ``composed`` (:mod:`runner.cli.single_run`); check it and return it. ``refused`` is
    Hydra's error from composing ``overrides`` as they are, said at once where composing here meets the same one.

    With ``targets`` every ``_target_`` is also imported and its keys checked against its signature,
    and the datasets are prepared (``prepare_data``: fetched or checked). That imports the user's
    modules and torch, so it comes only once the rest of the command line is valid, after
    ``before_targets(cfg)``.

    Raises:
        ConfigError: One sentence naming the bad key, value or option, with the closest valid key.
    """
    cfg = _compose(overrides, config_name, config_dir, refused) if composed is None else composed
    valid = list(OmegaConf.structured(RunnerConfig))
    unknown = sorted(set(cfg) - set(valid))
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a config key; remove it (valid top-level keys: {', '.join(valid)}).")
    validate(cfg, overrides)
    if targets:
        stamp("compose and validate the config")
        if before_targets is not None:
            before_targets(cfg)
        _check_targets_and_data(cfg)
    if not cfg.resume:
        check_hardware(cfg)
    return cfg


def _compose(overrides: list[str], config_name: str, config_dir: str | None, refused: Exception | None) -> DictConfig:
    """The config ``overrides`` compose, without Hydra's own keys and with each sweep at its first value.

    ``refused``, Hydra's error from composing ``overrides`` as they are, is said without composing again where they
    hold neither a ``hydra`` key nor a sweep: composing here would meet the same error."""
    from hydra import compose, initialize_config_dir

    single = search_path_overrides(overrides, config_dir=config_dir)
    same = True
    for override in parsed.parse(overrides):
        if override.key_or_group.startswith("hydra"):
            same = False
            continue
        if override.is_sweep_override():
            same = False
            single.append(f"{override.get_key_element()}={next(iter(override.sweep_string_iterator()))}")
        else:
            single.append(override.input_line)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            if refused is not None and same:
                raise refused
            return compose(config_name, overrides=single)
        except Exception as error:
            raise ConfigError(describe_composition_error(error, single, config_name)) from None


def _check_targets_and_data(cfg: DictConfig) -> None:
    from runner.config.construction import check_construction
    from runner.config.targets import check_targets
    from runner.data import prepare_datasets

    check_targets(cfg)
    check_construction(cfg)
    stamp("import and build the targets")  # torch, and the modules the config names (torchmetrics, ...)
    if not cfg.resume:
        prepare_datasets(cfg.data)  # before Hydra writes anything: missing files, splits that select nothing
        stamp("check the data")


def describe_composition_error(error: Exception, overrides: list[str], config_name: str = CONFIG_NAME) -> str:
    """One sentence for Hydra's composition error: the key (with a suggestion), value or option at fault."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    keys = [parsed.key(o) for o in overrides]
    if isinstance(error, MissingConfigException):
        return _missing_option(error, keys)
    cause = error
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    if cause is None or not getattr(cause, "full_key", None):
        return str(error).splitlines()[0]
    full_key = cause.full_key
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        others = [o for o, key in zip(overrides, keys, strict=True) if key != full_key]
        return not_a_key(full_key, _keys_at(full_key.rpartition(".")[0], others, config_name))
    # The last override of the key is the one composed (a resumed run's saved ones come first).
    value = parsed.as_typed(overrides).get(full_key)
    reason = str(cause).splitlines()[0]
    return f"{full_key}={value} is not valid: {reason}."


def _missing_option(error, keys: list[str]) -> str:
    """``group=option is not an option (did you mean ...?); choose one of ...``."""
    missing = error.missing_cfg_file or ""
    group = next((key for key in keys if missing.startswith(key + "/")), None)
    if group is None:
        return str(error).splitlines()[0]
    options = sorted(o for o in (error.options or []) if not o.endswith("_schema"))
    chosen = missing.split("/", 1)[1]
    close = difflib.get_close_matches(chosen, options, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{group}={chosen} is not an option{hint}; choose one of {', '.join(options)}."


def _keys_at(path: str, overrides: list[str], config_name: str) -> list[str]:
    from hydra import compose

    try:
        cfg = compose(config_name, overrides=overrides)
    except Exception:
        return []
    node = OmegaConf.select(cfg, path) if path else cfg
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
