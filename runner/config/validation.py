"""The checks of a composed config that its schema's types cannot express: ranges, choices, combinations.

:func:`validate` runs them all: the trainer, project, trackers, options and parallel layout here, and what
the run trains (recipe, data, model, loss, metrics, objective) in :mod:`runner.config.recipe_validation`. Each
failure is one :class:`~runner.config.ConfigError` sentence naming the key and the fix. Nothing here
imports torch, except :func:`check_devices` and :func:`check_hardware`, which look at the machine.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import logging
import math
import os
from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.config import (
    CHECKSUM_CHOICES,
    DP_SHARD_AUTO,
    MIXED_PRECISION_CHOICES,
    MODEL_COMPUTES_LOSS,
    OPEN_GROUPS,
    OPTION_SCHEMAS,
    PP_SCHEDULES,
    PP_SINGLE_STAGE_SCHEDULES,
    RECIPES,
    STRATEGIES,
    TP_STYLES,
    TRACKERS,
    WANDB_MODES,
    ConfigError,
    FSDPConfig,
)
from runner.config import overrides as parsed
from runner.config.recipe_validation import (
    check_data,
    check_loss_and_metrics,
    check_objective,
    check_recipe_fits,
    recipe_module,
)
from runner.config.value_checks import at_least, choice, not_a_key, one_of

logger = logging.getLogger(__name__)


def validate(cfg: DictConfig, overrides: Iterable[str] = ()) -> None:
    """Check what the schemas' types cannot, ``overrides`` being the command line's that composed ``cfg``.
    Raises :class:`ConfigError` with one sentence.

    First, each open group's node keeps only its option's keys (:func:`settle_options`).

    A ``${...}`` that cannot be resolved (a key the config does not have, an unset environment variable) is one
    sentence too: where a check below names the missing key more precisely it does, else the first value read
    that refers to it, else the final pass over every value. ``${hydra:...}`` is left to Hydra's run."""
    from omegaconf.errors import InterpolationResolutionError

    for note in settle_options(cfg, overrides):
        logger.warning(note)
    _check_missing(cfg)
    try:
        _validate(cfg)
        _resolve_every_value(cfg)
    except InterpolationResolutionError as error:
        raise _unresolved(error) from None


def settle_options(cfg: DictConfig, overrides: Iterable[str] = ()) -> list[str]:
    """Leave out of each open group's node the keys a preset set for another of the group's options; return a
    sentence for each key left out.

    ``experiment=shakespeare_hf scheduler=constant``: the experiment picks ``scheduler: cosine`` and sets its
    ``warmup_steps``, the command line switches to a schedule without warm-up, and the warm-up leaves with
    cosine. A key that no option of the group has, or one typed on the command line, is refused instead. Every
    node is closed afterwards (struct), as Hydra leaves the rest of the config.

    Raises:
        ConfigError: The key, the option it belongs to, and the fix.
    """
    lines = list(overrides)
    typed = {parsed.key(line) for line in lines if not line.startswith(("~", "+"))}
    added = {parsed.key(line) for line in lines if line.startswith("+")}  # the command line adds these on purpose
    left_out = []
    for group in OPEN_GROUPS:
        options, node = OPTION_SCHEMAS[group], cfg.get(group)
        if not isinstance(node, DictConfig) or OmegaConf.get_type(node) not in options.values():
            continue  # null, or an option of the user's own without one of these schemas: free-form
        schema = OmegaConf.get_type(node)
        chosen = next(name for name, option in options.items() if option is schema)
        keys = [field.name for field in dataclasses.fields(schema)]
        for key in [key for key in node if key not in keys and f"{group}.{key}" not in added]:
            full_key = f"{group}.{key}"
            owners = [name for name, option in options.items() if key in {f.name for f in dataclasses.fields(option)}]
            if not owners:
                raise ConfigError(not_a_key(full_key, keys))
            if full_key in typed:
                raise ConfigError(
                    f"{full_key} is a key of {group}={owners[0]}, not of {group}={chosen}; drop it, or choose "
                    f"{group}={owners[0]}."
                )
            left_out.append((full_key, f"{group}={owners[0]}", f"{group}={chosen}"))
            del node[key]
        OmegaConf.set_struct(node, True)
    experiment = parsed.value(lines, "experiment") if left_out else None
    preset = f"experiment={experiment}" if experiment else "a preset"
    return [
        f"{key} is left out: {preset} sets it for {owner}, and {chosen} has no such key."
        for key, owner, chosen in left_out
    ]


def _check_missing(node: DictConfig | ListConfig) -> None:
    """A value left ``???`` (a preset asks the command line for it) is one sentence, before any check reads it."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        if OmegaConf.is_missing(node, key):
            name = node._get_full_key(key)
            raise ConfigError(f"{name} has no value (the config says ???); give it one on the command line: {name}=...")
        child = node._get_node(key)
        if isinstance(child, (DictConfig, ListConfig)) and not OmegaConf.is_interpolation(node, key):
            _check_missing(child)


def _resolve_every_value(node: DictConfig | ListConfig) -> None:
    """Resolve each interpolated value once, leaving out those that need Hydra's run (``${hydra:...}``) where
    there is none (``runner check``, a sweep's preflight), directly or through another key."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import InterpolationResolutionError

    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for key in keys:
        child = node._get_node(key)
        if OmegaConf.is_interpolation(node, key):
            try:
                node[key]
            except InterpolationResolutionError as error:
                if HydraConfig.initialized() or not _needs_hydra(error):
                    raise
        elif isinstance(child, (DictConfig, ListConfig)):
            _resolve_every_value(child)


def _needs_hydra(error: Exception) -> bool:
    """Whether resolving failed only for want of Hydra's run: its ``hydra:`` resolver is not set up, or has no
    run to read."""
    text = str(error)
    return "HydraConfig was not set" in text or "Unsupported interpolation type hydra" in text


def _unresolved(error: Exception) -> ConfigError:
    from omegaconf.errors import InterpolationKeyError

    key = getattr(error, "full_key", None) or "a key"
    if isinstance(error, InterpolationKeyError):
        reason = str(error).splitlines()[0].rstrip(".")
        return ConfigError(
            f"{key} cannot be resolved ({reason}); set {key} to a value, or give the config the key it refers to."
        )
    reason = str(error).splitlines()[0].split("raised while resolving interpolation: ")[-1].strip("'\"").rstrip(".")
    return ConfigError(f"{key} cannot be resolved ({reason}); set {key} to a value, or provide what it refers to.")


def _validate(cfg: DictConfig) -> None:
    choice(cfg, "trainer.mixed_precision", MIXED_PRECISION_CHOICES)
    processes = cfg.trainer.num_processes
    if processes != "auto" and not (isinstance(processes, int) and not isinstance(processes, bool) and processes >= 1):
        raise ConfigError(f"trainer.num_processes={processes!r} must be a positive integer or 'auto'.")
    cores = os.cpu_count() or 1
    if processes != "auto" and processes > cores:  # each process needs a core of its own (a GPU has more)
        raise ConfigError(
            f"trainer.num_processes={processes} is more than this machine's {cores} CPU cores; start at most "
            f"{cores} processes per node (trainer.num_nodes spreads a run over machines)."
        )
    at_least(cfg, "trainer.num_nodes", 1)
    if not 0 <= cfg.trainer.node_rank < cfg.trainer.num_nodes:
        raise ConfigError(
            f"trainer.node_rank={cfg.trainer.node_rank} must be between 0 and trainer.num_nodes-1 "
            f"({cfg.trainer.num_nodes - 1})."
        )
    at_least(cfg, "trainer.max_epochs", 1)
    at_least(cfg, "trainer.max_steps", 1, optional=True)
    at_least(cfg, "trainer.gradient_accumulation_steps", 1)
    at_least(cfg, "trainer.max_restarts", 0)
    at_least(cfg, "trainer.rdzv_timeout", 1)
    if cfg.trainer.max_grad_norm is not None and cfg.trainer.max_grad_norm <= 0:
        raise ConfigError(f"trainer.max_grad_norm={cfg.trainer.max_grad_norm} must be positive (or null).")
    for cadence in ("log_every_n_steps", "eval_every_n_steps", "checkpoint_every_n_steps"):
        at_least(cfg, f"trainer.{cadence}", 1, optional=True)
    at_least(cfg, "data.batch_size", 1)
    at_least(cfg, "data.eval_batch_size", 1)
    at_least(cfg, "data.num_workers", 0)
    check_data(cfg)
    at_least(cfg, "project.total_limit", 1, optional=True)
    choice(cfg, "project.checksum", CHECKSUM_CHOICES)
    at_least(cfg, "project.iteration", 0)
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed={cfg.seed} must be between 0 and 2**63-1 (torch's generators take 64 bits).")
    _check_option_values(cfg)
    _check_trackers(cfg)
    choice(cfg, "parallel.strategy", STRATEGIES)
    if cfg.parallel.strategy == "fsdp":
        choice(cfg, "parallel.state_dict", ("sharded", "full"))
        _check_mesh(cfg)
    several = (processes != "auto" and processes > 1) or cfg.trainer.num_nodes > 1
    if several and cfg.parallel.strategy == "none":
        # resume= keeps the run's config groups: there the strategy is a value (DDP's options have defaults).
        fix = "parallel.strategy=ddp" if cfg.resume else "parallel=ddp or parallel=fsdp"
        raise ConfigError(
            f"trainer.num_processes={processes} with trainer.num_nodes={cfg.trainer.num_nodes} needs a parallel "
            f"strategy; add {fix} (or set trainer.num_processes=1)."
        )
    if cfg.trainer.num_nodes > 1 and not cfg.trainer.rdzv_endpoint:
        raise ConfigError(
            "trainer.num_nodes > 1 needs trainer.rdzv_endpoint=HOST:PORT, the address every node can reach."
        )
    if cfg.trainer.num_nodes > 1 and not cfg.project.project_dir:
        raise ConfigError(
            "trainer.num_nodes > 1 needs project.project_dir set to the same shared folder on every node, so all "
            "nodes write one run."
        )
    if cfg.get("evaluate_only") and not cfg.resume:
        raise ConfigError(
            "evaluate_only=true evaluates a run's checkpoint; use runner eval <run folder> (or add "
            "resume=<run folder>)."
        )
    if cfg.get("evaluate_only") and cfg.recipe in RECIPES and OmegaConf.select(cfg, "data.eval") is None:
        raise ConfigError(
            "runner eval evaluates the run's data.eval, which is null; name the dataset to evaluate on the command "
            "line, e.g. 'data.eval={_target_:runner.data.MNIST,root:data,split:test}'."
        )
    recipe_module(cfg.recipe)
    check_loss_and_metrics(cfg)
    check_recipe_fits(cfg)
    check_objective(cfg)


_TRACKER_PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}


def _check_trackers(cfg: DictConfig) -> None:
    """``tracker`` maps names to nodes: a built-in tracker's keys, or a node with a ``_target_`` (your own
    GeneralTracker); a built-in tracker's library is installed."""
    trackers = cfg.get("tracker")
    if trackers is None:
        return
    if not isinstance(trackers, DictConfig):
        raise ConfigError(
            f"tracker={OmegaConf.to_container(trackers) if OmegaConf.is_config(trackers) else trackers!r} is not a "
            f"mapping of trackers; choose presets with tracker=tensorboard or tracker=[tensorboard,mlflow]."
        )
    for name, node in trackers.items():
        if name in TRACKERS:
            package = _TRACKER_PACKAGES.get(name)
            if package is not None and importlib.util.find_spec(package) is None:
                raise ConfigError(
                    f"tracker={name} needs the {package} package, which is not installed; install it with "
                    f'pip install -e ".[{name}]" (or pip install {package}), or choose another tracker.'
                )
            continue
        if isinstance(node, DictConfig) and "_target_" in node:
            continue
        close = difflib.get_close_matches(str(name), TRACKERS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"tracker.{name} is not a tracker{hint}; use one of {', '.join(TRACKERS)}, or give it a _target_ "
            f"naming your GeneralTracker subclass (+tracker.{name}._target_=my_package.MyTracker)."
        )
    mode = OmegaConf.select(cfg, "tracker.wandb.mode")
    if "wandb" in trackers and mode not in WANDB_MODES:
        one_of("tracker.wandb.mode", mode, WANDB_MODES)
    if "mlflow" in trackers:
        _check_tracking_uri(OmegaConf.select(cfg, "tracker.mlflow.tracking_uri"))


# Where MLflow keeps runs, by the tracking URI's scheme: SQLAlchemy databases (sqlite:///<file>, or a database
# server's URL, postgresql+psycopg2://... included), a folder, an MLflow server, Databricks. The runner checks
# the SQLite file's and the folder's place, and reaches the server, before launch (trackers.check_reachable).
_DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")
_TRACKING_URIS = (
    "use sqlite:///<file>.db, http(s)://<server>, databricks, file:<folder>, a database URL (postgresql://...), "
    "or null for sqlite:///<run folder>/mlflow.db"
)


def _check_tracking_uri(uri: Any) -> None:
    """``tracker.mlflow.tracking_uri`` is null or a URI MLflow keeps runs at: anything else (a typo, a scheme
    MLflow has no store for, a plain path) would leave the run without the tracker it asked for."""
    from urllib.parse import urlsplit

    if uri is None:
        return
    if not isinstance(uri, str):
        raise ConfigError(
            f"tracker.mlflow.tracking_uri={uri!r} must be a string, not {type(uri).__name__}; {_TRACKING_URIS}."
        )
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        takes = uri.startswith("sqlite:///") and bool(uri.removeprefix("sqlite:///").partition("?")[0])
        reason = "a SQLite database is sqlite:/// then the file's path"
    elif scheme == "file":
        takes = parts.netloc in ("", "localhost") and bool(parts.path)
        reason = "a folder is file: then its path"
    elif scheme in ("http", "https") or scheme.partition("+")[0] in _DATABASE_SCHEMES:
        takes, reason = bool(parts.hostname), "it names no host"
    elif scheme == "databricks" or uri == "databricks":
        takes, reason = uri == "databricks" or bool(parts.netloc), "databricks://<profile> names no profile"
    else:
        takes = False
        reason = f"MLflow has no store for the scheme {scheme}" if scheme else "it has no scheme"
    if not takes:
        raise ConfigError(f"tracker.mlflow.tracking_uri={uri} is not a tracking URI ({reason}); {_TRACKING_URIS}.")


def _check_option_values(cfg: DictConfig) -> None:
    """Values the built-in options' schemas type but do not bound (where the option has the key)."""
    lr = OmegaConf.select(cfg, "optimizer.lr")
    if isinstance(lr, (int, float)) and not (math.isfinite(lr) and lr > 0):
        hint = " (0 trains nothing)" if lr == 0 else ""
        raise ConfigError(f"optimizer.lr={lr} must be a positive number{hint}, e.g. optimizer.lr=1e-3.")
    warmup = OmegaConf.select(cfg, "scheduler.warmup_steps")
    if isinstance(warmup, int) and warmup < 0:
        raise ConfigError(f"scheduler.warmup_steps={warmup} must be at least 0.")
    ratio = OmegaConf.select(cfg, "scheduler.min_lr_ratio")
    if isinstance(ratio, (int, float)) and not 0 <= ratio <= 1:
        raise ConfigError(
            f"scheduler.min_lr_ratio={ratio} must be between 0 and 1 (the final rate as a fraction of optimizer.lr)."
        )
    bucket = OmegaConf.select(cfg, "parallel.bucket_cap_mb")
    if isinstance(bucket, (int, float)) and bucket <= 0:
        raise ConfigError(f"parallel.bucket_cap_mb={bucket} must be positive (DDP's gradient bucket size in MiB).")


def _mesh_value(cfg: DictConfig, key: str) -> Any:
    """``parallel.<key>`` of parallel=fsdp; the schema's default for a run saved before the mesh keys existed."""
    return OmegaConf.select(cfg, f"parallel.{key}", default=getattr(FSDPConfig, key))


def _check_mesh(cfg: DictConfig) -> None:
    """parallel=fsdp's device mesh, by the rules of ``runner.engine.ParallelismConfig`` (which would import
    torch): whole sizes whose product is the number of processes, no context parallelism, known tensor-parallel
    styles, and whole attention heads on each process of a tensor-parallel group."""
    sizes = {key: _mesh_value(cfg, key) for key in ("dp_replicate", "dp_shard", "tp", "cp", "pp")}
    for key, value in sizes.items():
        if key == "dp_shard" and value == DP_SHARD_AUTO:
            continue
        if type(value) is not int or value < 1:  # type(): true is an int, but not a number of processes
            auto = f", or {DP_SHARD_AUTO} (the processes parallel.dp_replicate, parallel.tp, cp and pp leave)"
            raise ConfigError(
                f"parallel.{key}={value!r} must be a whole number of at least 1{auto if key == 'dp_shard' else ''}."
            )
    if sizes["cp"] > 1 and RECIPES.get(cfg.recipe) != RECIPES["language_model"]:
        raise ConfigError(
            f"parallel.cp={sizes['cp']} runs with recipe=language_model, whose targets are the next tokens aligned "
            f"with the inputs; recipe={cfg.recipe}'s loss may shift its labels inside (loss=model does), which would "
            "pair tokens across the processes' slices of a sequence. Set parallel.cp=1."
        )
    if sizes["cp"] > 1 and sizes["pp"] > 1:
        raise ConfigError(
            f"parallel.cp={sizes['cp']} with parallel.pp={sizes['pp']}: context parallelism inside pipeline stages is "
            "not supported; set one of them to 1."
        )
    _check_world_size(cfg, sizes)
    if sizes["pp"] > 1:
        _check_pipeline(cfg, sizes["pp"])
    plan = _mesh_value(cfg, "tp_plan")
    if plan is not None and not isinstance(plan, DictConfig):
        raise ConfigError(
            f"parallel.tp_plan={plan!r} must map module-name patterns to styles, e.g. "
            "'parallel.tp_plan={blocks.*.mlp.fc:colwise,blocks.*.mlp.proj:rowwise}', or be null for the model's own "
            "tp_plan."
        )
    for pattern, style in (plan or {}).items():
        one_of(f"parallel.tp_plan[{pattern!r}]", style, TP_STYLES)
    if plan is None and sizes["tp"] > 1:  # a plan of the user's own may leave the attention whole
        _check_whole_heads(cfg, sizes["tp"])


def _check_world_size(cfg: DictConfig, sizes: dict[str, Any]) -> None:
    """dp_replicate * dp_shard * tp is the number of processes (with dp_shard=auto: the others divide it)."""
    processes, nodes = cfg.trainer.num_processes, cfg.trainer.num_nodes
    if processes == "auto":  # one per GPU: counted in each worker, which resolves the mesh itself
        return
    world = processes * nodes
    plural = "es" if world > 1 else ""
    launched = f"the {world} process{plural} (trainer.num_processes={processes} x trainer.num_nodes={nodes})"
    shard = sizes["dp_shard"]
    others = ["dp_replicate", "tp"] + [key for key in ("cp", "pp") if sizes[key] > 1]
    keys = " * ".join(f"parallel.{key}" for key in others)
    product = math.prod(sizes[key] for key in others)
    if shard == DP_SHARD_AUTO and world % product:
        values = " * ".join(str(sizes[key]) for key in others)
        choose = ", ".join(f"parallel.{key}" for key in others[:-1]) + f" and parallel.{others[-1]}"
        raise ConfigError(
            f"parallel.dp_shard={DP_SHARD_AUTO} needs {keys} = {values} = {product} to divide {launched}; choose "
            f"{choose} whose product divides {world}, or change trainer.num_processes."
        )
    if shard != DP_SHARD_AUTO and product * shard != world:
        names = ["dp_replicate", "dp_shard", "tp"] + [key for key in ("cp", "pp") if sizes[key] > 1]
        values = " * ".join(str(sizes[key]) for key in names)
        raise ConfigError(
            f"{' * '.join(f'parallel.{key}' for key in names)} = {values} = {product * shard} does not match "
            f"{launched}; set parallel.dp_shard={DP_SHARD_AUTO}, or sizes whose product is {world}."
        )


def _check_pipeline(cfg: DictConfig, pp: int) -> None:
    """Pipeline stages: a known schedule, whole numbers, split points as a list of module names, a batch the
    micro-batches divide, and a loss the last stage computes (what the schedule can run is checked with the model,
    in :func:`runner.config.construction.check_construction`)."""
    schedule = _mesh_value(cfg, "pp_schedule")
    one_of("parallel.pp_schedule", schedule, PP_SCHEDULES)
    microbatches, per_rank = _mesh_value(cfg, "pp_microbatches"), _mesh_value(cfg, "pp_stages_per_rank")
    for key, value in (("pp_microbatches", microbatches), ("pp_stages_per_rank", per_rank)):
        if value is not None and (type(value) is not int or value < 1):
            raise ConfigError(f"parallel.{key}={value!r} must be a whole number of at least 1, or null.")
    points = _mesh_value(cfg, "pp_split_points")
    if points is not None and (not OmegaConf.is_list(points) or not all(isinstance(p, str) for p in points)):
        raise ConfigError(
            f"parallel.pp_split_points={points!r} must be a list of module names, each the first of a stage after the "
            "first, e.g. 'parallel.pp_split_points=[blocks.2]', or null to cut the blocks evenly."
        )
    stages = pp if schedule in PP_SINGLE_STAGE_SCHEDULES else pp * (per_rank or 2)
    microbatches = microbatches or stages
    batch = OmegaConf.select(cfg, "data.batch_size")
    if type(batch) is int and batch % microbatches:
        raise ConfigError(
            f"data.batch_size={batch} does not split into the {microbatches} micro-batches of each pipeline step "
            f"(parallel.pp_microbatches); make data.batch_size a multiple of {microbatches}."
        )
    if OmegaConf.select(cfg, "loss") == MODEL_COMPUTES_LOSS:
        raise ConfigError(
            f"loss=model cannot run under parallel.pp={pp}: the last stage computes the loss from its outputs, and the "
            "model's own loss needs the whole model; declare a loss node (a _target_ called as loss(outputs, targets))."
        )


def _check_whole_heads(cfg: DictConfig, tp: int) -> None:
    """The model's own plan (GPT.tp_plan) splits attention by heads and the MLP by features of n_embd."""
    heads, width = OmegaConf.select(cfg, "model.n_head"), OmegaConf.select(cfg, "model.n_embd")
    if not (type(heads) is int and heads >= 1 and type(width) is int and width >= 1):
        return  # not a GPT's sizes (the engine checks each split layer when it applies the plan)
    if heads % tp or width % tp:
        fitting = [str(size) for size in range(1, heads + 1) if heads % size == 0 and width % size == 0]
        raise ConfigError(
            f"parallel.tp={tp} must divide model.n_head={heads} and model.n_embd={width}, since each process of a "
            f"tensor-parallel group holds whole attention heads; choose parallel.tp from {', '.join(fitting)}, or "
            "resize the model."
        )


def check_devices(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` when a GPU run asks for more processes than GPUs (imports torch)."""
    import torch

    processes = cfg.trainer.num_processes
    visible = torch.cuda.device_count() if torch.cuda.is_available() and not cfg.trainer.cpu else 0
    if visible and processes != "auto" and processes > visible:
        raise ConfigError(
            f"trainer.num_processes={processes} needs one GPU per process, but {visible} are visible; use at most "
            f"{visible}, or trainer.cpu=true to run on the CPU."
        )


def check_hardware(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` when the precision or context parallelism asks for hardware this machine lacks
    (imports torch)."""
    cp = OmegaConf.select(cfg, "parallel.cp", default=1)
    if type(cp) is int and cp > 1:
        import torch

        if cfg.trainer.cpu or not torch.cuda.is_available():
            raise ConfigError(
                f"parallel.cp={cp} needs CUDA GPUs: torch's context parallelism shards the attention of CUDA's "
                "kernels only (the CPU's has no sharding rule); set parallel.cp=1, or run on GPUs."
            )
    if cfg.trainer.mixed_precision != "fp8":
        return
    import torch

    from runner.engine.precision import check_fp8_support

    cuda = torch.cuda.is_available() and not cfg.trainer.cpu
    try:
        check_fp8_support(torch.device("cuda", 0) if cuda else torch.device("cpu"))
    except ValueError as error:
        raise ConfigError(str(error).replace("mixed_precision=", "trainer.mixed_precision=", 1)) from None
