"""The config: its schemas, composing it, every check of it (one sentence per mistake), and the settled run.

This module holds the schemas (registered with Hydra's ConfigStore), the config folders and the names every layer
shares; beside it, in the order a run meets them:

- :mod:`~runner.config.composition`: a single run's config composed once, as Hydra's command line composes it;
  :mod:`~runner.config.search_path`: the config folders a command line adds (``--config-dir``, ``hydra.searchpath``).
- :mod:`~runner.config.resume`: what ``resume=`` names (the checkpoint, verified; the run's own overrides) and the
  resumed run's config.
- :mod:`~runner.config.check`: a command line's overrides composed and checked before anything is written;
  :mod:`~runner.config.construction`: the run's constructors called once, the model on the meta device.
- :mod:`~runner.config.run_spec`: :func:`~runner.config.run_spec.settle`, once per run (per sweep job), to the
  frozen :class:`~runner.config.run_spec.RunSpec` the launch hands every worker.
- :mod:`~runner.config.overrides`: command-line overrides, read with Hydra's own grammar.
- :mod:`~runner.config.validation`: what the types cannot check (ranges, choices, combinations), and an open
  group's keys once composed (:func:`~runner.config.validation.settle_options`).
- :mod:`~runner.config.recipe_validation`: what the run trains (recipe, data, model, loss, metrics, objective).
- :mod:`~runner.config.targets`: each ``_target_``'s import and keywords.
- :mod:`~runner.config.value_checks`: the one-key checks they share.

The package may import hydra and omegaconf, and below it the run folders, training helpers, data, models and
engine; :mod:`~runner.config.targets` and the construction check import the user's modules (and torch) when asked.
Nothing here imports a layer above it (the command line, sweeps, the launch), nor torch at import.

Every group in ``conf/`` is typed by a dataclass here: the fixed groups (trainer, data, project,
tracker, objective) through :class:`RunnerConfig`, and each option of the open groups (model, optimizer,
scheduler, parallel) through its own schema, which its YAML names first in its defaults list. A
wrong type is therefore rejected while Hydra composes, and a wrong key too, except in an open group's
node, which :func:`runner.config.validation.settle_options` checks once composed (so that a preset's keys for
one option leave with it); :mod:`runner.config.check` turns Hydra's rejection into one sentence, and
:func:`runner.config.validation.validate` checks what types cannot (ranges, choices, combinations).
``data.train``, ``data.eval``, ``loss`` and ``metrics`` hold the user's ``_target_`` nodes: their imports
and keywords are checked by :mod:`runner.config.targets`.
Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the built-in config groups
CONFIG_NAME = "config"  # conf/config.yaml, the root config
# The config groups of the contract (conf/<group>/); a resume keeps the run's choice of each.
CONFIG_GROUPS = ("trainer", "model", "data", "optimizer", "scheduler", "parallel", "project", "tracker", "experiment")
TRUST_KEY = "trust_resume"  # the override that accepts the code of a run folder you did not write
MIXED_PRECISION_CHOICES = ("no", "fp16", "bf16", "fp8")
CHECKSUM_CHOICES = ("xxh3_128", "sha256")  # engine.checkpoint.manifest_schema.CHECKSUMS, without importing the engine
STRATEGIES = ("none", "ddp", "fsdp")
# The mesh of parallel=fsdp, as runner.engine.ParallelismConfig takes it, without importing the engine:
DP_SHARD_AUTO = "auto"  # parallel.dp_shard: the processes the other sizes leave (mesh.REST_OF_THE_WORLD)
TP_STYLES = ("colwise", "rowwise", "sequence")  # parallel.tp_plan's values (tensor_parallel.STYLE_NAMES)
# parallel.pp_schedule's values (runner.engine.parallel.pipeline.SCHEDULES): one stage per process, or several.
PP_SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
PP_SCHEDULES = (
    *PP_SINGLE_STAGE_SCHEDULES,
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
)
TRACKERS = ("tensorboard", "csv", "mlflow", "wandb")  # built-in trackers: tracker.<name> keys
WANDB_MODES = ("online", "offline", "disabled")
# Built-in recipes by name; ``classification`` is the supervised loop under its earlier name.
RECIPES = {
    "supervised": "recipes.supervised",
    "classification": "recipes.supervised",
    "language_model": "recipes.language_model",
}
DIRECTIONS = ("maximize", "minimize")
MODEL_COMPUTES_LOSS = "model"  # loss: model -- the model returns its own loss
CHAR_CORPUS = "runner.data.CharCorpus"  # the language model's dataset


class ConfigError(ValueError):
    """A user's config mistake: one sentence naming the key and the fix."""


# ----------------------------------------------------------------------------------------- fixed groups
@dataclass
class TrainerConfig:
    max_epochs: int = 1
    max_steps: int | None = None  # optimizer steps; wins over max_epochs when set
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    num_processes: Any = 1  # an int, or "auto" (one per GPU, else 1)
    num_nodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_timeout: int = 900  # seconds a node waits for the rendezvous host and the other nodes (torch's default)
    max_restarts: int = 0
    log_every_n_steps: int | None = 10
    eval_every_n_steps: int | None = None  # null: at the end of each epoch
    checkpoint_every_n_steps: int | None = None  # null: at the end of each epoch
    async_checkpoint: bool = False  # save_state(async_save=True): the loop waits only for the copy to memory
    cpu: bool = False
    progress_bar: bool = True
    compile: bool = False  # torch.compile the model
    tracker_process: bool = True  # call the trackers in a helper process (Linux), off the training's interpreter lock


@dataclass
class DataConfig:
    train: Any = MISSING  # a _target_ node building the train dataset
    eval: Any = None  # a _target_ node building the eval dataset; null: no evaluation
    # Loader options, for both splits (batch sizes per process).
    batch_size: int = 64
    eval_batch_size: int = 256
    num_workers: int = 0
    shuffle: bool = True
    drop_last: bool = False
    pin_memory: bool = False
    persistent_workers: bool = False
    collate_fn: Any = None  # a _target_ node with _partial_: true, or null (torch's default collation)
    # Keys of the built-in presets (mnist, shakespeare_char), interpolated into their train/eval nodes.
    root: str | None = None
    download: bool = True
    train_split: str | None = None
    eval_split: str | None = None
    val_fraction: float | None = None  # text: the last tenth of the characters is the val split
    samples_per_epoch: int | None = None  # text: train windows per epoch (null: one per offset)


@dataclass
class ObjectiveConfig:
    metric: str = "eval/loss"  # what main() returns and sweeps optimise
    direction: str = "minimize"


@dataclass
class ProjectConfig:
    project_dir: str | None = None  # null: the Hydra run folder
    automatic_checkpoint_naming: bool = True
    total_limit: int | None = None
    iteration: int = 0
    checksum: str = CHECKSUM_CHOICES[0]  # the digest checkpoints record of every file


# Trackers: the ``tracker`` node maps each tracker's name to its keys (tracker=[tensorboard,mlflow] selects
# several presets; Hydra merges them). A name that is not built in is a node with a _target_ (a GeneralTracker).
@dataclass
class MLflowTrackerConfig:
    tracking_uri: str | None = None  # null: sqlite:///<run folder>/mlflow.db (a sweep's: <sweep folder>/mlflow.db)
    experiment_name: str = "runner"
    run_name: str | None = None  # null: the run folder's name (a sweep job: its overrides)
    group: str | None = None  # a parent run the run is shown under; null: a sweep's own (its folder), else none
    tags: dict[str, str] = field(default_factory=dict)
    log_model: bool = True  # the final model/ folder as artifacts (with metrics.json)


@dataclass
class WandBTrackerConfig:
    project: str = "runner"
    entity: str | None = None  # null: your default entity
    mode: str = "online"  # online, offline (sync later with `wandb sync`), or disabled
    dir: str | None = None  # null: the run folder (W&B writes <dir>/wandb/)
    name: str | None = None  # null: the run folder's name (a sweep job: its overrides)
    group: str | None = None  # null: a sweep's jobs are grouped by the sweep folder
    tags: list[str] = field(default_factory=list)
    log_model: bool = True  # the final model/ folder as an artifact (with metrics.json)


def upgrade_tracker_node(config: Any) -> None:
    """Type, in place, the ``tracker`` node of a saved config (a DictConfig) with the schemas of the built-in
    trackers, so that a run folder's keys are checked as a command line's are and a key it lacks gets its default.

    A config saved before trackers were a mapping had ``tracker: {name: tensorboard}``: it gets the mapping
    (``{tensorboard: {}}``; ``none`` is no entry), so its run folders resume as before.

    Raises:
        ConfigError: a built-in tracker's node that is not a mapping, or holds a key or a value its schema refuses.
    """
    tracker = config.get("tracker") if hasattr(config, "get") else None
    if tracker is not None and set(tracker.keys()) == {"name"} and isinstance(tracker["name"], str):
        name = tracker["name"]
        config["tracker"] = {} if name == "none" else {name: {}}
        tracker = config["tracker"]
    if not hasattr(tracker, "keys"):
        return  # not a mapping: validation says so
    for name, schema in OPTION_SCHEMAS["tracker"].items():
        if name in tracker:
            tracker[name] = _typed_tracker(name, tracker[name], schema)


def _typed_tracker(name: str, node: Any, schema: type) -> Any:
    if node is not None and not isinstance(node, Mapping):
        raise ConfigError(
            f"tracker.{name}={node!r} in the run's saved config is not a mapping of its keys; correct the checkpoint's "
            f"config.yaml (conf/tracker/{name}.yaml shows the keys)."
        )
    try:
        return OmegaConf.merge(OmegaConf.structured(schema), node or {})
    except OmegaConfBaseException as error:
        key = f"tracker.{name}.{error.key}" if getattr(error, "key", None) else f"tracker.{name}"
        reason = str(error).splitlines()[0].rstrip(".")
        raise ConfigError(
            f"{key} in the run's saved config is not valid ({reason}); correct the checkpoint's config.yaml "
            f"(conf/tracker/{name}.yaml shows the keys)."
        ) from None


# ------------------------------------------------------------------------------- one schema per option
@dataclass
class MnistCNNConfig:
    _target_: str = "runner.models.MnistCNN"
    channels: int = 32
    hidden: int = 128
    dropout: float = 0.25


@dataclass
class GPTConfig:
    _target_: str = "runner.models.GPT"
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    # vocab_size is not a key: the recipe passes the dataset's vocabulary size when it builds the model.


@dataclass
class AdamWConfig:
    _target_: str = "torch.optim.AdamW"
    _partial_: bool = True
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01


@dataclass
class SGDConfig:
    _target_: str = "torch.optim.SGD"
    _partial_: bool = True
    lr: float = 0.01
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0


@dataclass
class WarmupCosineConfig:
    _target_: str = "runner.schedules.warmup_cosine"
    _partial_: bool = True
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class ConstantScheduleConfig:
    _target_: str = "runner.schedules.constant"
    _partial_: bool = True


@dataclass
class NoParallelConfig:
    strategy: str = "none"


@dataclass
class DDPConfig:
    strategy: str = "ddp"
    find_unused_parameters: bool = False
    bucket_cap_mb: int = 25
    gradient_as_bucket_view: bool = False
    static_graph: bool = False


@dataclass
class FSDPConfig:
    strategy: str = "fsdp"
    shard_modules: list[str] = field(default_factory=list)  # class names of the shard units
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    state_dict: str = "sharded"  # sharded (every rank writes its shards) or full (gathered to rank 0)
    # The device mesh, pp x dp_replicate x dp_shard x cp x tp processes (runner.engine.ParallelismConfig).
    dp_replicate: int = 1  # HSDP: groups that each hold a whole sharded copy of the model
    dp_shard: Any = DP_SHARD_AUTO  # an int, or "auto": the world size over dp_replicate * tp
    tp: int = 1  # tensor parallelism: processes that split each layer (and see the same batches)
    cp: int = 1  # context parallelism (CUDA only): processes that each hold a slice of every sequence
    # Module-name pattern -> colwise/rowwise/sequence; null: the model's own. Any, not dict[str, str] | None:
    # OmegaConf cannot set a mapping on the command line into a typed dict that is null.
    tp_plan: Any = None
    # Pipeline stages (the mesh's outermost dimension): processes that each hold a run of the model's blocks.
    pp: int = 1
    pp_schedule: str = "1f1b"  # torch.distributed.pipelining's schedule (runner.engine.parallel.pipeline.SCHEDULES)
    pp_microbatches: Any = None  # an int; null: one per stage
    pp_split_points: Any = None  # the module each stage after the first begins with; null: the blocks evenly
    pp_stages_per_rank: Any = None  # stages each process holds under a looped or V-shaped schedule; null: 2


# -------------------------------------------------------------------------------------------- the root
@dataclass
class RunnerConfig:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    project: ProjectConfig = field(default_factory=ProjectConfig)
    tracker: Any = field(default_factory=dict)  # tracker name -> its keys (conf/tracker/)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    model: Any = MISSING
    optimizer: Any = MISSING
    scheduler: Any = None
    parallel: Any = MISSING
    loss: Any = None  # a _target_ called as loss(outputs, targets), or "model"
    metrics: Any = field(default_factory=dict)  # name -> _target_ of a metric
    recipe: str = "supervised"
    seed: int = 42
    resume: str | None = None
    trust_resume: bool = False  # resume a folder that names code your configs do not (runner.folders.provenance)
    evaluate_only: bool = False  # runner eval: evaluate the resumed checkpoint's model, train and write nothing else


# The groups whose option is the group's whole node, each typed by the option's schema: a preset's keys for one
# option leave with it when the command line picks another (runner.config.validation.settle_options).
OPEN_GROUPS = ("model", "optimizer", "scheduler", "parallel")
OPTION_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"mnist_cnn": MnistCNNConfig, "gpt": GPTConfig},
    "optimizer": {"adamw": AdamWConfig, "sgd": SGDConfig},
    "scheduler": {"cosine": WarmupCosineConfig, "constant": ConstantScheduleConfig},
    "parallel": {"none": NoParallelConfig, "ddp": DDPConfig, "fsdp": FSDPConfig},
    "tracker": {"mlflow": MLflowTrackerConfig, "wandb": WandBTrackerConfig},
}


def register_configs() -> None:
    """Put every schema in Hydra's ConfigStore (idempotent).

    An option's schema takes keys it lacks while Hydra composes: an experiment that picks ``scheduler: cosine``
    and sets its ``warmup_steps`` still composes with ``scheduler=constant`` on the command line. The check
    that follows every composition (:func:`runner.config.validation.settle_options`) leaves such keys out or refuses
    them, and closes each node again."""
    store = ConfigStore.instance()
    store.store(name="runner_schema", node=RunnerConfig)
    for group, options in OPTION_SCHEMAS.items():
        for option, schema in options.items():
            node = OmegaConf.structured(schema)
            if group in OPEN_GROUPS:
                OmegaConf.set_struct(node, False)
            store.store(group=f"schema/{group}", name=option, node=node)
