"""Pipeline parallelism on the CPU: tokens/s of 2 stages against DDP on 2 processes and one process, and the bubble.

    torchrun --nproc_per_node 2 bench/probes/pipeline.py            # shakespeare_gpt's GPT, 32 x 64 tokens a step
    torchrun --nproc_per_node 2 bench/probes/pipeline.py --quick    # a 4-layer, 32-wide GPT, 2 rounds

Every contender trains the same GPT on the same global batch (random token ids, 65-character vocabulary) with
AdamW, one thread per process, in turn in one launch (rounds interleaved, medians reported):

- one process: a raw PyTorch loop on rank 0, the whole batch (rank 1 waits);
- ddp: the engine's DDP, half the batch on each process;
- pp <schedule>: the engine's pipeline, 2 processes each holding half of the blocks, both reading the whole batch,
  split into --microbatches micro-batches (``Accelerator.forward_backward``).

The bubble of a schedule is measured as the share of a step a process does not spend computing its stages: each
process times its stages' forwards and backwards over the same micro-batches alone (no schedule, no
communication), and ``1 - that / step`` is averaged over the processes. It includes the time spent sending and
waiting for activations, which the theory ((pp - 1) / (microbatches + pp - 1) for GPipe and 1F1B) leaves out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# The checkout in place of this folder, whose cuda.py would shadow the package torch imports as "cuda".
sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from runner.engine import Accelerator, ParallelismConfig  # noqa: E402
from runner.engine.parallel.pipeline import bubble_fraction  # noqa: E402
from runner.models import GPT  # noqa: E402
from runner.models.gpt import next_token_loss  # noqa: E402

VOCAB = 65
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def _gpt(args) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.width, dropout=0.0)


def _batch(args, rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return tuple(torch.randint(VOCAB, (rows, args.block), generator=generator) for _ in range(2))


def _timed(run) -> float:
    dist.barrier()
    start = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    args.layers, args.heads, args.width, args.block, args.batch = (
        (4, 2, 32, 32, 8) if args.quick else (4, 4, 128, 64, 32)
    )
    steps, rounds = (2, 2) if args.quick else (10, 7)
    torch.set_num_threads(1)

    ddp = Accelerator()  # joins the launch's process group
    rank, world = ddp.process_index, ddp.num_processes
    contenders = {}

    raw = _gpt(args)
    raw_optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-3)

    def one_process() -> None:
        if rank != 0:
            return
        for step in range(steps):
            _, loss = raw(*_batch(args, args.batch, step))
            loss.backward()
            raw_optimizer.step()
            raw_optimizer.zero_grad()

    contenders["one process"] = one_process

    ddp_model = _gpt(args)
    ddp_model, ddp_optimizer = ddp.prepare(ddp_model, torch.optim.AdamW(ddp_model.parameters(), lr=1e-3))
    share = args.batch // world

    def data_parallel() -> None:
        for step in range(steps):
            idx, targets = (t[rank * share : (rank + 1) * share] for t in _batch(args, args.batch, step))
            ddp.forward_backward(ddp_model, idx, target=targets, loss_fn=next_token_loss)
            ddp_optimizer.step()
            ddp_optimizer.zero_grad()

    contenders["ddp"] = data_parallel
    pipelines = {}
    for schedule in SCHEDULES:
        config = ParallelismConfig(pp_size=world, pp_schedule=schedule, pp_microbatches=args.microbatches)
        accelerator = Accelerator(parallelism_config=config)
        model = _gpt(args)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        pipelines[schedule] = (accelerator, model, optimizer)

        def pipeline(accelerator=accelerator, model=model, optimizer=optimizer) -> None:
            for step in range(steps):
                idx, targets = _batch(args, args.batch, step)
                accelerator.forward_backward(model, idx, target=targets, loss_fn=next_token_loss)
                optimizer.step()
                optimizer.zero_grad()

        contenders[f"pp {schedule}"] = pipeline

    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(rounds + 1):  # the first round warms up (and fixes each schedule's shapes)
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            seconds = _timed(contenders[name])
            if round_:
                samples[name].append(seconds / steps)
    step_seconds = {name: statistics.median(values) for name, values in samples.items()}

    busy = {schedule: _busy_seconds(args, *pipelines[schedule][:2]) for schedule in SCHEDULES}
    tokens = args.batch * args.block
    if rank == 0:
        shape = f"GPT {args.layers} layers x {args.width} wide, block {args.block}, {args.batch} sequences a step"
        print(f"{shape}, {args.microbatches} micro-batches, {world} processes of 1 thread; medians of {rounds} rounds")
        base = step_seconds["one process"]
        for name, seconds in step_seconds.items():
            print(f"  {name:<24} {tokens / seconds:10.0f} tokens/s   {base / seconds:6.3f}x one process")
        for schedule in SCHEDULES:
            measured = 1 - busy[schedule] / step_seconds[f"pp {schedule}"]
            theory = bubble_fraction(schedule, pp=world, microbatches=args.microbatches)
            print(f"  bubble {schedule:<17} measured {measured:6.1%} (idle and communicating)   theory {theory:6.1%}")
    ddp.end_training()


def _busy_seconds(args, accelerator, model) -> float:
    """This process's stages computing one step alone: each micro-batch's forward and backward through its views,
    on inputs of the shapes the schedule passes (median of 5, averaged over the processes)."""
    rows = args.batch // args.microbatches
    idx, targets = _batch(args, rows, 0)

    def compute() -> None:
        for _ in range(args.microbatches):
            for index, view in sorted(model.views.items()):
                x = idx if index == 0 else torch.randn(rows, args.block, args.width, requires_grad=True)
                out = view(x)
                loss = next_token_loss(out, targets) if index == model.num_stages - 1 else out.sum()
                loss.backward()
        model.zero_grad()

    compute()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        compute()
        times.append(time.perf_counter() - start)
    seconds = torch.tensor(statistics.median(times))
    dist.all_reduce(seconds)
    return seconds.item() / accelerator.num_processes


if __name__ == "__main__":
    main()
