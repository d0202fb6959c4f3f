"""Every YAML under conf/ composes and validates; bad keys, types and values get one sentence."""

import itertools
import os

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.config import (
    CONF_DIR,
    DP_SHARD_AUTO,
    PP_SCHEDULES,
    PP_SINGLE_STAGE_SCHEDULES,
    TP_STYLES,
    ConfigError,
    RunnerConfig,
    register_configs,
)
from runner.config.check import check_overrides
from runner.config.validation import validate
from tests.shared_data import MNIST, needs_mnist

register_configs()
GROUP_OPTIONS = sorted(
    (path.parent.name, path.stem)
    for path in CONF_DIR.rglob("*.yaml")
    if path.parent != CONF_DIR and "hydra" not in path.relative_to(CONF_DIR).parts
)
HYDRA_CONFIGS = sorted(path for path in (CONF_DIR / "hydra").rglob("*.yaml"))


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_conf_has_every_group_of_the_contract():
    groups = {group for group, _ in GROUP_OPTIONS}
    expected = {"trainer", "model", "data", "optimizer", "scheduler", "parallel", "project", "tracker", "experiment"}
    assert groups == expected | {"hparams_search"}  # searches over the others, for -m with Optuna
    assert {"mnist", "mnist_ddp"} <= {option for group, option in GROUP_OPTIONS if group == "experiment"}


# Options that belong with others, each composed with its family's recipe, model and data, by the model they build.
FAMILIES = [
    ("runner.models.GPT", {"recipe": "language_model", "model": "gpt", "data": "shakespeare_char"}),
    ("transformers.GPT2LMHeadModel", {"model": "gpt2_hf", "data": "shakespeare_hf"}),
    ("transformers.GPT2LMHeadModel", {"model": "gpt2_hf", "data": "shakespeare_hf_stream"}),
    (
        "runner.models.with_peft",
        {
            "model": "gpt2_hf_lora",
            "data": "shakespeare_hf",
            "model.model.source": "/a/run",
            "data.train.block_size": "${model.model.model.config.n_positions}",
        },
    ),
]
EXPERIMENT_MODELS = {
    "shakespeare_gpt": "runner.models.GPT",
    "shakespeare_hf_lora": "runner.models.with_peft",
    "shakespeare_hf": "transformers.GPT2LMHeadModel",
}


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS)
def test_every_yaml_composes_and_validates(group, option, monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # a preset may want more cores than this machine has (hsdp: 4)
    expected, overrides = "runner.models.MnistCNN", []
    if group == "experiment":
        expected = next((model for name, model in EXPERIMENT_MODELS.items() if option.startswith(name)), expected)
        overrides = ["model.model.source=/a/run"] if option.endswith("_lora") else []  # the run it fine-tunes
    for model, family in FAMILIES:
        if family.get(group) == option:
            expected, overrides = model, [f"{key}={value}" for key, value in family.items() if key != group]
            break  # data=shakespeare_hf: with gpt2_hf, the first of its families
    cfg = composed(*overrides, f"{group}={option}")
    validate(cfg)
    assert OmegaConf.select(cfg, "model._target_") == expected
    first_line = (CONF_DIR / group / f"{option}.yaml").read_text().splitlines()[0]
    assert first_line.startswith("#")  # every YAML says what it is


EXPERIMENTS = sorted(option for group, option in GROUP_OPTIONS if group == "experiment")


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_combines_with_every_option_of_every_group(experiment):
    """``experiment=E group=option`` composes for every pair; each open group's node then holds its option's keys
    alone, what the experiment set for the option it picked being left out with the option. A group's node is
    composed from its option and the experiment alone, so one composition switches several groups at once: each
    pair is in one of them (the experiment's own options: the experiment composed alone)."""
    from dataclasses import fields

    from runner.config import OPEN_GROUPS, OPTION_SCHEMAS
    from runner.config.validation import settle_options

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        own = compose("config", overrides=[f"experiment={experiment}"], return_hydra_config=True)
        choices = own.hydra.runtime.choices
        assert settle_options(own, [f"experiment={experiment}"]) == []
        others: dict[str, list[str]] = {}
        for group, option in GROUP_OPTIONS:
            if group not in ("experiment", "hparams_search") and choices.get(group) != option:
                others.setdefault(group, []).append(option)
        for round_ in range(max(len(options) for options in others.values())):
            switched = {group: options[round_] for group, options in others.items() if round_ < len(options)}
            overrides = [f"experiment={experiment}", *(f"{group}={option}" for group, option in switched.items())]
            cfg = compose("config", overrides=overrides)
            notes = settle_options(cfg, overrides)
            for open_group in OPEN_GROUPS:
                schema = OmegaConf.get_type(cfg[open_group])
                if schema in OPTION_SCHEMAS[open_group].values():
                    assert set(cfg[open_group]) == {field.name for field in fields(schema)}, overrides
                    assert OmegaConf.is_struct(cfg[open_group])
            left = {note.split(" is left out")[0] for note in notes}
            # Only keys the experiment set are left out, and only from a group switched to an option of another schema.
            assert {key for key in left if OmegaConf.select(own, key) is not None} == left, overrides
            for key in left:
                group = key.split(".")[0]
                assert group in switched and OmegaConf.get_type(cfg[group]) is not OmegaConf.get_type(own[group]), key


def test_switching_a_group_an_experiment_set_leaves_its_keys_for_the_old_option_out(caplog):
    experiment = "experiment=shakespeare_hf"
    cfg = check_overrides([experiment, "scheduler=constant"], targets=False)
    assert OmegaConf.to_container(cfg.scheduler) == {"_target_": "runner.schedules.constant", "_partial_": True}
    assert [record.getMessage() for record in caplog.records] == [
        f"scheduler.{key} is left out: experiment=shakespeare_hf sets it for scheduler=cosine, and scheduler=constant "
        "has no such key."
        for key in ("warmup_steps", "min_lr_ratio")
    ]
    cfg = check_overrides([experiment, "optimizer=sgd", "parallel=ddp", "trainer.num_processes=2"], targets=False)
    assert "betas" not in cfg.optimizer and (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (2e-3, 0.1)  # shared
    cfg = check_overrides([experiment, "scheduler=constant", "~scheduler.warmup_steps"], targets=False)
    assert set(cfg.scheduler) == {"_target_", "_partial_"}
    cfg = check_overrides(["experiment=mnist_fsdp", "parallel=ddp"], targets=False)
    assert "shard_modules" not in cfg.parallel and cfg.parallel.strategy == "ddp"
    with pytest.raises(ConfigError) as typed:  # typed on the command line: refused, not dropped
        check_overrides([experiment, "scheduler=constant", "scheduler.warmup_steps=5"], targets=False)
    assert str(typed.value) == (
        "scheduler.warmup_steps is a key of scheduler=cosine, not of scheduler=constant; drop it, or choose "
        "scheduler=cosine."
    )
    with pytest.raises(ConfigError) as unknown:  # a key no option has is a typo wherever it comes from
        check_overrides(["scheduler=constant", "scheduler.warmup_stepz=5"], targets=False)
    assert str(unknown.value) == (
        "scheduler.warmup_stepz is not a key of 'scheduler'; `python -m runner --cfg job` lists every key."
    )


@pytest.mark.parametrize("name", [p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")])
def test_each_experiment_starts_with_the_command_that_runs_it(name):
    header = []
    for line in (CONF_DIR / "experiment" / f"{name}.yaml").read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    assert header[0] == "# @package _global_"
    assert any(f"python -m runner experiment={name}" in line for line in header)


def test_mnist_ddp_runs_two_processes_with_ddp():
    cfg = composed("experiment=mnist_ddp", "trainer.mixed_precision=fp16")
    assert (cfg.trainer.num_processes, cfg.parallel.strategy, cfg.trainer.mixed_precision) == (2, "ddp", "fp16")
    assert cfg.parallel.find_unused_parameters is False


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.max_step=3"], "trainer.max_step is not a key of 'trainer' (did you mean 'trainer.max_steps'?)"),
        (["model.chanels=3"], "model.chanels is not a key of 'model' (did you mean 'model.channels'?)"),
        (["optimizer=sgd", "optimizer.momentm=0.5"], "did you mean 'optimizer.momentum'?"),
        (
            ["optimizer.learning_rate=0.1"],
            "optimizer.learning_rate is not a key of 'optimizer' (did you mean 'optimizer.lr'?)",
        ),  # another library's name for it  # fmt: skip
        (["sed=3"], "sed is not a key of the config (did you mean 'seed'?)"),
        (["+extra=1"], "extra is not a config key; remove it"),
        (["trainer.max_steps=abc"], "trainer.max_steps=abc is not valid: Value 'abc' of type 'str' could not be"),
        (["experiment=mnist_dp"], "experiment=mnist_dp is not an option (did you mean 'mnist_ddp'?); choose one of"),
        (["trainer.mixed_precision=fp17"], "trainer.mixed_precision='fp17' is not supported (did you mean 'fp16'?)"),
        (["trainer.num_processes=2"], "trainer.num_processes=2 with trainer.num_nodes=1 needs a parallel strategy"),
        (["trainer.num_processes=0"], "trainer.num_processes=0 must be a positive integer or 'auto'"),
        (["trainer.num_processes=many"], "trainer.num_processes='many' must be a positive integer or 'auto'"),
        (["trainer.node_rank=1"], "trainer.node_rank=1 must be between 0 and trainer.num_nodes-1"),
        (["trainer.num_nodes=2", "parallel=ddp"], "trainer.num_nodes > 1 needs trainer.rdzv_endpoint=HOST:PORT"),
        (
            ["trainer.num_nodes=2", "parallel=ddp", "trainer.rdzv_endpoint=head:29500"],
            "trainer.num_nodes > 1 needs project.project_dir set to the same shared folder on every node",
        ),
        (["data.batch_size=0"], "data.batch_size=0 must be at least 1."),
        (["trainer.checkpoint_every_n_steps=0"], "trainer.checkpoint_every_n_steps=0 must be at least 1 (or null)."),
        (['data.train_split="tes[:5"'], "data.train_split='tes[:5' is not a split"),
        (["data.train_split=test[:5]"], "Cannot parse the override 'data.train_split=test[:5]'"),
        (["tracker=comet"], "tracker=comet is not an option; choose one of csv, mlflow, none, tensorboard, wandb"),
        (
            ["+tracker.tensorbord={}"],
            "tracker.tensorbord is not a tracker (did you mean 'tensorboard'?); use one of tensorboard, csv, mlflow, "
            "wandb, or give it a _target_ naming your GeneralTracker subclass",
        ),
        (["tracker=wandb", "tracker.wandb.mode=onlin"], "tracker.wandb.mode='onlin' is not supported (did you mean"),
        (["tracker=mlflow", "tracker.mlflow.tracking_urii=x"], "did you mean 'tracker.mlflow.tracking_uri'?"),
        (
            ["+tracker.mine._target_=collections.OrderedDict"],
            "tracker.mine._target_=collections.OrderedDict is not a tracker; name a subclass of "
            "runner.engine.GeneralTracker",
        ),
        (
            ["recipe=classificaton"],
            "recipe='classificaton' is neither a built-in recipe (did you mean 'classification'?)",
        ),
        (["trainer.max_grad_norm=-1"], "trainer.max_grad_norm=-1.0 must be positive (or null)."),
        (
            ["objective.metric=eval/acc"],
            "objective.metric='eval/acc' is not logged by this run (did you mean 'eval/accuracy'?); choose one of "
            "eval/loss, eval/accuracy, train/loss.",
        ),
        (
            ["data.eval=null"],
            "objective.metric='eval/accuracy' is not logged by this run (data.eval is null, so nothing is evaluated)",
        ),
        (["objective.direction=up"], "objective.direction='up' is not supported; use one of maximize, minimize."),
        (["loss=nonsense"], "loss='nonsense' must be a _target_ node called as loss(outputs, targets)"),
        (["loss=null"], "loss=None must be a _target_ node called as loss(outputs, targets)"),
        (["data.train=null"], "data.train=None must be a node with a _target_ that builds the train dataset"),
        (
            ["+data.collate_fn._target_=torch.utils.data.default_collate"],
            "data.collate_fn must be a _target_ node with _partial_: true",
        ),  # fmt: skip
        (["data.persistent_workers=true"], "data.persistent_workers=true needs worker processes"),
        (
            ["model._target_=runner.models.MnistCNNN"],
            "model._target_='runner.models.MnistCNNN' does not import: runner.models has no 'MnistCNNN' (did you mean "
            "'runner.models.MnistCNN'?); fix the dotted path.",
        ),
        (
            ["project.project_dir=${oc.env:RUNNER_TEST_NO_SUCH_VARIABLE}"],
            "project.project_dir cannot be resolved (Environment variable 'RUNNER_TEST_NO_SUCH_VARIABLE' not found); "
            "set project.project_dir to a value, or provide what it refers to.",
        ),
        (
            ["trainer.num_processes=???"],
            "trainer.num_processes has no value (the config says ???); give it one on "
            "the command line: trainer.num_processes=...",
        ),  # read by the first checks: found before them
        (
            ["experiment=shakespeare_hf_lora"],
            "model.model.source has no value (the config says ???); give it one on the command line: "
            "model.model.source=...",
        ),
        (
            ["+loss.weight=[1.0,${nosuch}]"],
            "loss.weight[1] cannot be resolved (Interpolation key 'nosuch' not found); set loss.weight[1] to a value, "
            "or give the config the key it refers to.",
        ),
    ],
)
def test_bad_overrides_get_one_sentence_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        check_overrides(overrides)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_tracker_whose_library_is_not_installed_is_one_sentence_naming_the_extra(tracker, monkeypatch):
    import importlib.util

    installed = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else installed(name, *a))
    with pytest.raises(ConfigError) as info:
        check_overrides([f"tracker=[tensorboard,{tracker}]"])
    assert str(info.value) == (
        f"tracker={tracker} needs the {tracker} package, which is not installed; install it with "
        f'pip install -e ".[{tracker}]" (or pip install {tracker}), or choose another tracker.'
    )


def test_trackers_compose_as_a_list_and_a_run_folder_saved_with_the_old_tracker_key_resumes(tmp_path):
    from runner.config.resume import resumed_config

    cfg = composed("tracker=[tensorboard,csv,mlflow]")
    assert list(cfg.tracker) == ["tensorboard", "csv", "mlflow"] and cfg.tracker.mlflow.tracking_uri is None
    assert dict(composed("tracker=none").tracker) == {}
    saved = OmegaConf.to_container(composed(), resolve=False)
    for old, new in (("tensorboard", {"tensorboard": {}}), ("none", {})):
        saved["tracker"] = {"name": old}  # what runs saved before trackers were a mapping
        OmegaConf.save(OmegaConf.create(saved), tmp_path / "config.yaml")
        assert OmegaConf.to_container(resumed_config(tmp_path, []).tracker) == new


@needs_mnist
def test_sweeps_are_checked_with_their_first_value():
    check_overrides(["optimizer.lr=1e-3,3e-3", f"data.root={MNIST}", 'data.train_split="test[:100]"'])
    with pytest.raises(ConfigError, match="did you mean 'optimizer.lr'"):
        check_overrides(["optimizer.lrr=1e-3,3e-3"])


def test_values_that_need_hydras_run_are_left_to_it_before_launch():
    overrides = ["project.project_dir=${hydra:runtime.output_dir}", "+loss.label_smoothing=${oc.env:RUNNER_UNSET,0.1}",
                 "+model.note=${project.project_dir}"]  # fmt: skip
    cfg = check_overrides(overrides, targets=False)
    assert OmegaConf.to_container(cfg)["project"]["project_dir"] == "${hydra:runtime.output_dir}"
    assert cfg.loss.label_smoothing == "0.1"


@pytest.mark.parametrize("path", HYDRA_CONFIGS, ids=lambda p: p.stem)
def test_hydra_settings_in_conf_compose(path):
    group = path.parent.relative_to(CONF_DIR).as_posix()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"{group}={path.stem}"], return_hydra_config=True)
    logging = OmegaConf.to_container(cfg.hydra.job_logging, resolve=False)
    assert logging["handlers"]["file"]["filename"] == "${hydra.runtime.output_dir}/run.log"


def test_more_processes_than_gpus_is_refused_before_anything_starts(monkeypatch):
    import torch

    from runner.config.validation import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as error:
        check_devices(composed("experiment=mnist_ddp"))
    assert str(error.value) == (
        "trainer.num_processes=2 needs one GPU per process, but 1 are visible; use at most 1, or trainer.cpu=true "
        "to run on the CPU."
    )
    check_devices(composed("experiment=mnist_ddp", "trainer.cpu=true"))  # gloo on the CPU: any number
    check_devices(composed("experiment=mnist"))


def test_context_parallelism_on_the_cpu_is_refused_before_launch():
    from runner.config.validation import check_hardware

    with pytest.raises(ConfigError) as error:
        check_hardware(composed("experiment=shakespeare_gpt_fsdp", "parallel.cp=2", "trainer.cpu=true"))
    assert str(error.value) == (
        "parallel.cp=2 needs CUDA GPUs: torch's context parallelism shards the attention of CUDA's kernels only (the "
        "CPU's has no sharding rule); set parallel.cp=1, or run on GPUs."
    )
    check_hardware(composed("experiment=shakespeare_gpt_fsdp", "trainer.cpu=true"))


def _fsdp(*overrides: str) -> list[str]:
    return ["experiment=mnist_fsdp", f"data.root={MNIST}", *overrides]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (_fsdp("parallel.tp=0"), "parallel.tp=0 must be a whole number of at least 1."),
        (_fsdp("parallel.dp_replicate=-1"), "parallel.dp_replicate=-1 must be a whole number of at least 1."),
        (
            _fsdp("parallel.dp_shard=0"),
            "parallel.dp_shard=0 must be a whole number of at least 1, or auto (the processes parallel.dp_replicate, "
            "parallel.tp, cp and pp leave).",
        ),
        (
            _fsdp("parallel.dp_shard=half"),
            "parallel.dp_shard='half' must be a whole number of at least 1, or auto (the processes "
            "parallel.dp_replicate, parallel.tp, cp and pp leave).",
        ),
        (
            _fsdp("parallel.dp_shard=1.5"),
            "parallel.dp_shard=1.5 must be a whole number of at least 1, or auto (the processes parallel.dp_replicate, "
            "parallel.tp, cp and pp leave).",
        ),
        (
            ["experiment=shakespeare_gpt_fsdp", "parallel.cp=2", "parallel.pp=2"],
            "parallel.cp=2 with parallel.pp=2: context parallelism inside pipeline stages is not supported; set one "
            "of them to 1.",
        ),
        (
            _fsdp("parallel.cp=2"),
            "parallel.cp=2 runs with recipe=language_model, whose targets are the next tokens aligned with the "
            "inputs; recipe=supervised's loss may shift its labels inside (loss=model does), which would pair tokens "
            "across the processes' slices of a sequence. Set parallel.cp=1.",
        ),
        (
            ["experiment=shakespeare_gpt_fsdp", "parallel.cp=3"],
            "parallel.dp_shard=auto needs parallel.dp_replicate * parallel.tp * parallel.cp = 1 * 1 * 3 = 3 to divide "
            "the 2 processes (trainer.num_processes=2 x trainer.num_nodes=1); choose parallel.dp_replicate, "
            "parallel.tp and parallel.cp whose product divides 2, or change trainer.num_processes.",
        ),
        (
            _fsdp("parallel.dp_shard=2", "parallel.tp=2"),
            "parallel.dp_replicate * parallel.dp_shard * parallel.tp = 1 * 2 * 2 = 4 does not match the 2 processes "
            "(trainer.num_processes=2 x trainer.num_nodes=1); set parallel.dp_shard=auto, or sizes whose product is 2.",
        ),
        (
            _fsdp("parallel.dp_replicate=3"),
            "parallel.dp_shard=auto needs parallel.dp_replicate * parallel.tp = 3 * 1 = 3 to divide the 2 processes "
            "(trainer.num_processes=2 x trainer.num_nodes=1); choose parallel.dp_replicate and parallel.tp whose "
            "product divides 2, or change trainer.num_processes.",
        ),
        (
            _fsdp("trainer.num_processes=1", "parallel.tp=2"),
            "parallel.dp_shard=auto needs parallel.dp_replicate * parallel.tp = 1 * 2 = 2 to divide the 1 process "
            "(trainer.num_processes=1 x trainer.num_nodes=1); choose parallel.dp_replicate and parallel.tp whose "
            "product divides 1, or change trainer.num_processes.",
        ),
        (_fsdp("parallel.pp=0"), "parallel.pp=0 must be a whole number of at least 1."),
        (
            _fsdp("parallel.pp=3"),
            "parallel.dp_shard=auto needs parallel.dp_replicate * parallel.tp * parallel.pp = 1 * 1 * 3 = 3 to divide "
            "the 2 processes (trainer.num_processes=2 x trainer.num_nodes=1); choose parallel.dp_replicate, "
            "parallel.tp and parallel.pp whose product divides 2, or change trainer.num_processes.",
        ),
        (
            _fsdp("parallel.pp=2", "parallel.dp_shard=2"),
            "parallel.dp_replicate * parallel.dp_shard * parallel.tp * parallel.pp = 1 * 2 * 1 * 2 = 4 does not match "
            "the 2 processes (trainer.num_processes=2 x trainer.num_nodes=1); set parallel.dp_shard=auto, or sizes "
            "whose product is 2.",
        ),
        (
            _fsdp("parallel.pp=2", "parallel.pp_schedule=1f1f"),
            "parallel.pp_schedule='1f1f' is not supported (did you mean '1f1b'?); use one of gpipe, 1f1b, "
            "interleaved_1f1b, looped_bfs, interleaved_zero_bubble, zbv_zero_bubble.",
        ),
        (
            _fsdp("parallel.pp=2", "parallel.pp_microbatches=0"),
            "parallel.pp_microbatches=0 must be a whole number of at least 1, or null.",
        ),
        (
            _fsdp("parallel.pp=2", "parallel.pp_microbatches=3"),
            "data.batch_size=64 does not split into the 3 micro-batches of each pipeline step "
            "(parallel.pp_microbatches); make data.batch_size a multiple of 3.",
        ),
        (
            _fsdp("parallel.pp=2", "parallel.pp_split_points=conv2"),
            "parallel.pp_split_points='conv2' must be a list of module names, each the first of a stage after the "
            "first, e.g. 'parallel.pp_split_points=[blocks.2]', or null to cut the blocks evenly.",
        ),
        (
            _fsdp("parallel.pp=2", "loss=model"),
            "loss=model cannot run under parallel.pp=2: the last stage computes the loss from its outputs, and the "
            "model's own loss needs the whole model; declare a loss node (a _target_ called as loss(outputs, "
            "targets)).",
        ),
        (
            _fsdp("parallel.tp_plan={fc1:colwize}"),
            "parallel.tp_plan['fc1']='colwize' is not supported (did you mean 'colwise'?); use one of colwise, "
            "rowwise, sequence.",
        ),
        (
            _fsdp("parallel.tp_plan=colwise"),
            "parallel.tp_plan='colwise' must map module-name patterns to styles, e.g. "
            "'parallel.tp_plan={blocks.*.mlp.fc:colwise,blocks.*.mlp.proj:rowwise}', or be null for the model's own "
            "tp_plan.",
        ),
        (
            ["parallel=ddp", "trainer.num_processes=2", "parallel.tp=2"],
            "parallel.tp is a key of parallel=fsdp, not of parallel=ddp; drop it, or choose parallel=fsdp.",
        ),  # only parallel=fsdp has a mesh
    ],
)
def test_bad_meshes_get_one_sentence_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as info:
        check_overrides(overrides, targets=False)
    assert str(info.value) == message


def test_a_mesh_is_valid_exactly_when_the_engine_resolves_it(monkeypatch):
    from runner.engine import ParallelismConfig
    from runner.engine.parallel.mesh import REST_OF_THE_WORLD
    from runner.engine.parallel.pipeline import SCHEDULES
    from runner.engine.parallel.tensor_parallel import STYLE_NAMES

    assert (DP_SHARD_AUTO, TP_STYLES) == (REST_OF_THE_WORLD, STYLE_NAMES)  # mirrored without importing the engine
    assert PP_SCHEDULES == tuple(SCHEDULES)
    assert PP_SINGLE_STAGE_SCHEDULES == tuple(name for name, (_, layout) in SCHEDULES.items() if layout == "single")
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    cfg = composed("experiment=shakespeare_gpt_fsdp")  # a recipe that takes every size, context parallelism too
    sizes = itertools.product([1, 2, 3], ["auto", 1, 2, 3], [1, 2, 4], [1, 2], [1, 2], [1, 2, 4, 6, 8])
    for replicate, shard, tp, cp, pp, world in sizes:
        if (replicate, shard, tp, cp, pp) == (1, 1, 1, 1, 1) and world > 1:
            continue  # the engine takes it for plain replication (Accelerate's rule); the config asks for dp_shard
        mesh = {"dp_replicate": replicate, "dp_shard": shard, "tp": tp, "cp": cp, "pp": pp}
        for key, value in mesh.items():
            OmegaConf.update(cfg, f"parallel.{key}", value)
        cfg.trainer.num_processes = world
        try:
            ParallelismConfig(
                dp_replicate_size=replicate, dp_shard_size=shard, tp_size=tp, cp_size=cp, pp_size=pp
            ).resolve(world)
            resolves = True
        except ValueError:
            resolves = False
        try:
            validate(cfg)
            valid = True
        except ConfigError:
            valid = False
        assert valid == resolves, (replicate, shard, tp, cp, pp, world)


def test_an_fsdp_config_saved_before_the_mesh_keys_is_still_valid():
    saved = OmegaConf.to_container(composed("experiment=mnist_fsdp"))
    saved["parallel"] = {k: v for k, v in saved["parallel"].items() if k not in ("dp_replicate", "dp_shard", "tp")}
    cfg = OmegaConf.merge(OmegaConf.structured(RunnerConfig), saved)  # as resume reads a run's config
    OmegaConf.set_struct(cfg, True)
    validate(cfg)


_TRACKING_URIS = (
    "use sqlite:///<file>.db, http(s)://<server>, databricks, file:<folder>, a database URL (postgresql://...), or "
    "null for sqlite:///<run folder>/mlflow.db."
)


@pytest.mark.parametrize(
    ("uri", "reason"),
    [
        ("ftp://host/x", "MLflow has no store for the scheme ftp"),
        ("5", "it has no scheme"),  # what the schema makes of tracking_uri=5: MLflow would take it for a folder
        ("runs/mlflow", "it has no scheme"),
        ("sqlite://", "a SQLite database is sqlite:/// then the file's path"),
        ("file://otherhost/runs", "a folder is file: then its path"),
        ("http://", "it names no host"),
        ("databricks://", "databricks://<profile> names no profile"),
    ],
)
def test_a_tracking_uri_mlflow_cannot_keep_runs_at_is_refused_before_launch(uri, reason):
    with pytest.raises(ConfigError) as info:
        check_overrides(["tracker=mlflow", f"tracker.mlflow.tracking_uri='{uri}'"], targets=False)
    assert str(info.value) == f"tracker.mlflow.tracking_uri={uri} is not a tracking URI ({reason}); {_TRACKING_URIS}"


@pytest.mark.parametrize(
    "uri",
    [None, "sqlite:///mlflow.db", "sqlite:////proc/nope/x.db", "file:///tmp/mlruns", "http://localhost:5000",
     "https://mlflow.example.com", "databricks", "databricks://work", "postgresql+psycopg2://user@db.example.com/mlflow"],
)  # fmt: skip
def test_the_tracking_uris_mlflow_takes_pass_validation(uri):
    # The place of a SQLite file or a folder, and a server, are checked at launch (trackers.check_reachable).
    cfg = composed("tracker=mlflow")
    cfg.tracker.mlflow.tracking_uri = uri
    validate(cfg)


def test_a_tracking_uri_that_is_not_a_string_names_its_type():
    cfg = composed("tracker=mlflow")
    OmegaConf.set_struct(cfg, False)
    cfg.tracker.mlflow = {"tracking_uri": 5, "experiment_name": "runner"}  # untyped, as a config built by hand
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value) == f"tracker.mlflow.tracking_uri=5 must be a string, not int; {_TRACKING_URIS}"


def _resumed_with_trackers(tmp_path, trackers: dict):
    from runner.config.resume import resumed_config

    saved = OmegaConf.to_container(composed(), resolve=False)
    saved["tracker"] = trackers
    OmegaConf.save(OmegaConf.create(saved), tmp_path / "config.yaml")
    return resumed_config(tmp_path, [])


def test_a_run_folders_mlflow_and_wandb_nodes_are_typed_with_their_schemas_and_get_the_keys_they_lack(tmp_path):
    cfg = _resumed_with_trackers(tmp_path, {"mlflow": {"tracking_uri": "sqlite:///a.db"}, "wandb": None})
    assert OmegaConf.to_container(cfg.tracker) == {
        "mlflow": {"tracking_uri": "sqlite:///a.db", "experiment_name": "runner", "run_name": None, "group": None,
                   "tags": {}, "log_model": True},
        "wandb": {"project": "runner", "entity": None, "mode": "online", "dir": None, "name": None, "group": None,
                  "tags": [], "log_model": True},
    }  # fmt: skip
    validate(cfg)


@pytest.mark.parametrize(
    ("node", "message"),
    [
        (
            {"tracking_uri": "sqlite:///a.db", "upload": "everything"},
            "tracker.mlflow.upload in the run's saved config is not valid (Key 'upload' not in 'MLflowTrackerConfig'); "
            "correct the checkpoint's config.yaml (conf/tracker/mlflow.yaml shows the keys).",
        ),
        (
            {"experiment_name": {"nested": 1}},
            "tracker.mlflow.experiment_name in the run's saved config is not valid (Cannot convert 'DictConfig' to "
            "string: '{'nested': 1}'); correct the checkpoint's config.yaml (conf/tracker/mlflow.yaml shows the keys).",
        ),
        (
            "sqlite:///a.db",
            "tracker.mlflow='sqlite:///a.db' in the run's saved config is not a mapping of its keys; correct the "
            "checkpoint's config.yaml (conf/tracker/mlflow.yaml shows the keys).",
        ),
    ],
)
def test_a_run_folders_tracker_node_its_schema_refuses_is_one_sentence(tmp_path, node, message):
    with pytest.raises(ConfigError) as info:
        _resumed_with_trackers(tmp_path, {"mlflow": node})
    assert str(info.value) == message
