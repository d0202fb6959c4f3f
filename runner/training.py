"""Bookkeeping a recipe calls: step budget, cadence, progress display, throughput, builders, metrics file.

The training loop itself stays in the recipe; these helpers keep it short without hiding it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from runner.startup import log_first_step, stamp

logger = logging.getLogger("runner")


@dataclass
class TrainingProgress:
    """Optimizer steps taken, and every rank's running loss since the last log.

    Registered for checkpointing, so a resumed run continues the count and logs the same losses as
    an uninterrupted one. ``loss_totals`` is gathered from all ranks just before a save (rank 0
    writes the file), and each rank takes its own entry back on resume.
    """

    step: int = 0
    loss_totals: list[float] = field(default_factory=list)
    micro_batches: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "loss_totals": list(self.loss_totals), "micro_batches": self.micro_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.loss_totals = [float(total) for total in state.get("loss_totals", [])]
        self.micro_batches = int(state.get("micro_batches", 0))

    def running_loss(self, accelerator):
        """This rank's running loss as the checkpoint left it (their mean on another world size); 0 when fresh."""
        import torch

        loss = torch.zeros((), device=accelerator.device)
        totals = self.loss_totals
        if totals:
            loss.fill_(totals[accelerator.process_index] if len(totals) == accelerator.num_processes
                       else sum(totals) / len(totals))  # fmt: skip
        return loss

    def keep_running_loss(self, accelerator, running_loss, micro_batches: int) -> None:
        """Before a save: every rank's running loss (all ranks take part) and this rank's micro-batch count."""
        self.loss_totals = accelerator.gather(running_loss.reshape(1)).tolist()
        self.micro_batches = micro_batches


def total_optimizer_steps(trainer: DictConfig, batches_per_epoch: int) -> int:
    """``trainer.max_steps`` if set, else ``max_epochs`` epochs of optimizer steps.

    With accumulation an epoch's optimizer steps round up: the last, shorter cycle of an epoch
    also steps.
    """
    if trainer.max_steps:
        return int(trainer.max_steps)
    return trainer.max_epochs * math.ceil(batches_per_epoch / trainer.gradient_accumulation_steps)


def every(interval: int | None, step: int) -> bool:
    """Whether a cadence of ``interval`` optimizer steps falls on ``step`` (never when None)."""
    return interval is not None and step % interval == 0


def build_optimizer(optimizer_cfg: DictConfig, parameters):
    """Instantiate a ``_partial_`` optimizer config with the model's parameters."""
    return instantiate(optimizer_cfg)(parameters)


def build_scheduler(scheduler_cfg: DictConfig | None, optimizer, total_steps: int):
    """Instantiate the scheduler config, giving it ``total_steps`` if it takes that argument; None if unset."""
    if scheduler_cfg is None:
        return None
    factory = instantiate(scheduler_cfg)
    target = getattr(factory, "func", factory)
    takes_total = "total_steps" in inspect.signature(target).parameters
    return factory(optimizer, total_steps=total_steps) if takes_total else factory(optimizer)


class Throughput:
    """Samples per second between two reads."""

    def __init__(self) -> None:
        self.samples = 0
        self.started = time.perf_counter()

    def add(self, samples: int) -> None:
        self.samples += samples

    def read(self) -> float:
        now = time.perf_counter()
        rate = self.samples / max(now - self.started, 1e-9)
        self.samples, self.started = 0, now
        return rate


class ProgressReporter:
    """A progress bar on the main process when it writes to a terminal; plain log lines otherwise."""

    def __init__(self, accelerator, *, total: int, initial: int, enabled: bool = True) -> None:
        self.total = total
        self.is_main = accelerator.is_main_process
        self.bar = None
        self.started = False
        stamp("build and prepare")
        if self.is_main and enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def advance(self) -> None:
        """Count an optimizer step (the first one also logs where the start-up time went)."""
        if not self.started and self.is_main:
            log_first_step()
        self.started = True
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        text = " | ".join(f"{name} {_format(value)}" for name, value in metrics.items())
        if self.bar is None:
            logger.info("step %d/%d | %s", step, self.total, text)
            return
        self.bar.set_postfix_str(text, refresh=False)
        if any(name.startswith("eval/") for name in metrics):  # evaluations stay on screen above the bar
            self.bar.write(f"step {step}/{self.total} | {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _format(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def config_hash(cfg: DictConfig) -> str:
    """sha256 of the resolved config (keys sorted): the same config always hashes the same."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()


def write_metrics(path: str | os.PathLike, metrics: dict[str, Any]) -> None:
    """Write ``metrics`` as JSON, atomically."""
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)


# Dense bf16 tensor-core peaks (FLOP/s) by GPU name, most specific first: the denominator of MFU.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
)


def peak_bf16_flops(device) -> float | None:
    """The GPU's peak dense bf16 FLOP/s from :data:`PEAK_BF16_FLOPS`; None on the CPU or an unlisted GPU."""
    if getattr(device, "type", device) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((peak for model, peak in PEAK_BF16_FLOPS if model in name), None)


def model_flops_utilization(
    tokens_per_second: float, *, flops_per_token: float, peak_flops: float, devices: int
) -> float:
    """The fraction of ``devices`` GPUs' peak that ``tokens_per_second`` (all devices together) amounts to."""
    return tokens_per_second * flops_per_token / (peak_flops * devices)
