"""Pipeline plans for models that cannot carry a ``pp_plan()`` of their own: Hugging Face's GPT-2.

A plan (:class:`runner.engine.parallel.pipeline.PipelinePlan`) names a model's units in forward order and gives the
forward of a stage holding some of them. ``GPT2LMHeadModel`` is cut at ``transformer.wte``, ``transformer.wpe``, each
``transformer.h.<i>``, ``transformer.ln_f`` and ``lm_head`` (tied to ``transformer.wte``), as ``GPT2Model.forward``
runs them; each stage rebuilds the causal mask for its blocks. Its batches must be packed blocks (no padding: a
padding mask does not travel between stages), as ``runner.data.causal_lm_blocks`` makes them, and the last stage's
loss is a loss node (``runner.metrics.next_token_cross_entropy``): the model's own needs the labels on every stage.

Importing this registers the plans (``runner.models`` does); transformers is imported when a stage first runs.
"""

from __future__ import annotations

import torch

from runner.engine.parallel.pipeline import PipelinePlan, register_pp_plan


def gpt2_plan(model) -> PipelinePlan:
    """How pipeline parallelism cuts a ``transformers.GPT2LMHeadModel``."""
    layers = [f"transformer.h.{index}" for index in range(len(model.transformer.h))]
    units = ("transformer.wte", "transformer.wpe", *layers, "transformer.ln_f", "lm_head")
    tied = {"lm_head.weight": "transformer.wte.weight"} if model.lm_head.weight is model.transformer.wte.weight else {}
    return PipelinePlan(units, _gpt2_stage_forward, tied=tied)


def _gpt2_stage_forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **unused):
    """A stage of GPT-2: token ids in on the first stage (``input_ids``, as the batch names them), the hidden states
    between stages, logits out of the last."""
    from transformers.masking_utils import create_causal_mask

    transformer = self.transformer
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "A batch with padding (an attention_mask with zeros) cannot run in pipeline stages, which pass only the "
            "hidden states; pack the text into full blocks (runner.data.causal_lm_blocks)."
        )
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    hidden = input_ids
    if transformer.wte is not None:
        hidden = transformer.drop(transformer.wte(input_ids) + transformer.wpe(positions))
    mask = create_causal_mask(
        config=transformer.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
    )
    for block in transformer.h:  # this stage's blocks only, in order
        hidden = block(hidden, None, mask, position_ids=positions)
    if transformer.ln_f is not None:
        hidden = transformer.ln_f(hidden)
    return hidden if self.lm_head is None else self.lm_head(hidden)


register_pp_plan("GPT2LMHeadModel", gpt2_plan)
