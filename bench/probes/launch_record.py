"""What a run's launch record costs rank 0: written at start-up, and its data-order digest of the first batches.

    python -P bench/probes/launch_record.py            # 20 rounds
    python -P bench/probes/launch_record.py --rounds 5

(``-P``: this folder is not put on the path, where ``cuda.py`` would stand for CUDA's own ``cuda`` package.)

- ``write``: the record of a launch (command, packages, platform, launch shape, named variables) and the start of the
  ``git`` queries for the runner's code and a user package's (a git work tree), against ``import torch``'s time in a
  fresh interpreter for scale.
- ``wait``: collecting those queries (they ran meanwhile: in a run, while the model and data are built).
- ``children CPU``: the CPU time of the ``git`` and hashing processes, per record.
- ``digest``: the first 4 batches of MNIST (64 x 1 x 28 x 28 float32 and labels) and of the GPT preset (64 x 256
  int64 tokens and targets), against the training step they come with.
- ``generators``: looking for random generators of their own in a GPT model's modules.
Median milliseconds; the record is written once per launch, the digest once (4 batches). Not a benchmark (bench/all.py
does not run it): no raw-PyTorch counterpart does this work.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    rounds = parser.parse_args().rounds
    import torch

    from runner.folders import launch_record
    from runner.models.gpt import GPT

    config = {
        "seed": 0,
        "model": {"_target_": "runner.models.MnistCNN"},
        "loss": {"_target_": "torch.nn.CrossEntropyLoss"},
        "metrics": {"accuracy": {"_target_": "torchmetrics.classification.MulticlassAccuracy"}},
    }
    times: dict[str, list[float]] = {"write": [], "wait": [], "digest MNIST": [], "digest GPT": [], "generators": []}
    mnist = [(torch.rand(64, 1, 28, 28), torch.randint(0, 10, (64,))) for _ in range(4)]
    tokens = [(torch.randint(0, 65, (64, 256)), torch.randint(0, 65, (64, 256))) for _ in range(4)]
    model = GPT(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as folder:
        for index in range(rounds):
            run = Path(folder) / str(index)
            run.mkdir()
            started = time.perf_counter()
            record = launch_record.write(run, config=config, overrides=["x=1"], command=["runner", "x=1"],
                                         resume=None, launch={}, hosts=["h"])  # fmt: skip
            times["write"].append(time.perf_counter() - started)
            started = time.perf_counter()
            record.complete()
            times["wait"].append(time.perf_counter() - started)
            for name, batches in (("digest MNIST", mnist), ("digest GPT", tokens)):
                order = launch_record.DataOrder(record, first_batch=0)
                started = time.perf_counter()
                for batch in batches:
                    order.add(batch)
                times[name].append(time.perf_counter() - started)
            started = time.perf_counter()
            launch_record.note_generators("model", model)
            times["generators"].append(time.perf_counter() - started)
            launch_record.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_cpu = (after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime) / rounds
    script = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    torch_import = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    for name, samples in times.items():
        print(f"  {name:<14} {statistics.median(samples) * 1e3:8.2f} ms")
    print(f"  {'children CPU':<14} {child_cpu * 1e3:8.2f} ms")
    print(f"  {'import torch':<14} {float(torch_import.stdout) * 1e3:8.2f} ms   (a fresh interpreter, for scale)")


if __name__ == "__main__":
    main()
