"""The data's cross-checks before launch: a Mixture's weights its draws can use, and Packed blocks that fit the
model's context (its position embeddings), each one sentence naming the key."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from runner.config import CONF_DIR, ConfigError, register_configs
from runner.config.validation import validate

register_configs()


def composed(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def refusal(cfg) -> str:
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    return str(refused.value)


def with_node(cfg, key: str, node: dict):
    with open_dict(cfg):
        OmegaConf.update(cfg, key, node, merge=False, force_add=True)
    return cfg


@pytest.mark.parametrize(
    ("key", "weights", "shown", "problem"),
    [
        ("data.train", [float("inf"), 1], "[inf, 1]", "must be finite, and so must their sum; scale them down (only "
         "their ratios matter)"),
        ("data.train", [1e308, 1e308], "[1e+308, 1e+308]", "must be finite, and so must their sum; scale them down "
         "(only their ratios matter)"),
        ("data.train.dataset", [1, -1], "[1, -1]", "must be non-negative numbers, not all 0"),
        ("data.train.dataset", [0, 0], "[0, 0]", "must be non-negative numbers, not all 0"),
        ("data.train.dataset", ["a", 1], "['a', 1]", "must be numbers"),
    ],
)  # fmt: skip
def test_mixture_weights_its_draws_cannot_use_are_refused_before_launch(key, weights, shown, problem):
    mixture = {"_target_": "runner.data.Mixture", "datasets": [[1], [2]], "weights": weights}
    cfg = with_node(composed("experiment=shakespeare_hf_stream"), key, mixture)  # the data, or the source Packed packs
    assert refusal(cfg) == f"{key}.weights={shown} {problem}."


def test_usable_mixture_weights_pass():
    cfg = composed("experiment=shakespeare_hf_stream")
    validate(with_node(cfg, "data.train.dataset", {"_target_": "runner.data.Mixture", "datasets": [[1], [2]],
                                                   "weights": [1e307, 1e307]}))  # fmt: skip
    validate(with_node(cfg, "data.train.dataset", {"_target_": "runner.data.Mixture", "datasets": [[1], [2]]}))


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        (["data.train.block_size=128"], "data.train.block_size=128 is longer than the model's context, "
         "model.config.n_positions=64; set data.train.block_size to at most 64 (or lengthen the model's context)."),
        (["model=gpt", "data.train.block_size=512"], "data.train.block_size=512 is longer than the model's context, "
         "model.block_size=64; set data.train.block_size to at most 64 (or lengthen the model's context)."),
        (["+model.config.max_position_embeddings=32", "~model.config.n_positions", "data.train.block_size=64"],
         "data.train.block_size=64 is longer than the model's context, model.config.max_position_embeddings=32; set "
         "data.train.block_size to at most 32 (or lengthen the model's context)."),
    ],
)  # fmt: skip
def test_packed_blocks_longer_than_the_models_context_are_refused_before_launch(overrides, sentence):
    assert refusal(composed("experiment=shakespeare_hf_stream", *overrides)) == sentence


def test_packed_blocks_in_eval_and_under_a_wrapped_model_are_checked_and_fitting_ones_pass():
    cfg = composed("experiment=shakespeare_hf_stream")
    validate(cfg)  # block_size: ${model.config.n_positions}
    eval_packed = {"_target_": "runner.data.Packed", "dataset": [[1, 2]], "block_size": 100}
    assert refusal(with_node(cfg, "data.eval", eval_packed)) == (
        "data.eval.block_size=100 is longer than the model's context, model.config.n_positions=64; set "
        "data.eval.block_size to at most 64 (or lengthen the model's context)."
    )
    lora = composed("experiment=shakespeare_hf_lora", "model.model.source=elsewhere", "data=shakespeare_hf_stream",
                    "data.train.block_size=65")  # fmt: skip
    assert refusal(lora) == (
        "data.train.block_size=65 is longer than the model's context, model.model.model.config.n_positions=64; set "
        "data.train.block_size to at most 64 (or lengthen the model's context)."
    )
    unknown = composed("experiment=shakespeare_hf_stream", "data.train.block_size=128", "~model.config.n_positions")
    validate(unknown)  # the model's context is not in the config: nothing to compare
