"""A model cut into pipeline stages by its plan: the stages keep its names and, run in order, are the model."""

import pytest
import torch
from torch import nn

from runner.engine.parallel.pipeline import (
    cut,
    pipeline_plan,
    schedule_class,
    stage_indices,
    stage_units,
    sum_tied_gradients,
)
from runner.models import GPT


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(65, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_a_gpt_cut_into_stages_runs_as_the_whole_model_and_keeps_its_names(num_stages):
    model = _gpt()
    plan = pipeline_plan(model)
    stages = [cut(model, plan, units) for units in stage_units(model, plan, num_stages)]
    idx = torch.randint(65, (3, 16), generator=torch.Generator().manual_seed(1))
    x = idx
    for stage in stages:
        x = stage(x)
    assert torch.equal(x, model(idx))  # the same operations in the same order
    whole = model.state_dict()
    parts = [stage.state_dict() for stage in stages]
    assert sorted(key for part in parts for key in part) == sorted(whole)  # each name on exactly one stage
    assert all(torch.equal(part[key], whole[key]) for part in parts for key in part)
    assert all(isinstance(stage, GPT) for stage in stages) and len(model.blocks) == 4  # the model is untouched
    if num_stages == 2:
        assert [name for name in parts[1] if name.startswith("blocks.")][0] == "blocks.2.ln_1.weight"
        assert "lm_head.weight" in parts[1] and "token_embedding.weight" in parts[0]  # the tied ends, one a stage
        assert plan.tied == {"lm_head.weight": "token_embedding.weight"}


def test_stages_on_one_rank_sum_the_tied_weights_gradients_to_the_whole_models():
    model = _gpt()
    plan = pipeline_plan(model)
    stages = [cut(model, plan, units) for units in stage_units(model, plan, 2)]  # both ends here: a V layout's rank
    idx, targets = (torch.randint(65, (3, 16), generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    logits = stages[1](stages[0](idx))
    torch.nn.functional.cross_entropy(logits.reshape(-1, 65), targets.reshape(-1)).backward()
    _, loss = model(idx, targets)
    loss.backward()
    embedding, head = stages[0].token_embedding.weight, stages[1].lm_head.weight
    assert not torch.allclose(embedding.grad, model.token_embedding.weight.grad)  # each end has its share alone
    sum_tied_gradients(stages, plan)
    for end in (embedding, head):
        torch.testing.assert_close(end.grad, model.token_embedding.weight.grad, rtol=0, atol=1e-7)
    assert embedding.grad is not head.grad  # equal, not shared: each stage's optimizer steps its own


def test_stages_are_cut_evenly_by_blocks_or_at_split_points():
    model = _gpt()
    plan = pipeline_plan(model)
    embeddings, head = ("token_embedding", "position_embedding"), ("ln_f", "lm_head")
    assert stage_units(model, plan, 3) == [
        (*embeddings, "blocks.0", "blocks.1"), ("blocks.2",), ("blocks.3", *head)
    ]  # fmt: skip
    assert stage_units(model, plan, 3, ["blocks.1", "blocks.3"]) == [
        (*embeddings, "blocks.0"), ("blocks.1", "blocks.2"), ("blocks.3", *head)
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"^GPT has 4 blocks, too few for 5 pipeline stages; use at most 4 stages"):
        stage_units(model, plan, 5)
    with pytest.raises(ValueError, match=r"^The split points name 1 units, and 3 stages begin at 2 \(every stage"):
        stage_units(model, plan, 3, ["blocks.2"])
    with pytest.raises(ValueError, match=r"^The split point blocks.9 is not a unit the model is cut at; choose among"):
        stage_units(model, plan, 2, ["blocks.9"])
    with pytest.raises(ValueError, match=r"^The split points \['blocks.3', 'blocks.1'\] must name units in forward"):
        stage_units(model, plan, 3, ["blocks.3", "blocks.1"])
    with pytest.raises(ValueError, match=r"^Linear has no pp_plan\(\) saying how pipeline parallelism cuts it"):
        pipeline_plan(nn.Linear(2, 2))


def test_each_rank_holds_the_stages_its_schedule_lays_out():
    assert [stage_indices(rank, 2, 2, layout="single") for rank in range(2)] == [(0,), (1,)]
    assert [stage_indices(rank, 2, 6, layout="looped") for rank in range(2)] == [(0, 2, 4), (1, 3, 5)]
    assert [stage_indices(rank, 2, 4, layout="v") for rank in range(2)] == [(0, 3), (1, 2)]
    with pytest.raises(ValueError, match=r"^A single-stage schedule holds one stage per rank: 2 stages, not 4\.$"):
        stage_indices(0, 2, 4, layout="single")
    with pytest.raises(ValueError, match=r"^A looped schedule holds several stages per rank: a multiple of 2 above"):
        stage_indices(0, 2, 2, layout="looped")
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    assert schedule_class("gpipe") == (ScheduleGPipe, "single") and schedule_class("1f1b") == (Schedule1F1B, "single")
    assert schedule_class("interleaved_1f1b") == (ScheduleInterleaved1F1B, "looped")
    with pytest.raises(ValueError, match=r"^'pipedream' is not a pipeline schedule; choose one of gpipe, 1f1b, "):
        schedule_class("pipedream")


def test_a_sequential_model_is_cut_by_its_children_and_its_stage_views_share_the_rank_module():
    from runner.engine.parallel.pipeline import sequential_plan
    from runner.engine.parallel.pipelined import stage_view

    class Stack(nn.Module):  # a user's model: its forward runs its children in turn
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.blocks = nn.Embedding(16, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.head = nn.Linear(8, 16)

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Stack()
    plan = sequential_plan(model)
    assert plan.units == ("embed", "blocks.0", "blocks.1", "blocks.2", "head")
    idx = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        whole = model(idx)
        units = stage_units(model, plan, 2)
        assert units == [("embed", "blocks.0", "blocks.1"), ("blocks.2", "head")]
        staged = idx
        for stage in [cut(model, plan, stage_units) for stage_units in units]:
            staged = stage(staged)
        assert torch.equal(staged, whole)
        # One process holding both stages: views of one rank module, sharing its parameters, each its own part.
        rank_module = cut(model, plan, plan.units)
        first, second = (stage_view(rank_module, plan, stage_units) for stage_units in units)
        assert torch.equal(second(first(idx)), whole)
        assert [name for name, _ in first.named_parameters()] == [
            "embed.weight", "blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"
        ]  # fmt: skip
        assert first.embed.weight is rank_module.embed.weight and second.head.bias is rank_module.head.bias
        assert len(rank_module.blocks) == 3  # the views' lists are copies: the rank module keeps every block


def test_the_bubble_of_a_schedule_in_theory():
    from runner.engine.parallel.pipeline import bubble_fraction

    assert bubble_fraction("1f1b", pp=2, microbatches=4) == pytest.approx(1 / 5)
    assert bubble_fraction("gpipe", pp=4, microbatches=8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved_1f1b", pp=2, microbatches=4) == pytest.approx(0.5 / 4.5)  # 2 stages each
    assert bubble_fraction("zbv_zero_bubble", pp=2, microbatches=4) is None
