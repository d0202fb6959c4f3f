"""The GPT: shapes, causality, weight tying, initialisation, sampling and its FLOPs count."""

import math

import pytest
import torch

from runner.models import GPT
from runner.models.gpt import CausalSelfAttention

VOCAB = 65


def small(**overrides) -> GPT:
    torch.manual_seed(0)
    options = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, **overrides}
    return GPT(VOCAB, **options)


def tokens(batch: int, time: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(VOCAB, (batch, time), generator=torch.Generator().manual_seed(seed))


def test_logits_and_loss_shapes():
    model = small()
    idx, targets = tokens(3, 16), tokens(3, 16, seed=2)
    assert model(idx).shape == (3, 16, VOCAB)
    logits, loss = model(idx, targets)
    assert logits.shape == (3, 16, VOCAB) and loss.shape == ()
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert model(idx[:, :5]).shape == (3, 5, VOCAB)  # shorter than block_size


def test_a_later_token_never_changes_earlier_logits():
    model = small(dropout=0.1).eval()
    idx = tokens(2, 16)
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % VOCAB
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :9], after[:, :9], rtol=0, atol=0)
    assert not torch.allclose(before[:, 9:], after[:, 9:])  # and it does change its own position and later ones


def test_the_head_is_tied_to_the_token_embedding():
    model = small()
    assert model.lm_head.weight is model.token_embedding.weight
    untied = sum(p.numel() for p in model.parameters())  # parameters() lists a shared tensor once
    assert model.num_parameters(embeddings=True) == untied
    assert model.num_parameters() == untied - 16 * 32  # without the position embedding
    _, loss = model(tokens(2, 8), tokens(2, 8, seed=3))
    loss.backward()
    assert model.token_embedding.weight.grad is model.lm_head.weight.grad  # one gradient from both uses
    assert set(model.state_dict()) >= {"token_embedding.weight", "lm_head.weight"}


def test_loss_at_initialisation_is_about_log_vocabulary():
    model = small(n_layer=4, n_embd=64, n_head=4)
    _, loss = model(tokens(8, 16), tokens(8, 16, seed=4))
    assert abs(loss.item() - math.log(VOCAB)) < 0.05, loss.item()


def test_gpt2_initialisation_scales_the_residual_projections():
    model = small(n_layer=8, n_embd=256, n_head=4)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for projection in (model.blocks[3].attn.proj, model.blocks[3].mlp.proj):
        assert projection.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
        assert torch.count_nonzero(projection.bias) == 0


def test_the_fused_qkv_projection_is_laid_out_head_by_head():
    """Rows [q k v of head 0][q k v of head 1]...: a contiguous (column-wise TP) shard holds whole heads."""
    attention = small(n_head=4, n_embd=32).blocks[0].attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(7))
    weight, bias, size = attention.qkv.weight, attention.qkv.bias, 8
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    heads = []
    for head in range(4):
        rows = [slice(head * 3 * size + i * size, head * 3 * size + (i + 1) * size) for i in range(3)]
        q, k, v = (x @ weight[r].T + bias[r] for r in rows)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(size)).masked_fill(~causal, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    expected = attention.proj(torch.cat(heads, dim=-1))
    torch.testing.assert_close(attention(x), expected)


def test_the_attention_reads_its_head_count_from_the_width_it_gets():
    """What each of two tensor-parallel processes computes: 2 of the 4 heads, and its part of the output projection."""
    attention = small(n_head=4, n_embd=32).blocks[0].attn
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(8))
    partial_sums = []
    for rank in range(2):
        local = CausalSelfAttention(n_embd=32, n_head=4, dropout=0.0, bias=True)  # n_head stays 4, as under TP
        local.qkv, local.proj = torch.nn.Linear(32, 48), torch.nn.Linear(16, 32, bias=False)
        with torch.no_grad():  # the rows ColwiseParallel gives this rank, and the columns RowwiseParallel does
            local.qkv.weight.copy_(attention.qkv.weight[48 * rank : 48 * (rank + 1)])
            local.qkv.bias.copy_(attention.qkv.bias[48 * rank : 48 * (rank + 1)])
            local.proj.weight.copy_(attention.proj.weight[:, 16 * rank : 16 * (rank + 1)])
        partial_sums.append(local(x))
    torch.testing.assert_close(partial_sums[0] + partial_sums[1] + attention.proj.bias, attention(x))


def test_gpt_carries_a_tensor_parallel_plan_that_keeps_the_tied_head_whole():
    assert GPT.tp_plan == {
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
    }
    assert not any(pattern.startswith(("lm_head", "token_embedding")) for pattern in GPT.tp_plan)


def test_blocks_are_named_for_fsdp_shard_units():
    model = small(n_layer=3)
    assert [type(m).__name__ for m in model.modules()].count("Block") == 3


def test_generate_is_reproducible_and_top_1_is_greedy():
    model = small().eval()
    prompt = tokens(2, 3)
    first = model.generate(prompt, 20, generator=torch.Generator().manual_seed(5))
    again = model.generate(prompt, 20, generator=torch.Generator().manual_seed(5))
    other = model.generate(prompt, 20, generator=torch.Generator().manual_seed(6))
    assert first.shape == (2, 23) and torch.equal(first[:, :3], prompt)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert int(first.min()) >= 0 and int(first.max()) < VOCAB
    greedy = model.generate(prompt, 20, top_k=1)  # longer than block_size: reads the last 16 tokens
    sequence = prompt
    for _ in range(20):
        sequence = torch.cat([sequence, model(sequence[:, -16:])[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, sequence)


def test_flops_per_token_is_6n_plus_attention():
    model = small(block_size=64, n_layer=4, n_head=4, n_embd=128)
    n = model.num_parameters()
    assert model.flops_per_token() == 6 * n + 12 * 4 * 4 * 32 * 64
    assert model.flops_per_token(sequence_length=32) == 6 * n + 12 * 4 * 4 * 32 * 32


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: small(n_embd=30, n_head=4), "n_embd=30 must be divisible by n_head=4"),
        (lambda: small()(tokens(1, 17)), "17 tokens is longer than the model's block_size=16"),
        (lambda: small().generate(tokens(1, 2), 3, temperature=0), "temperature=0 must be positive"),
    ],
)
def test_bad_sizes_are_one_sentence(build, message):
    with pytest.raises(ValueError, match=message):
        build()
