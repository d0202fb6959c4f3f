"""Tensor parallelism on gloo: a GPT split across 2 processes, and FSDP2 x TP, HSDP and DDP x TP meshes on 4.

Each run is compared with the same model trained in this (the test's) process on the same global
batch: same math, so the same losses and gradient norms up to the order of float32 sums.
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from runner.engine.distributed import init_process_group, read_environment
from runner.engine.parallel.mesh import ParallelismConfig, data_parallel_mesh
from runner.engine.parallel.tensor_parallel import apply_tensor_parallel
from runner.models import GPT
from tests.distributed.conftest import launch_workers

VOCAB, BATCH, TIME = 65, 8, 16


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, **{"block_size": TIME, "n_layer": 2, "n_head": 4, "n_embd": 32, "dropout": 0.0, **overrides})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randint(VOCAB, (BATCH, TIME), generator=generator) for _ in range(2))


def _train(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, steps: int) -> tuple[list[float], list]:
    """AdamW steps with clipping (it is active: the norms start above 1); each step's loss and norm."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for _ in range(steps):
        _, loss = model(idx, targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _reference(steps: int) -> tuple[list[float], list[float]]:
    losses, norms = _train(_gpt(), *_batch(), steps)
    return losses, [norm.item() for norm in norms]


def _full_norms(norms: list) -> list[tuple[str, float]]:
    return [(type(norm).__name__, norm.full_tensor().item()) for norm in norms]


def _mesh(**sizes):
    env = read_environment()
    init_process_group(env)
    config = ParallelismConfig(**sizes).resolve(env.world_size)
    return env, config, config.build_device_mesh("cpu")


def _error(build) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return "no error"


def _split_across_two():
    env, _, mesh = _mesh(tp_size=2)
    model = apply_tensor_parallel(_gpt(), mesh["tp"], GPT.tp_plan)
    idx, targets = _batch()
    logits, loss = model(idx, targets)
    losses, norms = _train(model, idx, targets, steps=20)
    attention = model.blocks[0].attn

    # A LayerNorm in sequence parallelism: each process normalises its half of the positions.
    norm_layer = nn.Sequential(nn.LayerNorm(8))
    apply_tensor_parallel(norm_layer, mesh["tp"], {"0": "sequence"})
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    sequence_out = norm_layer(x[:, 2 * env.rank : 2 * env.rank + 2])

    return {
        "logits": logits.detach(),
        "loss": loss.item(),
        "losses": losses,
        "norms": _full_norms(norms),
        "tied": model.lm_head.weight is model.token_embedding.weight,
        "local_qkv": tuple(attention.qkv.weight.to_local().shape),
        "local_proj": tuple(attention.proj.weight.to_local().shape),
        "sequence": (
            type(sequence_out).__name__,
            sequence_out.full_tensor().detach(),
            nn.functional.layer_norm(x, (8,)),
        ),
        "errors": [
            _error(lambda: apply_tensor_parallel(_gpt(n_head=3, n_embd=48), mesh["tp"], GPT.tp_plan)),
            _error(lambda: apply_tensor_parallel(nn.Sequential(nn.Linear(4, 3)), mesh["tp"], {"0": "colwise"})),
            _error(lambda: apply_tensor_parallel(_gpt(), mesh["tp"], {"lm_head": "colwise"})),
        ],
    }


def test_a_gpt_split_across_two_processes_computes_and_trains_as_one(launch):
    results = launch(_split_across_two)
    reference = _gpt()
    logits, loss = reference(*_batch())
    losses, norms = _reference(steps=20)
    for result in results:
        torch.testing.assert_close(result["logits"], logits.detach(), rtol=0, atol=1e-6)
        assert result["loss"] == pytest.approx(loss.item(), abs=1e-6)
        assert result["losses"] == pytest.approx(losses, abs=1e-5)
        # clip_grad_norm_ returns a DTensor, whose full value is the whole model's norm (FSDPStrategy.total_norm).
        assert [kind for kind, _ in result["norms"]] == ["DTensor"] * 20
        assert [value for _, value in result["norms"]] == pytest.approx(norms, rel=1e-5)
        assert result["tied"]
        assert result["local_qkv"] == (48, 32) and result["local_proj"] == (32, 16)  # 2 of the 4 heads each
        kind, sequence_out, expected = result["sequence"]
        assert kind == "DTensor"
        torch.testing.assert_close(sequence_out, expected)
        assert result["errors"] == [
            "blocks.0.attn has n_head=3 attention heads, which parallel.tp=2 does not divide; choose a parallel.tp "
            "that divides the number of heads.",
            "parallel.tp=2 does not divide 0's out_features=3; choose a parallel.tp that divides it, or leave 0 out "
            "of parallel.tp_plan.",
            "lm_head.weight is tied to token_embedding.weight, and parallel.tp_plan would split it apart; leave the "
            "modules of all tied parameters out of parallel.tp_plan (they stay replicated).",
        ]
    assert results[0]["losses"] == results[1]["losses"]  # one TP group: one model, one loss


MESHES = {
    "fsdp x tp": {"dp_shard_size": 2, "tp_size": 2},
    "hsdp": {"dp_replicate_size": 2, "dp_shard_size": 2},
    "ddp x tp": {"dp_replicate_size": 2, "tp_size": 2},  # fully_shard over (dp_replicate, dp_shard=1): replicas
}
STEPS = 10


def _on_meshes_of_four():
    """Each of MESHES on the same 4 processes: TP first, then fully_shard per block and the root, then AdamW."""
    env = read_environment()
    init_process_group(env)
    results = {}
    for name, sizes in MESHES.items():
        config = ParallelismConfig(**sizes).resolve(env.world_size)
        mesh = config.build_device_mesh("cpu")
        model = _gpt()
        if config.tp_enabled:
            apply_tensor_parallel(model, mesh["tp"], GPT.tp_plan)
        for unit in [*model.blocks, model]:
            fully_shard(unit, mesh=mesh[config.fsdp_dim_names])
        dp = data_parallel_mesh(mesh)
        share = BATCH // dp.size()  # each data-parallel rank its part of the global batch; TP peers the same one
        rows = slice(dp.get_local_rank() * share, (dp.get_local_rank() + 1) * share)
        idx, targets = (t[rows] for t in _batch())
        losses, norms = _train(model, idx, targets, STEPS)
        results[name] = {
            "dp": (dp.size(), dp.get_local_rank(), config.data_parallel_rank(env.rank)),
            "losses": losses,
            "norms": _full_norms(norms),
            "placements": str(model.blocks[0].attn.qkv.weight.placements),
            "all_dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
            "tied": model.lm_head.weight is model.token_embedding.weight,
        }
    return results


@pytest.fixture(scope="module")
def meshes_of_four():
    with pytest.MonkeyPatch.context() as patch:  # as the launch fixture does, once for the module's tests
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.delenv("RANK", raising=False)
        patch.delenv("WORLD_SIZE", raising=False)
        return launch_workers(_on_meshes_of_four, nproc=4)


@pytest.mark.parametrize(
    ("name", "placements"),
    [
        ("fsdp x tp", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),  # FSDP's shard of TP's shard of the rows
        ("hsdp", "(Replicate(), Shard(dim=0))"),
        ("ddp x tp", "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"),
    ],
)
def test_a_mesh_of_four_trains_as_one_process_on_the_global_batch(meshes_of_four, name, placements):
    losses, norms = _reference(STEPS)
    per_rank = [result[name] for result in meshes_of_four]
    dp_ranks = [rank["dp"] for rank in per_rank]
    assert dp_ranks == ([(2, 0, 0), (2, 0, 0), (2, 1, 1), (2, 1, 1)] if "tp" in name else [(4, r, r) for r in range(4)])
    # Each data-parallel rank's loss is the mean over its share: their mean is the global batch's.
    mean = [sum(step) / len(per_rank) for step in zip(*(rank["losses"] for rank in per_rank), strict=True)]
    assert mean == pytest.approx(losses, abs=1e-5)
    for rank in per_rank:
        assert [kind for kind, _ in rank["norms"]] == ["DTensor"] * STEPS
        assert [value for _, value in rank["norms"]] == pytest.approx(norms, rel=1e-5)
        assert rank["placements"] == placements
        assert rank["all_dtensors"] and rank["tied"]
