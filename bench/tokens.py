"""A language-model step: the character-level GPT, tokens/s through the engine vs a raw PyTorch loop.

    python bench/tokens.py           # shakespeare_gpt's model, batch 32 x 64 tokens; 10 steps per round, 7 rounds
    python bench/tokens.py --quick   # a 1-layer, 32-wide GPT, 3 steps per round, 2 rounds (what CI runs)

- CPU, 1 process: the GPT of experiment=shakespeare_gpt (4 layers, 4 heads, 128 wide, block 64) on
  tiny-shakespeare windows, AdamW with gradient clipping; a raw loop vs the same loop through
  Accelerator.prepare/backward/clip_grad_norm_. Target >= 0.98x the raw loop's tokens/s.
- With a CUDA GPU, also: a ~100M-parameter GPT (14 layers, 12 heads, 768 wide, block 1024: 99M
  parameters with the 65-character vocabulary) in bf16 autocast with torch.compile and fused AdamW,
  raw vs engine, tokens/s and model FLOPs utilisation (FLOPs per token from GPT.flops_per_token,
  over the GPU's peak dense bf16 FLOP/s). Targets: >= 0.98x, and MFU >= 40% on H100/H200-class GPUs.

The corpus is read from --data (default ../shared/data/tinyshakespeare beside the checkout).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from common import Report, arguments, interleave
from torch.utils.data import DataLoader, RandomSampler

from runner.data.text import build_char_dataset
from runner.engine import Accelerator
from runner.models import GPT
from runner.training.loop import peak_bf16_flops


@dataclass(frozen=True)
class Setting:
    """One benchmarked configuration: model shape, batch, and how long to time it."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    batch_size: int
    steps: int
    rounds: int
    cuda: bool = False  # bf16 autocast, torch.compile, fused AdamW on the GPU

    def model(self, vocab_size: int) -> GPT:
        torch.manual_seed(0)
        return GPT(vocab_size, block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd)


CPU = Setting(n_layer=4, n_head=4, n_embd=128, block_size=64, batch_size=32, steps=10, rounds=7)
CPU_QUICK = Setting(n_layer=1, n_head=2, n_embd=32, block_size=32, batch_size=8, steps=3, rounds=2)
GPU = Setting(n_layer=14, n_head=12, n_embd=768, block_size=1024, batch_size=32, steps=50, rounds=5, cuda=True)
GPU_QUICK = Setting(n_layer=2, n_head=4, n_embd=256, block_size=256, batch_size=8, steps=3, rounds=2, cuda=True)
MAX_GRAD_NORM = 1.0


def loader(dataset, setting: Setting) -> DataLoader:
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
    return DataLoader(dataset, batch_size=setting.batch_size, sampler=sampler, pin_memory=setting.cuda)


def optimizer_for(model: GPT, setting: Setting) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=setting.cuda or None)


def train_steps(model, optimizer, batches, steps: int, *, backward, clip, device, autocast) -> float:
    """Seconds per token over ``steps`` steps, after two untimed ones (torch.compile compiles in the first)."""
    model.train()
    batches = iter(batches)
    tokens = 0
    for step in range(steps + 2):
        if step == 2:
            synchronize(device)
            start = time.perf_counter()
        inputs, targets = next(batches)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast():
            _, loss = model(inputs, targets)
        backward(loss)
        clip(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += inputs.numel() * (step >= 2)
    synchronize(device)
    return (time.perf_counter() - start) / tokens


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw(dataset, setting: Setting) -> float:
    device = torch.device("cuda" if setting.cuda else "cpu")
    model = setting.model(dataset.vocab_size).to(device)
    if setting.cuda:
        model.compile()
    return train_steps(
        model, optimizer_for(model, setting), loader(dataset, setting), setting.steps,
        backward=lambda loss: loss.backward(), clip=torch.nn.utils.clip_grad_norm_, device=device,
        autocast=lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=setting.cuda),
    )  # fmt: skip


def engine(dataset, setting: Setting) -> float:
    accelerator = Accelerator(cpu=not setting.cuda, mixed_precision="bf16" if setting.cuda else "no")
    model = setting.model(dataset.vocab_size)
    if setting.cuda:
        model.compile()  # as the recipe does with trainer.compile=true: in place, before prepare
    model, optimizer, batches = accelerator.prepare(model, optimizer_for(model, setting), loader(dataset, setting))
    seconds = train_steps(
        model, optimizer, batches, setting.steps, backward=accelerator.backward, clip=accelerator.clip_grad_norm_,
        device=accelerator.device, autocast=contextlib.nullcontext,  # the prepared forward runs under autocast
    )  # fmt: skip
    accelerator.free_memory()
    return seconds


def compare(report: Report, dataset, setting: Setting, label: str) -> float:
    """Interleave raw and engine for ``setting``; report tokens/s and their ratio; return the engine's tokens/s."""
    seconds = interleave(
        {"raw": lambda: raw(dataset, setting), "engine": lambda: engine(dataset, setting)}, setting.rounds
    )
    for name, per_token in seconds.items():
        report.value(f"{label} {name} tokens/s", 1 / per_token, "tokens/s")
    report.ratio(f"engine / raw ({label})", seconds["raw"] / seconds["engine"], ">= 0.98x")
    return 1 / seconds["engine"]


def main() -> None:
    args = arguments(__doc__, data=True, dataset="tinyshakespeare")
    cpu = CPU_QUICK if args.quick else CPU
    report = Report(
        f"GPT tokens/s: CPU {cpu.n_layer} layers x {cpu.n_embd} wide, batch {cpu.batch_size} x {cpu.block_size} "
        f"tokens, {cpu.steps} steps x {cpu.rounds} rounds"
    )
    dataset = build_char_dataset(args.data, split="train", block_size=cpu.block_size)
    compare(report, dataset, cpu, "CPU")
    if torch.cuda.is_available():
        gpu = GPU_QUICK if args.quick else GPU
        dataset = build_char_dataset(args.data, split="train", block_size=gpu.block_size)
        tokens_per_second = compare(report, dataset, gpu, "GPU bf16 compile")
        model = gpu.model(dataset.vocab_size)
        report.note(
            f"GPU: {torch.cuda.get_device_name()}, {model.num_parameters() / 1e6:.1f}M parameters, "
            f"{model.flops_per_token() / 1e9:.3f} GFLOP per token, batch {gpu.batch_size} x {gpu.block_size} tokens"
        )
        peak = peak_bf16_flops(torch.device("cuda", torch.cuda.current_device()))
        if peak is not None:
            mfu = tokens_per_second * model.flops_per_token() / peak
            report.value("GPU engine MFU", 100 * mfu, "% of peak bf16")
            report.ratio("MFU, engine (fraction of peak bf16)", mfu, ">= 0.4x")
    else:
        report.note("No CUDA GPU: the bf16 + torch.compile tokens/s and MFU rows need one.")
    report.finish(args.json)


if __name__ == "__main__":
    main()
