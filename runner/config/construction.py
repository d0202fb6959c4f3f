"""The run's constructors called once before any process starts: a value a constructor rejects is one sentence.

The model (on the meta device), optimizer, scheduler, loss and metrics are built from the checked config in the
launching process, so ``model.channels=0`` stops the run before anything is written; what only the real build can
tell is left to the workers, which report it the same way.
"""

from __future__ import annotations

import re

from omegaconf import OmegaConf

from runner.config import ConfigError


def check_construction(cfg) -> None:
    """Build the run's model, optimizer, scheduler, loss and metrics once, in the launching process, so a
    constructor that rejects a value (``model.channels=0``, ``optimizer.betas=[1.5,0.9]``) stops the run in
    one sentence before any process starts or anything is written.

    The model is built on the meta device (no memory, no initialisation): checking a large model costs
    nothing. Recipes other than the supervised one build their model with arguments of their own (the
    language model's vocabulary size comes from its data), so only their optimizer and scheduler are
    checked here, on a stand-in parameter; so are they for a model loaded from files or the Hub
    (``from_pretrained``), which is not loaded twice. What only the real build can tell (a constructor
    that reads files, or that the meta device cannot run) is left to the workers, which report it the
    same way.

    Raises:
        ConfigError: One sentence naming the node, its values and the constructor's message.
    """
    import torch

    from runner.config import RECIPES
    from runner.metrics import build_metrics
    from runner.models.run_weights import reading
    from runner.training.components import build, build_loss
    from runner.training.loop import build_optimizer, build_scheduler

    try:
        with torch.device("meta"):
            parameters = [torch.nn.Parameter(torch.empty(1))]
            model_node = reading(cfg.model, "check")  # a from_run in it: its source exists, nothing is read
            if RECIPES.get(cfg.recipe) == RECIPES["supervised"] and not _reads_weights(cfg.model):
                model = build(model_node, key="model")
                _check_tp_plan(cfg, model)
                _check_pipeline_cut(cfg, model)
                parameters = list(model.parameters()) or parameters
            elif RECIPES.get(cfg.recipe) == RECIPES["language_model"] and not _reads_weights(cfg.model):
                # Its vocabulary comes from the data; the plan's layers do not depend on its size.
                model = build(model_node, key="model", vocab_size=_STAND_IN_VOCABULARY)
                _check_tp_plan(cfg, model)
                _check_pipeline_cut(cfg, model)
            optimizer = build_optimizer(cfg.optimizer, parameters)
            build_scheduler(cfg.scheduler, optimizer, cfg.trainer.max_steps or 1)
            build_loss(cfg.loss)
        build_metrics(cfg.metrics, device="cpu")
    except ConfigError as error:
        if _META.search(str(_original(error))):  # the meta device, not the value, failed: the workers will tell
            return
        raise
    except Exception:  # anything else shows in the real build, with its traceback if it is a bug
        return


_STAND_IN_VOCABULARY = 256


def _check_tp_plan(cfg, model) -> None:
    """Under tensor parallelism, the plan (``parallel.tp_plan``, or the model's own) fits the model: every pattern
    names a layer that splits, into whole heads and features for ``parallel.tp`` processes."""
    tp = OmegaConf.select(cfg, "parallel.tp", default=1)
    if OmegaConf.select(cfg, "parallel.strategy") != "fsdp" or tp == 1:
        return
    from runner.engine.parallel.tensor_parallel import check_tp_plan, default_tp_plan

    plan = OmegaConf.select(cfg, "parallel.tp_plan")
    plan = OmegaConf.to_container(plan) if plan is not None else default_tp_plan(model)
    if not plan:
        raise ConfigError(
            f"parallel.tp={tp} needs a tensor-parallel plan, and {type(model).__name__} has no tp_plan attribute; set "
            "parallel.tp_plan (module-name patterns to colwise, rowwise or sequence)."
        )
    try:
        check_tp_plan(model, plan, tp)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _check_pipeline_cut(cfg, model) -> None:
    """Under pipeline parallelism, the schedule runs the stages and micro-batches asked for, and the model has a
    plan that cuts it into them (at ``parallel.pp_split_points``, or evenly by its blocks)."""
    pp = OmegaConf.select(cfg, "parallel.pp", default=1)
    if OmegaConf.select(cfg, "parallel.strategy") != "fsdp" or pp == 1:
        return
    from runner.engine.parallel.mesh import ParallelismConfig
    from runner.engine.parallel.pipeline import pipeline_plan, stage_units

    points = OmegaConf.select(cfg, "parallel.pp_split_points")
    try:
        config = ParallelismConfig(
            pp_size=pp, pp_schedule=cfg.parallel.pp_schedule, pp_microbatches=cfg.parallel.pp_microbatches,
            pp_split_points=None if points is None else list(points),
            pp_stages_per_rank=cfg.parallel.pp_stages_per_rank,
        )  # fmt: skip
        stage_units(model, pipeline_plan(model), config.pp_stages, config.pp_split_points)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _reads_weights(node) -> bool:
    """Whether ``node``, or a node inside it, loads a model from files or the Hub (``from_pretrained``,
    ``torch.hub.load``): checking it would download and read the weights once more before the workers do.
    ``runner.models.from_run`` reads nothing here (see :func:`runner.models.run_weights.reading`)."""
    if OmegaConf.is_list(node):
        return any(_reads_weights(item) for item in node)
    if not OmegaConf.is_dict(node):
        return False
    target = str(node.get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    if target != "runner.models.from_run" and (name.startswith("from_") or name == "load"):
        return True
    return any(_reads_weights(node._get_node(key)) for key in node if key != "_target_")


_META = re.compile(r"\bmeta\b", re.IGNORECASE)  # in torch's messages about meta tensors and the Meta backend


def _original(error: BaseException) -> BaseException:
    """The exception a ConfigError reports: the deepest cause or context under it."""
    while (inner := error.__cause__ or error.__context__) is not None:
        error = inner
    return error
