"""Repeatability: the same 20 CPU training steps, run again and again in fresh processes, end in how many states?

    python bench/probes/repeatability.py          # 20 rounds of 3 processes at once, for each thread setting
    python bench/probes/repeatability.py --rounds 5

Each process trains the tiny GPT-2 of tests/e2e/test_hugging_face.py (2 layers, 32 wide, 32 positions, vocabulary
256) for 20 AdamW steps on fixed random tokens, with dropout, clipping at 1.0, from fixed seeds, and prints a
digest of its final weights. Three run at once (the load under which the suite's resume test once differed),
one setting after the other in each round: ``resolved`` (as a runner worker starts: the thread count fixed and
oneMKL's vector-math kernels resolved, ``runner.engine.numerics``), ``pinned`` (the thread count fixed with
``torch.set_num_threads`` only: MKL's dynamic threading off), ``dynamic`` (torch's defaults) and ``one`` (one
intra-op thread). A deterministic setting ends in one state.
Not a benchmark (bench/all.py does not run it): it measures no speed.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import subprocess
import sys

SETTINGS = ("resolved", "pinned", "dynamic", "one")


def train(setting: str) -> str:
    import torch

    if setting in ("resolved", "pinned"):
        torch.set_num_threads(torch.get_num_threads())
    if setting == "resolved":
        from runner.engine.numerics import resolve_math_kernels

        resolve_math_kernels()
    elif setting == "one":
        torch.set_num_threads(1)
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (20, 16, 32), generator=torch.Generator().manual_seed(1))
    for batch in tokens:
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().numpy().tobytes())
    return f"{torch.get_num_threads()} {digest.hexdigest()[:16]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--at-once", type=int, default=3)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    parser.add_argument("--train", choices=SETTINGS, help=argparse.SUPPRESS)  # one process's run
    args = parser.parse_args()
    if args.train:
        print(train(args.train))
        return
    states: dict[str, collections.Counter] = {setting: collections.Counter() for setting in args.settings}
    for _ in range(args.rounds):
        for setting in args.settings:
            command = [sys.executable, __file__, "--train", setting]
            runs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(args.at_once)]
            for run in runs:
                states[setting][run.communicate()[0].strip()] += 1
    for setting, counts in states.items():
        print(f"  {setting:<8} {sum(counts.values())} runs, {len(counts)} final state(s): " + ", ".join(
            f"{state} x{count}" for state, count in counts.most_common()
        ))  # fmt: skip


if __name__ == "__main__":
    main()
