"""What only a CUDA GPU can check: the runner's GPU paths on one GPU, and async saves from GPU memory.

    python bench/probes/cuda.py --data ../shared/data/tinyshakespeare --json cuda.json

Each check prints one line and its numbers; the script exits non-zero if any check fails.

1. ``async``: ``save_state(async_save=True)`` of a model and AdamW moments on the GPU (24 x Linear(2048, 2048),
   1.2 GB), five saves: how long each returns after, against copying the same tensors to fresh pageable host
   memory and into pinned host buffers made beforehand (the floor: one copy over PCIe). The saves after the first
   copy into the host buffers the first one pinned. The last checkpoint is loaded back into a fresh model and
   optimizer and compared bit for bit.
2. ``bf16_compile``: ``experiment=shakespeare_gpt trainer.mixed_precision=bf16 trainer.compile=true``, 300 steps
   with an asynchronous checkpoint every 100: the eval loss falls below 2.6 (4.17 at the start).
3. ``fp16``: the same without compile, in fp16 (a gradient scaler): the eval loss falls below 2.6 and the
   checkpoint holds the scaler's state.
4. ``resume``: 12 bf16 steps uninterrupted against 6 cut at the step-4 checkpoint and resumed to 12, with
   dropout: the final weights and metrics, equal bit for bit or not (reported; CUDA kernels need not be
   deterministic).
5. ``fsdp``: ``experiment=shakespeare_gpt_fsdp trainer.num_processes=1`` in bf16 with asynchronous sharded
   checkpoints, 20 steps, resumed from step 10, and ``runner export`` of its last checkpoint equal to the final
   model (every tensor of the final model, and the tied head besides).
Not a benchmark (bench/all.py does not run it): it needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from runner.engine import Accelerator

ROOT = Path(__file__).resolve().parents[2]


def async_saves(folder: Path) -> dict:
    accelerator = Accelerator(mixed_precision="no")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(24)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(8, 2048, device=accelerator.device)).square().mean().backward()
    optimizer.step()
    tensors = [*model.state_dict().values()] + [v for s in optimizer.state.values() for v in s.values() if v.dim()]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    returns, waits, pageable, into_pinned = [], [], [], []
    for index in range(5):
        pageable.append(timed(lambda: [t.to("cpu") for t in tensors]))
        into_pinned.append(timed(lambda: [p.copy_(t, non_blocking=True) for p, t in zip(pinned, tensors, strict=True)]))
        start = time.perf_counter()
        accelerator.save_state(folder / f"save_{index}", async_save=True)
        returns.append(time.perf_counter() - start)
        waits.append(timed(accelerator.wait_for_checkpoint))
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = [v.detach().cpu().clone() for s in optimizer.state.values() for v in s.values()]
    accelerator.end_training()

    fresh = Accelerator(mixed_precision="no")
    other = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(24)))
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3)
    other, other_optimizer = fresh.prepare(other, other_optimizer)
    fresh.load_state(folder / "save_4")
    loaded = {k: v.detach().cpu() for k, v in other.state_dict().items()}
    loaded_moments = [v.detach().cpu() for s in other_optimizer.state.values() for v in s.values()]
    equal = loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)
    equal = equal and len(moments) == len(loaded_moments) and all(map(torch.equal, moments, loaded_moments))
    floor = min(into_pinned)
    return {
        "ok": bool(equal),
        "gigabytes": nbytes / 1e9,
        "first_return_s": returns[0],
        "later_returns_s": returns[1:],
        "wait_s": waits,
        "pageable_copy_s": min(pageable),
        "pinned_copy_s": floor,
        "later_return_over_pinned_copy": min(returns[1:]) / floor,
        "later_return_over_pageable_copy": min(returns[1:]) / min(pageable),
        "loaded_bit_for_bit": bool(equal),
    }


def runner(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, capture_output=True, text=True)
    return done, time.perf_counter() - start


def final(run: Path) -> dict:
    return json.loads((run / "metrics.json").read_text())


def language_models(data: Path, folder: Path) -> dict:
    common = [
        f"data.root={data}", "data.download=false", 'data.eval_split="val[:2048]"', "data.eval_batch_size=256",
        "trainer.progress_bar=false", "trainer.log_every_n_steps=50",
    ]  # fmt: skip
    results = {}
    for name, extra in (("bf16_compile", ["trainer.mixed_precision=bf16", "trainer.compile=true"]),
                        ("fp16", ["trainer.mixed_precision=fp16"])):  # fmt: skip
        run = folder / name
        done, seconds = runner(
            "experiment=shakespeare_gpt", *common, *extra, "trainer.max_steps=300", "trainer.eval_every_n_steps=300",
            "trainer.checkpoint_every_n_steps=100", "trainer.async_checkpoint=true", f"hydra.run.dir={run}", cwd=folder
        )  # fmt: skip
        result = {"returncode": done.returncode, "seconds": seconds}
        if done.returncode == 0:
            result["metrics"] = final(run)
            result["checkpoints"] = sorted(p.name for p in (run / "checkpoints").iterdir())
            files = sorted(p.name for p in (run / "checkpoints" / "checkpoint_2").iterdir())
            result["checkpoint_files"] = files
        else:
            result["stderr"] = done.stderr[-3000:]
        loss = result.get("metrics", {}).get("eval/loss", float("inf"))
        result["ok"] = done.returncode == 0 and loss < 2.6 and len(result.get("checkpoints", [])) == 3
        if name == "fp16":
            result["ok"] = result["ok"] and any("scaler" in f for f in result.get("checkpoint_files", []))
        results[name] = result

    flat = ["scheduler.warmup_steps=0", "scheduler.min_lr_ratio=1.0", "model.dropout=0.1"]
    resume = [*common, "experiment=shakespeare_gpt", *flat, "trainer.mixed_precision=bf16",
              "trainer.checkpoint_every_n_steps=4"]  # fmt: skip
    full, cut = folder / "full", folder / "cut"
    codes = [runner(*resume, "trainer.max_steps=12", f"hydra.run.dir={full}", cwd=folder)[0]]
    codes.append(runner(*resume, "trainer.max_steps=6", f"hydra.run.dir={cut}", cwd=folder)[0])
    codes.append(runner(f"resume={cut}/checkpoints/checkpoint_0", "trainer.max_steps=12", cwd=folder)[0])
    result = {"returncodes": [c.returncode for c in codes]}
    if all(c.returncode == 0 for c in codes):
        a, b = load_file(full / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
        result["weights_bit_for_bit"] = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        result["max_abs_difference"] = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
        result["metrics_equal"] = final(full) == final(cut)
        result["metrics"] = [final(full), final(cut)]
    else:
        result["stderr"] = [c.stderr[-2000:] for c in codes if c.returncode]
    result["ok"] = all(c.returncode == 0 for c in codes)
    results["resume"] = result

    run = folder / "fsdp"
    fsdp = [*common, "experiment=shakespeare_gpt_fsdp", "trainer.num_processes=1", "trainer.mixed_precision=bf16",
            "trainer.checkpoint_every_n_steps=10", "trainer.async_checkpoint=true"]  # fmt: skip
    codes = [runner(*fsdp, "trainer.max_steps=10", f"hydra.run.dir={run}", cwd=folder)[0]]
    codes.append(runner(f"resume={run}", "trainer.max_steps=20", cwd=folder)[0])
    exported = folder / "exported"
    codes.append(subprocess.run([sys.executable, "-m", "runner", "export", str(run / "checkpoints" / "checkpoint_1"),
                                 "--to", str(exported)], cwd=folder, capture_output=True, text=True))  # fmt: skip
    result = {"returncodes": [c.returncode for c in codes]}
    if all(c.returncode == 0 for c in codes):
        a, b = load_file(run / "model" / "model.safetensors"), load_file(exported / "model.safetensors")
        # the export also lists the tied head (lm_head.weight), which model.safetensors stores once
        result["export_equals_final_model"] = set(a) <= set(b) and all(torch.equal(a[k], b[k]) for k in a)
        result["metrics"] = final(run)
        result["resumed"] = "Resumed at step 10" in (run / "run.log").read_text()
        result["ok"] = result["export_equals_final_model"] and result["resumed"]
    else:
        result["stderr"] = [c.stderr[-2000:] for c in codes if c.returncode]
        result["ok"] = False
    results["fsdp"] = result
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "tinyshakespeare")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/probes/cuda.py needs a CUDA GPU.")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as folder:
        results["async"] = async_saves(Path(folder))
        print("async", json.dumps(results["async"]), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for name, result in language_models(args.data.resolve(), Path(folder)).items():
            results[name] = result
            print(name, json.dumps(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    failed = [name for name, result in results.items() if isinstance(result, dict) and not result["ok"]]
    print("failed:" if failed else "all passed", *failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
