"""runner.models.with_peft: a declared model with peft's adapters, only they train; a target the model does not
have is one sentence with its closest name. (LoRA fine-tuning of a run end to end, resumed exactly on 1 and 2
processes, DDP and FSDP2, exported merged: tests/e2e/test_hugging_face.py.)"""

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import nn

from runner.models import GPT, with_peft
from runner.models.adapters import trainable_parameters
from runner.training.loop import build_optimizer

peft = pytest.importorskip("peft")
TINY_GPT = {"vocab_size": 16, "block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 8}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.query, self.value, self.norm = nn.Linear(8, 8), nn.Linear(8, 4), nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.value(self.query(x)))


NODE = {
    "_target_": "runner.models.with_peft",
    "model": {"_target_": "tests.unit.models.test_adapters.Block"},
    "config": {"_target_": "peft.LoraConfig", "r": 2, "lora_alpha": 4, "target_modules": ["query", "value"]},
}


def test_only_the_adapters_train_and_the_optimizer_holds_only_them(tmp_path, caplog):
    torch.manual_seed(0)
    caplog.set_level("INFO", logger="runner")
    model = instantiate(OmegaConf.create(NODE))  # as Hydra builds the YAML: target_modules is a ListConfig there
    assert isinstance(model, peft.PeftModel) and model.peft_config["default"].target_modules == {"query", "value"}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        f"base_model.model.{layer}.lora_{half}.default.weight" for layer in ("query", "value") for half in "AB"
    }
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2 * (8 + 8) + 2 * (8 + 4)
    assert "LORA adapters on Block: 56 of 172 parameters train (32.56%)" in caplog.text  # 116 base parameters
    optimizer = build_optimizer(OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True}),
                                trainable_parameters(model))  # fmt: skip
    assert len(trainable_parameters(Block())) == 6  # any other model: every parameter
    assert sum(len(group["params"]) for group in optimizer.param_groups) == 4
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)
    model.save_pretrained(tmp_path)  # PEFT's own format, its JSON from plain lists
    assert peft.PeftConfig.from_pretrained(tmp_path).target_modules == {"query", "value"}


@pytest.mark.parametrize(
    ("model", "config", "sentence"),
    [
        (Block(), peft.LoraConfig(target_modules=["qeury"]), "The target module 'qeury' is not in Block (did you mean "
         "'query'?); set target_modules to names of its layers: query, value."),
        (Block(), peft.LoraConfig(target_modules=["attention"]), "The target module 'attention' is not in Block; set "
         "target_modules to names of its layers: query, value."),
        ("Block", peft.LoraConfig(), "with_peft's model is str, not a torch module; give it a model node."),
        (Block(), {"r": 8}, "with_peft's config is dict, not a peft config; give it a node such as {_target_: "
         "peft.LoraConfig, r: 8, target_modules: [...]}."),
        (GPT(**TINY_GPT), peft.LoraConfig(target_modules=["attn"]), "The target module 'attn' of GPT is a "
         "CausalSelfAttention, which LoRA does not adapt; name its layers in target_modules instead: fc, lm_head, "
         "position_embedding, proj, qkv, token_embedding."),
        (GPT(**TINY_GPT), peft.PromptTuningConfig(num_virtual_tokens=2, task_type="CAUSAL_LM"), "peft could not "
         "wrap GPT with PromptTuningConfig (AttributeError: 'GPT' object has no attribute 'config'); check "
         "model.config against the model (its task_type, its target_modules)."),
    ],
)  # fmt: skip
def test_each_refusal_is_one_sentence(model, config, sentence):
    with pytest.raises(ValueError) as refused:
        with_peft(model, config)
    assert str(refused.value) == sentence


def test_what_the_language_model_recipe_passes_is_checked_against_the_model():
    model = with_peft(GPT(**TINY_GPT), peft.LoraConfig(target_modules=["qkv"]), vocab_size=16)
    assert isinstance(model, peft.PeftModel)
    with pytest.raises(ValueError) as refused:
        with_peft(GPT(**TINY_GPT), peft.LoraConfig(target_modules=["qkv"]), vocab_size=65)
    assert str(refused.value) == (
        "The data needs vocab_size=65, and model.model builds GPT with vocab_size=16; set model.model.vocab_size=65."
    )
