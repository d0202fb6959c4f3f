"""The Accelerator on an N-D mesh (gloo): a GPT trained with tensor parallelism through prepare, its loaders,
metrics and checkpoints, against one process on the same global batches.

One 2-process run (tp=2) and one 2-process run (dp_shard=2) share the checkpoints made here and there.
"""

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from runner.engine import Accelerator, FullyShardedDataParallelPlugin, ParallelismConfig
from runner.models import GPT

VOCAB, TIME, BATCH, SAMPLES = 65, 16, 4, 48
STEPS, SAVED_AT = 12, 8  # 12 batches of 4: one epoch


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, block_size=TIME, n_layer=2, n_head=4, n_embd=32, dropout=0.0)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(VOCAB, (SAMPLES, TIME + 1), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:], torch.arange(SAMPLES))


def _prepared(accelerator: Accelerator, batch_size: int = BATCH):
    """The GPT, its AdamW and a loader of ``batch_size`` per data-parallel rank."""
    model = _gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(2))
    return accelerator.prepare(model, optimizer, loader)


def _steps(accelerator, model, optimizer, batches, count: int) -> tuple[list[float], list[int]]:
    """``count`` AdamW steps with clipping; each step's loss, and the sample indices this rank trained on."""
    losses, seen = [], []
    for _ in range(count):
        idx, targets, index = next(batches)
        _, loss = model(idx, targets)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        seen.extend(index.tolist())
    return losses, seen


def _one() -> Accelerator:
    return Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())


def _tp() -> Accelerator:
    return Accelerator(parallelism_config=ParallelismConfig(tp_size=2))


def _run(new_accelerator, directory: Path) -> dict:
    """Train to SAVED_AT, save, train to the end of the epoch; then resume the saved state and take one step."""
    accelerator = new_accelerator()
    model, optimizer, loader = _prepared(accelerator)
    batches = iter(loader)
    losses, seen = _steps(accelerator, model, optimizer, batches, SAVED_AT)
    accelerator.save_state(directory / "saved")
    rest, rest_seen = _steps(accelerator, model, optimizer, batches, STEPS - SAVED_AT)
    gathered = accelerator.gather_for_metrics(torch.tensor(seen + rest_seen))
    mesh, qkv = accelerator.torch_device_mesh, model.blocks[0].attn.qkv.weight
    resumed = _load_and_step(new_accelerator(), directory / "saved")
    return {
        "losses": losses + rest,
        "resumed": resumed["losses"],
        "seen": seen + rest_seen,
        "resumed_seen": resumed["seen"],
        "gathered": sorted(gathered.tolist()),
        "mesh": None if mesh is None else (mesh.mesh_dim_names, tuple(mesh.shape)),
        "split": tuple(getattr(qkv, "_local_tensor", qkv).shape),
    }


def _load_and_step(accelerator: Accelerator, checkpoint: Path, batch_size: int = BATCH) -> dict:
    model, optimizer, loader = _prepared(accelerator, batch_size)
    accelerator.load_state(checkpoint)
    losses, seen = _steps(accelerator, model, optimizer, iter(loader), 1)
    return {"losses": losses, "seen": seen, "weights": accelerator.get_state_dict(model)}


def _accumulated(accelerator: Accelerator, steps: int = 2) -> list[float]:
    """``steps`` optimizer steps of two accumulated micro-batches of BATCH // 2 (the loss of each micro-batch)."""
    model, optimizer, loader = _prepared(accelerator, batch_size=BATCH // 2)
    losses = []
    for (idx, targets, _), _ in zip(loader, range(2 * steps), strict=False):
        with accelerator.accumulate(model):
            _, loss = model(idx, targets)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _tensor_parallel(directory: str) -> dict:
    result = _run(_tp, Path(directory) / "tp")
    result["from_one_process"] = _load_and_step(_tp(), Path(directory) / "one" / "saved")["losses"]
    accumulating = Accelerator(gradient_accumulation_steps=2, parallelism_config=ParallelismConfig(tp_size=2))
    result["accumulated"] = _accumulated(accumulating)
    return result


def _sharded(directory: str) -> dict:
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
        parallelism_config=ParallelismConfig(dp_shard_size="auto"),
    )
    # Two data-parallel ranks of half the batch each: the same global batch of BATCH samples.
    result = _load_and_step(accelerator, Path(directory) / "tp" / "saved", batch_size=BATCH // 2)
    result["weights"] = None
    mesh = accelerator.torch_device_mesh
    result["mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape))
    return result


def test_tensor_parallel_training_matches_one_process_and_its_checkpoints_reshard(launch, tmp_path):
    # One process, the same global batches: the reference run, and a checkpoint for the TP run to load.
    one = _run(_one, tmp_path / "one")
    one["accumulated"] = _accumulated(Accelerator(gradient_accumulation_steps=2))

    first, second = launch(_tensor_parallel, str(tmp_path))
    assert first["mesh"] == (("dp_replicate", "dp_shard", "tp"), (1, 1, 2))
    assert first["split"] == (3 * 32 // 2, 32)  # each rank holds 2 of the 4 heads' q, k and v rows
    for result in (first, second):
        # The TP group sees the whole global batch: the same samples in the same order as one process.
        assert result["seen"] == one["seen"] and result["resumed_seen"] == one["resumed_seen"]
        assert result["gathered"] == list(range(SAMPLES))  # one entry per sample: no TP rank counted twice
        torch.testing.assert_close(result["losses"], one["losses"], rtol=0, atol=1e-5)
        # Saved with tp=2, resumed with tp=2: the next step is the one the uninterrupted run took.
        assert result["resumed"] == [result["losses"][SAVED_AT]]
        # Saved by one process, resumed with tp=2.
        torch.testing.assert_close(result["from_one_process"], [one["losses"][SAVED_AT]], rtol=0, atol=1e-5)
        # Accumulation: the micro-batches' gradients add up on the split layers as on whole ones.
        torch.testing.assert_close(result["accumulated"], one["accumulated"], rtol=0, atol=1e-5)
    assert first["losses"] == second["losses"]

    # Saved with tp=2, resumed on one process, and with dp_shard=2 (FSDP2).
    alone = _load_and_step(_one(), tmp_path / "tp" / "saved")
    torch.testing.assert_close(alone["losses"], [first["losses"][SAVED_AT]], rtol=0, atol=1e-5)
    assert alone["seen"] == one["resumed_seen"]
    assert all(type(value) is torch.Tensor for value in alone["weights"].values())  # the plain model's weights
    assert sorted(alone["weights"]) == sorted(_gpt().state_dict())

    main, other = launch(_sharded, str(tmp_path))
    for result in (main, other):
        assert result["mesh"] == (("dp_shard",), (2,))  # plain FSDP: one dimension
        torch.testing.assert_close(result["losses"], [first["losses"][SAVED_AT]], rtol=0, atol=1e-5)
    assert sorted(main["seen"] + other["seen"]) == sorted(one["resumed_seen"])  # the batch split in two


def _overflow_on_one_rank() -> dict:
    """fp16 loss scaling under tp=2: an inf in one rank's shard of a gradient must skip the step on both."""
    accelerator = Accelerator(mixed_precision="fp16", parallelism_config=ParallelismConfig(tp_size=2))
    model, optimizer, loader = _prepared(accelerator)
    idx, targets, _ = next(iter(loader))
    skipped = []
    for poison in (False, True, False):
        before = {name: p.detach().full_tensor().clone() for name, p in model.named_parameters()}
        _, loss = model(idx, targets)
        accelerator.backward(loss)
        if poison and accelerator.process_index == 1:
            model.blocks[0].mlp.fc.weight.grad.to_local()[0, 0] = float("inf")
        optimizer.step()
        optimizer.zero_grad()
        changed = [
            name for name, p in model.named_parameters() if not torch.equal(p.detach().full_tensor(), before[name])
        ]
        skipped.append((accelerator.optimizer_step_was_skipped, len(changed)))
    return {"skipped": skipped, "scale": accelerator.scaler.get_scale(), "parameters": len(before)}


def test_an_overflow_in_one_tensor_parallel_shard_skips_the_step_on_every_rank(launch):
    for result in launch(_overflow_on_one_rank):
        (first, first_changed), (poisoned, poisoned_changed), (after, after_changed) = result["skipped"]
        assert (first, poisoned, after) == (False, True, False)
        assert first_changed == after_changed == result["parameters"] and poisoned_changed == 0
        assert result["scale"] == 2.0**16 / 2  # halved once, by the one overflow


def _hybrid_sharded() -> dict:
    """HSDP on 4 processes (2 replicas x 2 shards), one sample per process: the global batch of BATCH."""
    accelerator = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"]),
        parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
    )
    model, optimizer, loader = _prepared(accelerator, batch_size=BATCH // 4)
    losses, seen = _steps(accelerator, model, optimizer, iter(loader), 4)
    mesh = accelerator.torch_device_mesh
    placements = [str(p) for p in model.blocks[0].attn.qkv.weight.placements]
    return {"losses": losses, "seen": seen, "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)), "placements": placements}


@pytest.mark.xdist_group("four_workers")  # one test process, so one launch of the shared 4-worker group
def test_hybrid_sharding_on_four_processes_trains_as_one_process(launch):
    model, optimizer, loader = _prepared(Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()))
    reference, reference_seen = _steps(Accelerator(), model, optimizer, iter(loader), 4)
    results = launch(_hybrid_sharded, nproc=4)
    for result in results:
        assert result["mesh"] == (("dp_replicate", "dp_shard", "tp"), (2, 2, 1))
        assert result["placements"] == ["R", "S(0)"]  # replicated across copies, sharded within
        torch.testing.assert_close(result["losses"], reference, rtol=0, atol=1e-5)
    assert sorted(sum((result["seen"] for result in results), [])) == sorted(reference_seen)


class _TokenWise(torch.nn.Module):
    """A model without attention, each token on its own with its position: context parallelism's sharding of the
    sequence, positions and gradients runs on the CPU for it (torch shards CUDA's attention only)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.place = torch.nn.Embedding(VOCAB, 32), torch.nn.Embedding(TIME, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, VOCAB))

    def forward(self, idx, positions=None):
        positions = torch.arange(idx.shape[1]) if positions is None else positions
        return self.mlp(self.embed(idx) + self.place(positions))


def _token_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _context_parallel() -> dict:
    """cp=2: every sequence split between the 2 processes, 3 steps with accumulation over 2 micro-steps; a GPT's
    attention refused on the CPU in one sentence."""
    accelerator = Accelerator(gradient_accumulation_steps=2, parallelism_config=ParallelismConfig(cp_size=2))
    model = _TokenWise()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    losses, norms, shapes = [], [], set()
    for idx, targets, _ in list(DataLoader(_data(), batch_size=BATCH))[:6]:
        with accelerator.accumulate(model):
            losses.append(accelerator.forward_backward(model, idx, target=targets, loss_fn=_token_loss).item())
            norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        shapes.add((tuple(idx.shape), tuple(targets.shape)))  # restored after the step
        if norm is not None:
            norms.append(norm.item())
    gpt = accelerator.prepare(_gpt())
    try:
        idx, targets, _ = _data()[:BATCH]
        accelerator.forward_backward(gpt, idx, target=targets, loss_fn=_token_loss)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    mesh = accelerator.torch_device_mesh
    return {"losses": losses, "norms": norms, "shapes": shapes, "refused": refused, "mesh": mesh.mesh_dim_names}


def test_context_parallel_steps_split_the_sequence_and_train_as_one_process(launch):
    model = _TokenWise()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step, (idx, targets, _) in enumerate(list(DataLoader(_data(), batch_size=BATCH))[:6], start=1):
        loss = _token_loss(model(idx), targets)
        (loss / 2).backward()
        losses.append(loss.item())
        if step % 2 == 0:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
    for result in launch(_context_parallel):
        assert result["mesh"] == ("dp_replicate", "dp_shard", "cp", "tp")
        assert result["losses"] == pytest.approx(losses, rel=0, abs=1e-6)  # the group's mean: the sequences'
        assert result["norms"] == pytest.approx(norms, rel=0, abs=1e-6)
        assert result["shapes"] == {((BATCH, TIME), (BATCH, TIME))}
        assert result["refused"] == (
            "parallel.cp shards attention with CUDA's kernels only, and this model's attention runs on the CPU (torch "
            "has no sharding rule for it); set parallel.cp=1, or run on GPUs."
        )
