"""A small GPT (decoder-only transformer) in the style of GPT-2 and nanoGPT.

Token and position embeddings, ``n_layer`` pre-norm blocks (causal self-attention through torch's
``scaled_dot_product_attention``, then a GELU MLP), a final LayerNorm and a language-model head that
shares its weight with the token embedding. Each :class:`Block` is a natural FSDP shard unit
(``parallel.shard_modules=[Block]``), and :attr:`GPT.tp_plan` says how tensor parallelism splits a block.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from runner.models.checks import check_dropout, check_sizes

if TYPE_CHECKING:
    from runner.engine.parallel.pipeline import PipelinePlan


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position attends to itself and earlier positions only.

    The fused ``qkv`` projection lays its output out head by head, ``[q k v of head 0][q k v of head 1]...``,
    rather than as three blocks ``[all q][all k][all v]``: a column-wise tensor-parallel shard of it (a
    contiguous range of output rows) then holds whole heads, and :meth:`forward` reads how many heads it
    has from the width it gets, so the same code runs whole and sharded (``GPT.tp_plan``).
    """

    def __init__(self, *, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.head_size = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, _ = x.shape
        heads = self.qkv(x).view(batch, time, -1, 3 * self.head_size).transpose(1, 2)  # (batch, head, time, 3 q k v)
        q, k, v = heads.split(self.head_size, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, time, -1)  # the heads side by side: all of them, or this shard's
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward layer: widen 4x, GELU, project back."""

    def __init__(self, *, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, *, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd=n_embd, n_head=n_head, dropout=dropout, bias=bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd=n_embd, dropout=dropout, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model.

    Args:
        vocab_size: Number of token ids (for a character model, the corpus's distinct characters).
        block_size: Longest context the model reads (its position embeddings).
        n_layer: Transformer blocks.
        n_head: Attention heads per block; must divide ``n_embd``.
        n_embd: Width of the residual stream.
        dropout: Dropout on embeddings, attention weights and residual branches (0 to turn it off).
        bias: Biases in the linear layers and LayerNorms.

    Example:
        >>> model = GPT(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=64)
        >>> logits, loss = model(idx, targets)  # idx, targets: (batch, time) int64
    """

    # The tensor-parallel plan (``parallel.tp > 1`` without a ``parallel.tp_plan`` of its own), Megatron's
    # split of each block: the first projection column-wise (whole heads, a slice of the MLP's width per
    # rank), the second row-wise (partial outputs summed across ranks). The embeddings, LayerNorms and the
    # head tied to the token embedding are not in it and stay whole on every rank, so the tying survives.
    tp_plan = {
        "blocks.*.attn.qkv": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
    }

    def __init__(
        self,
        vocab_size: int,
        *,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_sizes(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        check_dropout(dropout)
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}.")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.token_embedding = nn.Embedding(vocab_size, n_embd)
        self.position_embedding = nn.Embedding(block_size, n_embd)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(n_embd=n_embd, n_head=n_head, dropout=dropout, bias=bias) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.token_embedding.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init_weights)
        # GPT-2: each residual branch's output projection is scaled down by sqrt(2 * n_layer), so the
        # residual stream's variance at init does not grow with depth (two branches per block).
        for name, parameter in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, positions: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits ``(batch, time, vocab_size)`` for token ids ``idx`` ``(batch, time)``.

        With ``targets`` (the next token at each position, same shape as ``idx``) returns
        ``(logits, loss)``, the loss being the mean cross-entropy over every position. ``positions``
        (``(time,)`` or ``(1, time)``) are the tokens' places in their sequence, ``0, 1, ...`` unless given:
        under context parallelism a process holds a slice of each sequence, and the engine passes them.
        """
        time = idx.shape[1]
        if time > self.block_size:
            raise ValueError(f"A sequence of {time} tokens is longer than the model's block_size={self.block_size}.")
        if positions is None:
            positions = torch.arange(time, device=idx.device)
        x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, next_token_loss(logits, targets)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``idx`` ``(batch, time)`` by ``max_new_tokens`` sampled tokens; returns the whole sequence.

        Each step reads the last ``block_size`` tokens. ``temperature`` divides the logits (lower is
        more conservative); ``top_k`` keeps only the k likeliest tokens; ``generator`` makes the draws
        reproducible. Call it in eval mode for dropout-free samples.
        """
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be positive.")
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probabilities = F.softmax(logits, dim=-1)
            if generator is not None:  # draw where the generator lives: the same samples on any device
                probabilities = probabilities.to(generator.device)
            following = torch.multinomial(probabilities, 1, generator=generator)
            idx = torch.cat((idx, following.to(idx.device)), dim=1)
        return idx

    def pp_plan(self) -> PipelinePlan:
        """How pipeline parallelism cuts the model (:mod:`runner.engine.parallel.pipeline`): the embeddings, each
        block, the final norm and the head, in forward order; the head's weight is the token embedding's."""
        from runner.engine.parallel.pipeline import PipelinePlan

        blocks = tuple(f"blocks.{name}" for name in self.blocks._modules)
        units = ("token_embedding", "position_embedding", *blocks, "ln_f", "lm_head")
        return PipelinePlan(units, _stage_forward, tied={"lm_head.weight": "token_embedding.weight"})

    def num_parameters(self, *, embeddings: bool = False) -> int:
        """Parameters, the tied embedding counted once; without the position embedding unless ``embeddings``.

        The token embedding stays in: as the LM head it does a matmul per token (position lookups do not).
        """
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        return total if embeddings else total - self.position_embedding.weight.numel()

    def flops_per_token(self, sequence_length: int | None = None) -> float:
        """Training FLOPs per token (forward and backward), as in PaLM's appendix B and nanoGPT:

            6 * N + 12 * L * H * Q * T

        N: :meth:`num_parameters` (no position embedding); each parameter costs a multiply-add in the
        forward and two in the backward. L layers, H heads, Q head size, T the sequence length
        (``block_size`` unless given): attention scores and their weighted sum, forward and backward,
        counted over the full (not causally halved) T x T matrix.
        """
        length = self.block_size if sequence_length is None else sequence_length
        head_size = self.n_embd // self.n_head
        return 6 * self.num_parameters() + 12 * self.n_layer * self.n_head * head_size * length


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` ``(batch, time, vocab)`` against the next tokens ``targets``
    ``(batch, time)``, in fp32: :meth:`GPT.forward`'s loss, and the loss a pipeline's last stage computes."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _stage_forward(self: GPT, x: torch.Tensor) -> torch.Tensor:
    """One pipeline stage of a GPT holding some of its units (see :meth:`GPT.pp_plan`): token ids in on the first
    stage, the residual stream between stages, logits out of the last."""
    if self.token_embedding is not None:
        time = x.shape[1]
        if time > self.block_size:
            raise ValueError(f"A sequence of {time} tokens is longer than the model's block_size={self.block_size}.")
        x = self.dropout(self.token_embedding(x) + self.position_embedding(torch.arange(time, device=x.device)))
    for block in self.blocks:  # this stage's blocks only, in order
        x = block(x)
    if self.ln_f is not None:
        x = self.ln_f(x)
    return x if self.lm_head is None else self.lm_head(x)
