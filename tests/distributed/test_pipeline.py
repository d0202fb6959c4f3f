"""Pipeline parallelism on gloo: a GPT cut into 2 stages by its plan, one stage per process, run by torch's schedules.

Each schedule's step is compared with the whole model's forward and backward in this (the test's) process on the
same global batch: the loss and every parameter's gradient, under its own name, up to the order of float sums.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from runner.engine.distributed import init_process_group, read_environment
from runner.engine.parallel.pipeline import cut, pipeline_plan, schedule_class, stage_units, sum_tied_gradients
from runner.models import GPT

VOCAB, BATCH, TIME, MICROBATCHES = 65, 8, 16, 4


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, block_size=TIME, n_layer=4, n_head=2, n_embd=32, dropout=0.0)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randint(VOCAB, (BATCH, TIME), generator=generator) for _ in range(2))


def _stage_steps() -> dict:
    """One step of each schedule on this process's stage: the losses it saw (the last stage's), its gradients."""
    env = read_environment()
    init_process_group(env)
    return {schedule: _stage_step(schedule, env) for schedule in ("gpipe", "1f1b")}


def _stage_step(schedule: str, env) -> dict:
    from torch.distributed.pipelining import PipelineStage

    model = _gpt()
    plan = pipeline_plan(model)
    schedule_type, _ = schedule_class(schedule)
    stage = cut(model, plan, stage_units(model, plan, env.world_size)[env.rank])
    idx, targets = _batch()

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # A sum over the micro-batch, divided by the step's tokens: the micro-batches' losses add up to the mean.
        return F.cross_entropy(logits.reshape(-1, VOCAB).float(), target.reshape(-1), reduction="sum") / idx.numel()

    runner = schedule_type(
        PipelineStage(stage, env.rank, env.world_size, env.device), n_microbatches=MICROBATCHES, loss_fn=loss_fn,
        scale_grads=False,
    )  # fmt: skip
    losses: list[torch.Tensor] = []
    if env.rank == 0:
        runner.step(idx)
    else:
        runner.step(target=targets, losses=losses)
    sum_tied_gradients([stage], plan, group=dist.group.WORLD)  # 2 stages: the embedding's and the head's ranks
    grads = {name: p.grad.clone() for name, p in stage.named_parameters()}
    return {"loss": sum(losses).item() if losses else None, "grads": grads}


def test_a_gpt_cut_into_two_stages_steps_as_the_whole_model_under_gpipe_and_1f1b(launch):
    ranks = launch(_stage_steps)
    model = _gpt()
    _, loss = model(*_batch())
    loss.backward()
    reference = dict(model.named_parameters(remove_duplicate=False))
    for schedule in ("gpipe", "1f1b"):
        first, last = (rank[schedule] for rank in ranks)
        assert first["loss"] is None and last["loss"] == pytest.approx(loss.item(), abs=1e-6), schedule
        assert sorted([*first["grads"], *last["grads"]]) == sorted(reference)  # every name once, the tied head's
        for grads in (first["grads"], last["grads"]):
            for name, grad in grads.items():
                torch.testing.assert_close(grad, reference[name].grad, rtol=0, atol=1e-6, msg=f"{schedule}: {name}")
        # The tied ends: each its stage's share alone, summed to the whole model's gradient on both.
        assert torch.equal(first["grads"]["token_embedding.weight"], last["grads"]["lm_head.weight"]), schedule
