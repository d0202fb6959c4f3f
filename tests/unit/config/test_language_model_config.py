"""The language model's config: its experiments compose as documented, and bad values get one sentence."""

import pytest
from hydra import compose, initialize_config_dir

from runner.config import CONF_DIR, ConfigError, register_configs
from runner.config.check import check_overrides
from tests.shared_data import SHAKESPEARE, needs_shakespeare

register_configs()


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    ("experiment", "processes", "strategy"),
    [
        ("shakespeare_gpt", 1, "none"),
        ("shakespeare_gpt_ddp", 2, "ddp"),
        ("shakespeare_gpt_fsdp", 2, "fsdp"),
        ("shakespeare_gpt_tp", 2, "fsdp"),
        ("shakespeare_gpt_hsdp", 4, "fsdp"),
    ],
)
def test_shakespeare_experiments(experiment, processes, strategy):
    cfg = composed(f"experiment={experiment}")
    assert (cfg.recipe, cfg.data.train._target_, cfg.data.eval._target_, cfg.model._target_) == (
        "language_model",
        "runner.data.CharCorpus",
        "runner.data.CharCorpus",
        "runner.models.GPT",
    )
    assert cfg.data.train.block_size == cfg.model.block_size == 64  # windows of the model's context
    assert (cfg.objective.metric, cfg.objective.direction) == ("eval/loss", "minimize")
    assert (cfg.trainer.num_processes, cfg.parallel.strategy) == (processes, strategy)
    assert cfg.trainer.compile is False and "vocab_size" not in cfg.model  # the dataset supplies it
    if strategy == "fsdp":
        assert list(cfg.parallel.shard_modules) == ["Block"]
        assert (cfg.parallel.dp_shard, cfg.parallel.cp, cfg.parallel.tp_plan) == ("auto", 1, None)  # GPT.tp_plan


def test_the_mesh_presets_split_their_processes_as_their_headers_say():
    tp, hsdp = composed("experiment=shakespeare_gpt_tp"), composed("experiment=shakespeare_gpt_hsdp")
    assert (tp.parallel.dp_replicate, tp.parallel.tp) == (1, 2)  # 2 processes: one TP group, dp_shard=auto=1
    assert (hsdp.parallel.dp_replicate, hsdp.parallel.tp) == (2, 1)  # 4 processes: 2 replicas x 2 shards
    single = composed("experiment=shakespeare_gpt")
    # A TP group reads one batch: the same windows per step as one process; HSDP's 4 ranks read 4 batches a step.
    assert tp.trainer.max_steps * tp.data.batch_size == single.trainer.max_steps * single.data.batch_size
    assert 4 * hsdp.trainer.max_steps * hsdp.data.batch_size == single.trainer.max_steps * single.data.batch_size


def test_the_two_process_experiments_see_as_many_windows_as_the_single_one():
    single, ddp = composed("experiment=shakespeare_gpt"), composed("experiment=shakespeare_gpt_ddp")
    assert single.trainer.max_steps * single.data.batch_size == 2 * ddp.trainer.max_steps * ddp.data.batch_size


def test_trainer_compile_defaults_off_and_mnist_configs_stay_valid():
    cfg = composed("trainer.compile=true")
    assert cfg.trainer.compile is True and (cfg.data.val_fraction, cfg.data.samples_per_epoch) == (None, None)
    assert composed("data=shakespeare_char").data.val_fraction == 0.1


@needs_shakespeare
def test_the_language_model_experiment_passes_the_checks_on_the_real_corpus():
    check_overrides(["experiment=shakespeare_gpt", f"data.root={SHAKESPEARE}", "data.samples_per_epoch=1000"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["experiment=shakespeare_gpt", "data.val_fraction=1.5"], "data.val_fraction=1.5 must be between 0 and 1"),
        (["experiment=shakespeare_gpt", "data.val_fraction=0"], "data.val_fraction=0.0 must be between 0 and 1"),
        (["experiment=shakespeare_gpt", "data.samples_per_epoch=0"], "data.samples_per_epoch=0 must be at least 1"),
        (
            ["experiment=shakespeare_gpt", "model.n_embd=100", "model.n_head=3"],
            "model.n_embd=100 must be a positive multiple of model.n_head=3.",
        ),
        (["experiment=shakespeare_gpt", "model.block_size=0"], "model.block_size=0 must be at least 1."),
        (
            ["experiment=shakespeare_gpt_tp", "model.n_head=1"],
            "parallel.tp=2 must divide model.n_head=1 and model.n_embd=128, since each process of a tensor-parallel "
            "group holds whole attention heads; choose parallel.tp from 1, or resize the model.",
        ),
        (
            ["experiment=shakespeare_gpt_tp", "model.n_head=3", "model.n_embd=96"],
            "parallel.tp=2 must divide model.n_head=3 and model.n_embd=96, since each process of a tensor-parallel "
            "group holds whole attention heads; choose parallel.tp from 1, 3, or resize the model.",
        ),
        (["experiment=shakespeare_gpt", "model.dropout=1.0"], "model.dropout=1.0 must be at least 0 and below 1."),
        (["experiment=shakespeare_gpt", "model.vocab_size=10"], "model.vocab_size is not a key of 'model'"),
        (
            ["experiment=shakespeare_gpt", "data.download=false", "data.root=/nowhere"],
            "data.train: CharCorpus(root='/nowhere', split='train', block_size=64, val_fraction=0.1, download=False) "
            "failed: input.txt is not in /nowhere; set data.root to the folder that holds it, or data.download=true to "
            "fetch tiny-shakespeare.",
        ),
        (
            ["experiment=shakespeare_gpt", 'data.train_split="test"'],
            "failed: shakespeare_char has no split 'test' ('test'); use 'train' or 'val' with an optional slice.",
        ),
        (
            ["recipe=language_model"],
            "recipe=language_model trains on runner.data.CharCorpus (a character vocabulary and windows), not "
            "data.train._target_='runner.data.MNIST'; use data=shakespeare_char",
        ),
        (
            ["recipe=language_model", "data=shakespeare_char"],
            "recipe=language_model needs a model with a block_size; use model=gpt.",
        ),
        (["data=shakespeare_char"], "recipe=supervised cannot train on the text corpus runner.data.CharCorpus"),
        (["model=gpt"], "recipe=supervised cannot train model=gpt, a language model; use recipe=language_model."),
        (["recipe=classification", "model=gpt"], "recipe=classification cannot train model=gpt"),
        (["data.samples_per_epoch=100"], "data.samples_per_epoch applies to recipe=language_model, not recipe=super"),
        (
            ["experiment=shakespeare_gpt", "+metrics.acc._target_=torchmetrics.MeanMetric"],
            "recipe=language_model logs its own eval/loss and eval/perplexity; set metrics={}",
        ),
    ],
)
def test_bad_language_model_settings_get_one_sentence(overrides, message):
    with pytest.raises(ConfigError) as info:
        check_overrides(overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


@needs_shakespeare
def test_a_slice_beyond_the_corpus_windows_is_refused_before_launch():
    with pytest.raises(ConfigError) as info:
        check_overrides(["experiment=shakespeare_gpt", f"data.root={SHAKESPEARE}", 'data.eval_split="val[5000:]"'])
    assert str(info.value) == (
        f"data.eval: CharCorpus(root='{SHAKESPEARE}', split='val[5000:]', block_size=64, val_fraction=0.1, "
        "download=True) failed: Split 'val[5000:]' selects none of the 1742 windows of 65 characters in "
        "shakespeare_char's val split; widen the slice, lower model.block_size or change data.val_fraction."
    )
    check_overrides(["experiment=shakespeare_gpt", f"data.root={SHAKESPEARE}", 'data.eval_split="val[1741:]"'])
