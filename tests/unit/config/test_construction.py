"""The run's constructors are called once before launch (on the meta device), so a value they reject stops the run in
one sentence before any process starts."""

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.config import ConfigError
from runner.config.construction import check_construction


def _run_config(model, **changes):
    config = {
        "recipe": "supervised", "model": model, "trainer": {"max_steps": 10}, "scheduler": None, "loss": None,
        "metrics": {}, "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3},
    }  # fmt: skip
    return OmegaConf.create({**config, **changes})


def test_constructors_are_checked_before_launch_on_the_meta_device():
    conv = {"_target_": "torch.nn.Conv2d", "in_channels": 1, "out_channels": 2, "kernel_size": 3}
    check_construction(_run_config(conv))
    with pytest.raises(ConfigError) as error:  # a value that merely contains "meta" is still the user's mistake
        check_construction(_run_config({**conv, "padding_mode": "metal"}))
    assert str(error.value).startswith(
        "model: Conv2d(in_channels=1, out_channels=2, kernel_size=3, padding_mode='metal') failed: padding_mode must "
    )
    with pytest.raises(ConfigError, match=r"^optimizer: AdamW\(lr=0.001, betas=\[1.5, 0.9\]\) failed: Invalid beta"):
        check_construction(_run_config(conv, optimizer={"_target_": "torch.optim.AdamW", "_partial_": True,
                                                        "lr": 1e-3, "betas": [1.5, 0.9]}))  # fmt: skip
    # What only the meta device cannot do is left to the real build in the workers.
    check_construction(_run_config({"_target_": f"{__name__}.ReadsItsWeights"}))


class Pretrained(nn.Linear):
    loads: list[str] = []

    @classmethod
    def from_pretrained(cls, name):
        cls.loads.append(name)
        return cls(2, 2)


def test_a_model_loaded_from_files_or_the_hub_is_not_loaded_before_launch():
    loader = {"_target_": f"{__name__}.Pretrained.from_pretrained", "name": "gpt2"}
    check_construction(_run_config(loader))
    assert Pretrained.loads == []  # the workers load it, once each
    bad_lr = {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": -1.0}
    with pytest.raises(ConfigError, match=r"^optimizer: AdamW\(lr=-1.0\) failed"):  # the rest is still checked
        check_construction(_run_config(loader, optimizer=bad_lr))


class ReadsItsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        if self.scale.item() != 1.0:  # Tensor.item() cannot be called on meta tensors
            raise ValueError("unreachable")


def _tensor_parallel(plan=None, tp=2, **model):
    gpt = {"_target_": "runner.models.GPT", "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 8, **model}
    parallel = {"strategy": "fsdp", "tp": tp, "tp_plan": plan}
    return _run_config(gpt, recipe="language_model", parallel=parallel)


def test_a_tensor_parallel_plan_is_checked_against_the_model_before_launch():
    check_construction(_tensor_parallel())  # GPT's own plan, 2 heads on 2 processes
    check_construction(_tensor_parallel({"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}))
    with pytest.raises(ConfigError) as error:
        check_construction(_tensor_parallel({"blocks.*.attn.nope": "colwise"}))
    assert str(error.value) == (
        "parallel.tp_plan pattern 'blocks.*.attn.nope' matches no module of the model (it has e.g. blocks.0.attn.qkv, "
        "blocks.0.attn.proj, blocks.0.mlp.fc, blocks.0.mlp.proj); fix parallel.tp_plan."
    )
    with pytest.raises(ConfigError, match=r"^blocks.0.attn has n_head=3 attention heads, which parallel.tp=2 does not"):
        check_construction(_tensor_parallel(n_head=3, n_embd=12))
    with pytest.raises(ConfigError, match=r"^parallel.tp=2 needs a tensor-parallel plan, and Linear has no tp_plan"):
        check_construction(_run_config({"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2},
                                       parallel={"strategy": "fsdp", "tp": 2, "tp_plan": None}))  # fmt: skip


def _pipeline(pp=2, n_layer=2, **parallel):
    gpt = {"_target_": "runner.models.GPT", "block_size": 8, "n_layer": n_layer, "n_head": 2, "n_embd": 8}
    options = {"pp_schedule": "1f1b", "pp_microbatches": None, "pp_split_points": None, "pp_stages_per_rank": None}
    return _run_config(gpt, recipe="language_model", parallel={"strategy": "fsdp", "pp": pp, **options, **parallel})


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            _pipeline(pp=4),
            "GPT has 2 blocks, too few for 4 pipeline stages; use at most 2 stages, or give the split points.",
        ),
        (
            _pipeline(pp_split_points=["blocks.9"]),
            "The split point blocks.9 is not a unit the model is cut at; choose among token_embedding, "
            "position_embedding, blocks.0, blocks.1, ln_f, lm_head.",
        ),
        (
            _pipeline(pp_split_points=["blocks.0", "blocks.1"]),
            "parallel.pp_split_points names 2 units, and the 2 stages of parallel.pp=2 under 1f1b begin at 1 (every "
            "stage after the first); give 1.",
        ),
        (
            _pipeline(pp_microbatches=1),
            "parallel.pp_microbatches=1 is too few for 1f1b on 2 stages, which needs at least one micro-batch per "
            "stage; set parallel.pp_microbatches to 2 or more.",
        ),
        (
            _pipeline(pp_schedule="interleaved_1f1b", pp_microbatches=5, n_layer=4),
            "parallel.pp_microbatches=5 does not suit interleaved_1f1b on parallel.pp=2: it runs them in 2 rounds "
            "(micro-batches // pp), which must divide them; use a multiple of 2, or fewer than 2.",
        ),
        (
            _pipeline(pp_schedule="zbv_zero_bubble", pp_stages_per_rank=3, n_layer=6),
            "parallel.pp_schedule=zbv_zero_bubble: A V-shaped schedule holds two stages per rank: 4 stages, not 6.",
        ),
    ],
)
def test_a_pipeline_is_checked_against_the_model_and_its_schedule_before_launch(config, message):
    with pytest.raises(ConfigError) as error:
        check_construction(config)
    assert str(error.value) == message


def test_a_pipeline_the_model_can_run_passes_and_a_model_without_a_plan_is_named():
    check_construction(_pipeline())  # the blocks evenly, one per stage
    check_construction(_pipeline(pp_split_points=["ln_f"]))  # the embeddings and both blocks, then the head
    check_construction(_pipeline(pp_schedule="interleaved_1f1b", n_layer=4))  # 2 stages on each process
    linear = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2}
    with pytest.raises(ConfigError) as error:
        check_construction(_run_config(linear, parallel={"strategy": "fsdp", "pp": 2, "pp_schedule": "1f1b",
                                                         "pp_microbatches": None, "pp_split_points": None,
                                                         "pp_stages_per_rank": None}))  # fmt: skip
    assert str(error.value) == (
        "Linear has no pp_plan() saying how pipeline parallelism cuts it; give the model a pp_plan() method returning "
        "a runner.engine.parallel.pipeline.PipelinePlan (runner.models.GPT has one)."
    )
