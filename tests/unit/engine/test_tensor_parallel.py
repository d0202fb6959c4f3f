"""Tensor-parallel plans: patterns resolved to modules, every error sentence, a model's own plan, and tp=1."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from runner.engine.parallel.mesh import ParallelismConfig
from runner.engine.parallel.tensor_parallel import apply_tensor_parallel, default_tp_plan, resolve_tp_plan
from runner.models import GPT

VOCAB = 65


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32)


def test_a_star_stands_for_one_name_segment():
    styles = resolve_tp_plan(tiny_gpt(), {"blocks.*.attn.qkv": "colwise", "blocks.1.mlp.proj": "rowwise"})
    assert list(styles) == ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "blocks.1.mlp.proj"]
    assert [type(style) for style in styles.values()] == [ColwiseParallel, ColwiseParallel, RowwiseParallel]
    assert styles["blocks.0.attn.qkv"] is not styles["blocks.1.attn.qkv"]  # one style object per module
    assert resolve_tp_plan(tiny_gpt(), {"*.*.mlp.fc": "colwise"}).keys() == {"blocks.0.mlp.fc", "blocks.1.mlp.fc"}


def test_styles_by_name_or_as_torch_objects():
    sequence, given = SequenceParallel(), RowwiseParallel(use_local_output=False)
    styles = resolve_tp_plan(tiny_gpt(), {"blocks.*.ln_1": "sequence", "blocks.0.attn.proj": given})
    assert isinstance(styles["blocks.0.ln_1"], SequenceParallel) and styles["blocks.0.ln_1"] is not sequence
    given_copy = styles["blocks.0.attn.proj"]  # one object per module: torch's styles keep state while applied
    assert type(given_copy) is RowwiseParallel and given_copy is not given and given_copy.use_local_output is False
    # A row-wise embedding looks up whole token ids: its input is replicated, not split like a Linear's.
    embedding = resolve_tp_plan(tiny_gpt(), {"token_embedding": "rowwise", "blocks.0.mlp.proj": "rowwise"})
    assert str(embedding["token_embedding"].input_layouts) == "(Replicate(),)"
    assert str(embedding["blocks.0.mlp.proj"].input_layouts) == "(Shard(dim=-1),)"


def test_the_model_class_carries_its_default_plan():
    plan = default_tp_plan(tiny_gpt())
    assert plan == {
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
    }
    plan["blocks.*.ln_1"] = "sequence"  # a copy: the class's plan is not changed through it
    assert "blocks.*.ln_1" not in GPT.tp_plan
    assert len(resolve_tp_plan(tiny_gpt(), GPT.tp_plan)) == 8  # four per block; the tied head and embedding stay out
    assert default_tp_plan(nn.Linear(2, 2)) is None


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (
            {"blocks.*.attn.qvk": "colwise"},
            "parallel.tp_plan pattern 'blocks.*.attn.qvk' matches no module of the model (it has e.g. "
            "blocks.0.attn.qkv, blocks.0.attn.proj, blocks.0.mlp.fc, blocks.0.mlp.proj); fix parallel.tp_plan.",
        ),
        (
            {"attn.qkv": "colwise"},  # names are full paths: a suffix matches nothing
            "parallel.tp_plan pattern 'attn.qkv' matches no module of the model (it has e.g. blocks.0, blocks.1); "
            "fix parallel.tp_plan.",
        ),
        (
            {"blocks.*.attn.qkv": "column"},
            "parallel.tp_plan['blocks.*.attn.qkv']='column' is not a tensor-parallel style; use 'colwise', "
            "'rowwise' or 'sequence'.",
        ),
        (
            {"blocks.*.attn": "colwise"},
            "parallel.tp_plan pattern 'blocks.*.attn' splits blocks.0.attn, a CausalSelfAttention, but only "
            "nn.Linear and nn.Embedding modules split column- or row-wise; point it at a Linear or an Embedding.",
        ),
        (
            {"blocks.0.ln_1": ColwiseParallel()},
            "parallel.tp_plan pattern 'blocks.0.ln_1' splits blocks.0.ln_1, a LayerNorm, but only nn.Linear and "
            "nn.Embedding modules split column- or row-wise; point it at a Linear or an Embedding.",
        ),
        (
            {"blocks.*.mlp.fc": "colwise", "blocks.1.mlp.fc": "rowwise"},
            "Module blocks.1.mlp.fc is matched by both 'blocks.*.mlp.fc' and 'blocks.1.mlp.fc' in parallel.tp_plan; "
            "keep one of them.",
        ),
    ],
)
def test_bad_plans_are_one_sentence(plan, message):
    with pytest.raises(ValueError) as error:
        resolve_tp_plan(tiny_gpt(), plan)
    assert str(error.value) == message


def test_tp_of_one_keeps_a_plain_model_computing_the_same(one_process_group):
    mesh = ParallelismConfig().resolve(world_size=1).build_device_mesh("cpu")
    reference, model = tiny_gpt(), tiny_gpt()
    idx = torch.randint(VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    assert apply_tensor_parallel(model, mesh["tp"], GPT.tp_plan) is model and type(model) is GPT
    # Every parameter is a DTensor of the tp mesh (see the module docstring); the tie is still one parameter.
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model.lm_head.weight is model.token_embedding.weight
    logits, loss = model(idx, idx)
    assert type(logits) is torch.Tensor and type(loss) is torch.Tensor  # plain tensors out
    torch.testing.assert_close(logits, reference(idx), rtol=0, atol=0)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    reference(idx, idx)[1].backward()
    assert isinstance(norm, DTensor)
    torch.testing.assert_close(norm.full_tensor(), torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0))
    with pytest.raises(ValueError) as error:
        apply_tensor_parallel(tiny_gpt(), mesh, GPT.tp_plan)
    assert str(error.value) == "apply_tensor_parallel needs a 1-D mesh such as mesh['tp'], not one of shape (1, 1, 1)."
