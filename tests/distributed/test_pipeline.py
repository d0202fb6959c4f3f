"""Pipeline parallelism on gloo: a GPT cut into stages by its plan, run by torch's schedules, alone and through the
engine (``Accelerator.forward_backward``), on the shared 2- and 4-worker groups.

Every run is compared with the whole model in this (the test's) process on the same global batch: losses, gradient
norms and weights, under their own names, up to the order of float sums (1e-6 for one step, 1e-5 over a few AdamW
steps); a resume on the same layout is compared bit for bit, and checkpoints loaded on other layouts weight for
weight.
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


# ------------------------------------------------------------------------------------------- through the engine
STEPS, ACCUMULATION, SAVED_AFTER, CLIP = 6, 2, 3, 0.5  # optimizer steps; micro-steps each; saved after; max norm


def _batches(count: int, rows: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    return [tuple(torch.randint(VOCAB, (rows, TIME), generator=generator) for _ in range(2)) for _ in range(count)]


def _prepared(accumulation: int = 1, precision: str = "no", **parallel):
    """A GPT and AdamW prepared on a mesh with ``parallel`` (ParallelismConfig's sizes; none: DDP or one process)."""
    from runner.engine import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig

    options = {"pp_microbatches": MICROBATCHES, **parallel}
    config = ParallelismConfig(**options) if parallel else None
    plugin = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]) if parallel else None
    accelerator = Accelerator(
        gradient_accumulation_steps=accumulation, mixed_precision=precision, parallelism_config=config,
        fsdp_plugin=plugin,
    )  # fmt: skip
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return (accelerator, *accelerator.prepare(model, optimizer))


def _train(accelerator, model, optimizer, batches) -> tuple[list[float], list[float]]:
    """Micro-steps through the engine's one verb: the losses of each, the clipped norm of each optimizer step."""
    from runner.models.gpt import next_token_loss

    losses, norms = [], []
    for idx, targets in batches:
        with accelerator.accumulate(model):
            loss = accelerator.forward_backward(model, idx, target=targets, loss_fn=next_token_loss)
            norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if norm is not None:
            norms.append(norm.item())
    return losses, norms


def _reference(batches, accumulation: int = 1) -> dict:
    """The same micro-steps on one process, the whole model, no engine."""
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, norms, states = [], [], []
    for step, (idx, targets) in enumerate(batches, start=1):
        _, loss = model(idx, targets)
        (loss / accumulation).backward()
        losses.append(loss.item())
        if step % accumulation == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
            optimizer.step()
            optimizer.zero_grad()
            states.append({name: tensor.clone() for name, tensor in model.state_dict().items()})
    with torch.no_grad():
        logits = model(batches[0][0])
    return {"losses": losses, "norms": norms, "states": states, "logits": logits}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    sizes = {"vocab_size": VOCAB, "n_positions": TIME, "n_embd": 32, "n_layer": 4, "n_head": 2}
    dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    return GPT2LMHeadModel(GPT2Config(**sizes, **dropout, bos_token_id=None, eos_token_id=None))


class _Stack(torch.nn.Module):
    """A user's model: an embedding, a ModuleList of blocks, a head, run in sequence (sequential_plan cuts it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(4)
        )
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pp_plan(self):
        from runner.engine.parallel.pipeline import sequential_plan

        return sequential_plan(self)


def _gpt2_steps(batches) -> list[float]:
    """Hugging Face's GPT-2 in 2 stages (its registered plan), its loss a loss node."""
    from runner.engine import Accelerator, ParallelismConfig
    from runner.metrics import next_token_cross_entropy

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=MICROBATCHES))
    model = accelerator.prepare(_gpt2())  # this process's stage
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for idx, _ in batches:
        losses.append(
            accelerator.forward_backward(model, input_ids=idx, target=idx, loss_fn=next_token_cross_entropy).item()
        )
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _models_of_others() -> dict:
    """Hugging Face's GPT-2 (its registered plan; the loss a loss node) and a user's model, two steps on 2 stages."""
    from runner.engine import Accelerator, ParallelismConfig
    from runner.models.gpt import next_token_loss

    accelerator = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=MICROBATCHES))
    model = accelerator.prepare(_Stack())  # this process's stage
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses = []
    for idx, targets in _batches(2):
        losses.append(accelerator.forward_backward(model, idx, target=targets, loss_fn=next_token_loss).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"gpt2": _gpt2_steps(_batches(2)), "stack": losses}


def _pipelines_of_two(directory: str) -> dict:
    """On 2 processes: 1F1B with accumulation and clipping, saved midway and resumed; the other schedules; the
    checkpoint loaded by DDP on the same processes and by FSDP2 (the 4-process run's)."""
    from pathlib import Path

    root, result = Path(directory), {}
    batches = _batches(STEPS * ACCUMULATION)
    accelerator, model, optimizer = _prepared(ACCUMULATION, pp_size=2, pp_schedule="1f1b")
    head = SAVED_AFTER * ACCUMULATION
    result["losses"], result["norms"] = _train(accelerator, model, optimizer, batches[:head])
    accelerator.save_state(root / "pp2")
    result["saved"] = accelerator.get_state_dict(model)  # the whole model, on rank 0
    losses, norms = _train(accelerator, model, optimizer, batches[head:])
    result["losses"] += losses
    result["norms"] += norms
    result["names"] = sorted(name for name, _ in model.module.named_parameters(remove_duplicate=False))
    result["final"] = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    model.eval()
    with torch.no_grad():
        result["logits"] = model(batches[0][0])  # every stage gets the last stage's output
    model.train()
    result["whole"] = accelerator.unwrap_model(model).state_dict()

    # Resumed on the same layout: the same steps, bit for bit.
    accelerator, model, optimizer = _prepared(ACCUMULATION, pp_size=2, pp_schedule="1f1b")
    accelerator.load_state(root / "pp2")
    result["resumed"] = _train(accelerator, model, optimizer, batches[head:])[0]
    result["resumed_final"] = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}

    # The other schedules, two steps each (the multi-stage ones: 4 stages of one block, 2 on each process).
    for schedule in ("gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"):
        accelerator, model, optimizer = _prepared(pp_size=2, pp_schedule=schedule)
        result[schedule] = _train(accelerator, model, optimizer, batches[:2])[0]

    # Mixed precision: each stage's forward under autocast; fp16's loss scale in every micro-batch's loss.
    for precision in ("bf16", "fp16"):
        accelerator, model, optimizer = _prepared(precision=precision, pp_size=2)
        result[precision], result[f"{precision} norms"] = _train(accelerator, model, optimizer, batches[:2])
        result[f"{precision} scale"] = None if accelerator.scaler is None else accelerator.scaler.get_scale()
        result[f"{precision} autocast"] = all(
            getattr(view.forward, "_autocast_wrapped", False) for view in model.views.values()
        )

    # Saved with pp=2, loaded by DDP: the whole model on each process, every weight the one saved.
    accelerator, model, optimizer = _prepared(ACCUMULATION)
    accelerator.load_state(root / "pp2")
    result["ddp_loaded"] = {name: tensor.clone() for name, tensor in model.module.state_dict().items()}
    result["ddp_losses"] = _train(accelerator, model, optimizer, batches[head:])[0]
    # ... and the other way: DDP's checkpoint (whole weights, the optimizer by index) resumed in 2 stages.
    accelerator.save_state(root / "ddp")
    result["ddp_next"] = _train(accelerator, model, optimizer, batches[:head])[0]
    accelerator, model, optimizer = _prepared(ACCUMULATION, pp_size=2)
    accelerator.load_state(root / "ddp")
    result["pp_from_ddp"] = _train(accelerator, model, optimizer, batches[:head])[0]

    # Saved by FSDP2 over these 2 (its optimizer by parameter group), resumed in 2 stages: the same next steps.
    accelerator, model, optimizer = _prepared(dp_shard_size=2)  # each process the whole batch: one process's steps
    _train(accelerator, model, optimizer, batches[:SAVED_AFTER])
    accelerator.save_state(root / "fsdp")
    result["fsdp_next"] = _train(accelerator, model, optimizer, batches[SAVED_AFTER : 2 * SAVED_AFTER])[0]
    accelerator, model, optimizer = _prepared(pp_size=2)
    accelerator.load_state(root / "fsdp")
    result["pp_from_fsdp"] = _train(accelerator, model, optimizer, batches[SAVED_AFTER : 2 * SAVED_AFTER])[0]

    # Saved with pp=2 x dp_shard=2 on 4 processes, loaded by FSDP2 over these 2.
    accelerator, model, optimizer = _prepared(dp_shard_size=2)
    accelerator.load_state(root / "pp2_dp2")
    result["fsdp_loaded"] = accelerator.get_state_dict(model)
    # ... and by 4 stages on these 2 (2 on each, interleaved 1F1B).
    accelerator, model, optimizer = _prepared(pp_size=2, pp_schedule="interleaved_1f1b")
    accelerator.load_state(root / "pp2_dp2")
    result["stages_loaded"] = accelerator.get_state_dict(model)
    return result | _models_of_others()


def _pipelines_of_four(directory: str) -> dict:
    """On 4 processes: 2 stages x 2-way FSDP2 (each data-parallel rank half the batch), x 2 replicas, x 2-way tensor
    parallelism (1F1B), and 4 stages (GPipe)."""
    from pathlib import Path

    result = {}
    batches = _batches(SAVED_AFTER)
    accelerator, model, optimizer = _prepared(pp_size=2, dp_shard_size=2, pp_microbatches=2)
    rank, half = accelerator.parallelism_config.data_parallel_rank(accelerator.process_index), BATCH // 2
    halves = [
        (idx[rank * half : (rank + 1) * half], targets[rank * half : (rank + 1) * half]) for idx, targets in batches
    ]
    result["pp_dp"] = _train(accelerator, model, optimizer, halves)
    result["dp_rank"] = rank
    accelerator.save_state(Path(directory) / "pp2_dp2")
    result["pp_dp_saved"] = accelerator.get_state_dict(model)
    accelerator, model, optimizer = _prepared(pp_size=2, tp_size=2)
    result["pp_tp"] = _train(accelerator, model, optimizer, batches)
    result["pp_tp_placements"] = sorted({str(p.placements) for p in model.parameters()})
    accelerator, model, optimizer = _prepared(pp_size=2, dp_replicate_size=2, pp_microbatches=2)
    result["pp_replicas"] = _train(accelerator, model, optimizer, halves)
    accelerator, model, optimizer = _prepared(pp_size=4, pp_schedule="gpipe")  # the others above run 1F1B
    result["pp4"] = _train(accelerator, model, optimizer, batches)
    result["pp4_names"] = sorted(name for name, _ in model.module.named_parameters(remove_duplicate=False))
    return result


@pytest.mark.xdist_group("four_workers")  # one test process, so one launch of the shared 4-worker group
def test_pipelined_training_matches_one_process_and_its_checkpoints_load_on_any_layout(launch, tmp_path):
    batches = _batches(STEPS * ACCUMULATION)
    one = _reference(batches, ACCUMULATION)
    four = launch(_pipelines_of_four, str(tmp_path), nproc=4)
    two = launch(_pipelines_of_two, str(tmp_path))
    # Float sums in another order (micro-batches, a gradient summed across stages): 1e-5 over 6 AdamW steps.
    tolerance = {"rel": 0, "abs": 1e-5}
    two_steps = _reference(batches[:2])
    reference, reference_norms = two_steps["losses"], two_steps["norms"]
    for rank in two:
        assert rank["losses"] == pytest.approx(one["losses"], **tolerance)
        assert rank["norms"] == pytest.approx(one["norms"], **tolerance)  # the whole model's norm, on every stage
        torch.testing.assert_close(rank["logits"], one["logits"], rtol=0, atol=1e-4)
        for name, tensor in rank["whole"].items():  # unwrap_model: the whole model, on every process
            torch.testing.assert_close(tensor, one["states"][-1][name], rtol=0, atol=1e-4, msg=name)
        # Resumed after step 3 on the same layout: bit for bit the uninterrupted run.
        assert rank["resumed"] == rank["losses"][SAVED_AFTER * ACCUMULATION :]
        assert all(torch.equal(rank["resumed_final"][name], rank["final"][name]) for name in rank["final"])
        for schedule in ("gpipe", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble"):
            assert rank[schedule] == pytest.approx(reference, **tolerance), schedule
        # Half precision: within its rounding of the fp32 losses (bf16 keeps 8 bits of mantissa, fp16 11); fp16's
        # scaler kept its first scale (no step skipped).
        assert rank["bf16"] == pytest.approx(reference, abs=3e-2) and rank["bf16"] != reference
        assert rank["fp16"] == pytest.approx(reference, abs=5e-3) and rank["fp16 scale"] == 2.0**16
        for precision in ("bf16", "fp16"):  # the gradients of the loss, unscaled: the fp32 norms
            assert rank[f"{precision} norms"] == pytest.approx(reference_norms, rel=5e-2), precision
        assert rank["bf16 autocast"] and rank["fp16 autocast"] and rank["bf16 scale"] is None
        # DDP on the pp=2 checkpoint: every weight the one saved, and the steps after it as the pipeline's.
        assert rank["ddp_loaded"].keys() == one["states"][0].keys()
        saved = two[0]["saved"]
        assert [name for name, tensor in rank["ddp_loaded"].items() if not torch.equal(tensor, saved[name])] == []
        assert rank["ddp_losses"] == pytest.approx(rank["losses"][SAVED_AFTER * ACCUMULATION :], **tolerance)
        assert rank["pp_from_fsdp"] == pytest.approx(rank["fsdp_next"], **tolerance)  # the optimizer's state too
        assert rank["pp_from_ddp"] == pytest.approx(rank["ddp_next"], **tolerance)
    # Hugging Face's GPT-2 cut by its registered plan, against its own loss; a user's ModuleList model.

    gpt2, stack = _gpt2(), _Stack()
    for reference, name, loss_of in (
        (gpt2, "gpt2", lambda idx, targets: gpt2(input_ids=idx, labels=idx).loss),
        (
            stack,
            "stack",
            lambda idx, targets: torch.nn.functional.cross_entropy(stack(idx).reshape(-1, VOCAB), targets.reshape(-1)),
        ),
    ):
        optimizer, expected = torch.optim.AdamW(reference.parameters(), lr=1e-2), []
        for idx, targets in batches[:2]:
            loss = loss_of(idx, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            expected.append(loss.item())
        for rank in two:
            assert rank[name] == pytest.approx(expected, **tolerance), name

    first, last = (set(rank["names"]) for rank in two)
    assert "token_embedding.weight" in first - last and {"ln_f.weight", "lm_head.weight"} <= last - first
    assert first | last == set(one["states"][0])  # each stage its own part, under the model's names
    assert two[0]["losses"] == two[1]["losses"]  # one pipeline: one loss, on both stages
    # Saved with pp=2 x dp_shard=2, loaded by FSDP2 on 2: every weight (gathered to rank 0) equal ...
    saved = four[0]["pp_dp_saved"]
    for loaded in (two[0]["fsdp_loaded"], two[0]["stages_loaded"]):  # ... and by 4 stages on 2 processes
        assert loaded.keys() == saved.keys() and all(torch.equal(loaded[name], saved[name]) for name in saved)

    head = _reference(batches[:SAVED_AFTER])
    for rank in four:
        assert rank["pp_tp"][0] == pytest.approx(head["losses"], **tolerance)
        assert rank["pp4"][0] == pytest.approx(head["losses"], **tolerance)
        for key in ("pp_dp", "pp_replicas"):  # the global batch's gradient norm, sharded or replicated
            assert rank[key][1] == pytest.approx(head["norms"], **tolerance), key
    # Each data-parallel rank's loss is its half's mean: the two halves' mean is the global batch's.
    for key in ("pp_dp", "pp_replicas"):
        by_dp = {rank["dp_rank"]: rank[key][0] for rank in four}
        means = [sum(pair) / 2 for pair in zip(by_dp[0], by_dp[1], strict=True)]
        assert means == pytest.approx(head["losses"], **tolerance), key
    assert {rank["dp_rank"] for rank in four} == {0, 1}
    assert "(Shard(dim=0),)" in four[0]["pp_tp_placements"]  # the stages' layers are split over tp
    assert set().union(*(rank["pp4_names"] for rank in four)) == set(one["states"][0])
