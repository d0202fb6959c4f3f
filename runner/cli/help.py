"""``runner --help``: the help template of conf/config.yaml, with the composed config and every group's options."""

from __future__ import annotations

from omegaconf import OmegaConf, open_dict

from runner.config import CONF_DIR, CONFIG_GROUPS, CONFIG_NAME, ConfigError
from runner.config.check import describe_composition_error
from runner.config.search_path import is_search_path, search_path_overrides


def print_help(args) -> bool:
    """``--help`` (``args``: Hydra's parsed command line): print conf/config.yaml's help template with the
    composed config; False if not asked.

    Hydra's own ``--help`` first lists every option of every config group (120 compositions here),
    which the template does not show: composing once instead makes ``--help`` about 4x faster. The
    groups and options listed include those of ``--config-dir`` and ``hydra.searchpath``.
    """
    import string

    from hydra import compose, initialize_config_dir

    if not args.help or args.hydra_help or args.config_path:
        return False
    config_name = args.config_name or CONFIG_NAME
    overrides = list(args.overrides or [])
    search = search_path_overrides(overrides, config_dir=args.config_dir)
    overrides = [o for o in overrides if not is_search_path(o)] + search
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
        except Exception as error:
            raise ConfigError(describe_composition_error(error, overrides, config_name)) from None
        groups = _group_options(search, config_name)
    template = cfg.hydra.help.template
    with open_dict(cfg):
        del cfg["hydra"]
    config = OmegaConf.to_yaml(cfg, resolve=args.resolve)
    print(string.Template(template).safe_substitute(CONFIG=config, GROUPS=groups))
    return True


def _group_options(search: list[str], config_name: str = CONFIG_NAME) -> str:
    """``  group:      option, option`` lines: the contract's groups first, then the user's own."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    # One repository over the whole search path, read once (Hydra's public call rebuilds it per group).
    loader = GlobalHydra.instance().config_loader()
    _, repository = loader._parse_overrides_and_create_caching_repo(config_name, search)
    found = repository.get_group_options("", results_filter=ObjectType.GROUP)
    names = [g for g in dict.fromkeys(("experiment", *CONFIG_GROUPS)) if g in found] + ["hparams_search"]
    names += sorted(g for g in found if g not in names and g not in ("hydra", "schema"))
    lines = []
    for group in names:
        options = repository.get_group_options(group, results_filter=ObjectType.CONFIG)
        note = "   (with -m; the optuna extra)" if group == "hparams_search" else ""
        lines.append(f"  {group + ':':<11} {', '.join(options)}{note}")
    return "\n".join(lines)
