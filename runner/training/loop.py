"""Bookkeeping a recipe calls: the step loop's rules, progress display, throughput, builders, metrics file.

The loop, the forward, backward and optimizer step, and the calls that evaluate, save and stop stay in the
recipe, in plain sight. :class:`TrainingLoop` holds what every recipe must get exactly right and alike: the
log/eval/checkpoint cadences, the end-of-epoch rule, the stop that all ranks agree on after a signal, and the
running loss that a resumed run continues bit for bit.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from omegaconf import DictConfig, OmegaConf

from runner.files import write_text_atomically
from runner.folders import launch_record
from runner.training import preemption
from runner.training.startup import log_first_step, stamp

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


class TrainingLoop:
    """The bookkeeping of a recipe's step-driven loop; the recipe's ``train()`` keeps the loop itself and calls
    each side effect where it happens, as in::

        while loop.step < total_steps:  # epoch after epoch, until the step budget is spent
            for batch in train_loader:
                ...  # forward, backward, optimizer and scheduler steps
                loop.micro_step(loss, samples=..., batch=batch)
                if not accelerator.sync_gradients:
                    continue
                loop.optimizer_step(lr=...)  # counted, and logged on its cadence
                if loop.evaluation_due():
                    loop.evaluate()
                if loop.checkpoint_due():
                    loop.checkpoint()
                if loop.stop_requested():  # a signal reached some rank: every rank saves and stops here
                    ...
                if loop.step == total_steps:
                    break
            else:  # the epoch ended first: the cadences left null evaluate and save here
                ...
        # the last step is always evaluated and saved

    The cadences are ``trainer.log_every_n_steps``, ``eval_every_n_steps`` and ``checkpoint_every_n_steps``
    (null: at the end of each epoch). The running loss is kept in every checkpoint, so a resumed run logs the
    same losses as an uninterrupted one.

    Args:
        accelerator: The run's Accelerator.
        cfg: The run's config (``trainer`` cadences and budget, ``resume``; hashed into each checkpoint).
        progress: The registered :class:`TrainingProgress` (already loaded on resume).
        total_steps: Optimizer steps to train for.
        evaluate: Returns the ``eval/*`` metrics over the whole eval split; None: no evaluation.
        unit: What a batch counts in the throughput: ``train/<unit>_per_second``.
        extra_logs: Given the throughput, more entries for each training log line (MFU, say).
    """

    def __init__(
        self,
        accelerator,
        cfg: DictConfig,
        *,
        progress: TrainingProgress,
        total_steps: int,
        evaluate: Callable[[], dict[str, float]] | None,
        unit: str = "samples",
        extra_logs: Callable[[float], dict[str, float]] | None = None,
    ) -> None:
        trainer = cfg.trainer
        self.accelerator, self.progress, self.total_steps = accelerator, progress, total_steps
        self.log_every, self.eval_every, self.save_every = (
            trainer.log_every_n_steps,
            trainer.eval_every_n_steps,
            trainer.checkpoint_every_n_steps,
        )
        self.evaluate_split, self.unit, self.extra_logs = evaluate, unit, extra_logs
        self.async_checkpoint = trainer.async_checkpoint
        self.config_sha256 = config_hash(cfg)
        self.metrics: dict[str, float] = {}
        self.reporter = ProgressReporter(
            accelerator, total=total_steps, initial=progress.step, enabled=trainer.progress_bar
        )
        self.throughput = Throughput()
        self.stepped = False  # no optimizer step taken yet in this process
        self.running_loss, self.micro_batches = progress.running_loss(accelerator), progress.micro_batches
        self.last_eval, self.last_checkpoint = -1, progress.step if cfg.resume else -1
        # The first batches this launch reads, digested into its record (rank 0; runner.folders.launch_record).
        first_batch = progress.step * trainer.get("gradient_accumulation_steps", 1)  # a checkpoint ends a step
        self.data_order = launch_record.data_order(first_batch=first_batch) if accelerator.is_main_process else None
        stamp("build and prepare")  # the recipe built and prepared everything before its loop

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def evaluated(self) -> bool:
        """Whether this step was evaluated (or there is nothing to evaluate)."""
        return self.evaluate_split is None or self.last_eval == self.step

    @property
    def saved(self) -> bool:
        """Whether this step was saved (the step a resumed run starts from was)."""
        return self.last_checkpoint == self.step

    def evaluation_due(self, *, epoch_ended: bool = False) -> bool:
        """Whether to evaluate now: every ``eval_every_n_steps`` steps, or, when that is null, at an epoch's end."""
        if epoch_ended:
            return self.eval_every is None and not self.evaluated
        return every(self.eval_every, self.step) and self.evaluate_split is not None

    def checkpoint_due(self, *, epoch_ended: bool = False) -> bool:
        """Whether to save now: every ``checkpoint_every_n_steps`` steps, or, when that is null, at an epoch's
        end."""
        if epoch_ended:
            return self.save_every is None and not self.saved
        return every(self.save_every, self.step)

    def micro_step(self, loss, *, samples: int, batch: Any = None) -> None:
        """After a backward: add ``loss`` to this rank's running loss, ``samples`` (per process) to the throughput;
        ``batch`` (what the loader gave) goes into the run's data-order digest while that wants more."""
        if self.data_order is not None and batch is not None:
            self.data_order.add(batch)
            if self.data_order.done:
                self.data_order = None
        self.running_loss += loss.detach()
        self.micro_batches += 1
        self.throughput.add(samples * self.accelerator.num_processes)

    def optimizer_step(self, *, lr: float) -> None:
        """After an optimizer step: count it, and log on the log cadence."""
        if not self.stepped and self.accelerator.is_main_process:
            log_first_step()  # where the start-up time went
        self.stepped = True
        self.progress.step += 1
        self.reporter.advance()
        if every(self.log_every, self.step):
            self.log_training(lr=lr)

    def stop_requested(self) -> bool:
        """Whether a stop signal reached any process by this step (a collective: every rank calls it each step,
        and all of them get the same answer)."""
        return preemption.agreed(self.accelerator, self.step) or preemption.cut_at(self.step)

    def stop(self) -> NoReturn:
        """End the run at this step, once it is saved: the checkpoint committed, the trackers given everything.

        Raises:
            preemption.Preempted: Always; the launcher reports the step, and a requeued job resumes from it.
        """
        self.close()
        self.accelerator.end_training()
        raise preemption.Preempted(preemption.received() or "a peer's signal", self.step)

    def log_training(self, *, lr: float) -> None:
        """The mean loss over every rank's micro-batches since the last log (a collective), lr and throughput."""
        mean_loss = self.accelerator.reduce(self.running_loss / self.micro_batches, reduction="mean").item()
        self.running_loss.zero_()
        self.micro_batches = 0
        self.metrics["train/loss"] = mean_loss
        rate = self.throughput.read()
        logged = {"train/loss": mean_loss, "train/lr": lr, f"train/{self.unit}_per_second": rate}
        if self.extra_logs is not None:
            logged.update(self.extra_logs(rate))
        self.accelerator.log(logged, step=self.step)
        self.reporter.report(self.step, logged)

    def evaluate(self) -> None:
        if self.evaluate_split is None:
            return
        evaluated = self.evaluate_split()
        self.metrics.update(evaluated)
        self.accelerator.log(evaluated, step=self.step)
        self.reporter.report(self.step, evaluated)
        self.last_eval = self.step

    def checkpoint(self) -> None:
        self.progress.keep_running_loss(self.accelerator, self.running_loss, self.micro_batches)
        metadata = {"step": self.step, "config_sha256": self.config_sha256}
        self.accelerator.save_state(metadata=metadata, async_save=self.async_checkpoint)
        self.last_checkpoint = self.step

    def close(self) -> None:
        """The progress bar's end; the data-order digest of a run shorter than it wants is written."""
        if self.data_order is not None:
            self.data_order.flush()
            self.data_order = None
        self.reporter.close()

    def objective(self, metric: str) -> float | None:
        """The final value of ``metric`` (``objective.metric``), or None if the run never logged it."""
        if metric not in self.metrics:
            logger.warning("The objective %s was never logged; the run returns no objective.", metric)
        return self.metrics.get(metric)


def total_optimizer_steps(trainer: DictConfig, batches_per_epoch) -> int:
    """``trainer.max_steps`` if set, else ``max_epochs`` epochs of optimizer steps: ``batches_per_epoch`` is a
    number, or the train loader, asked for its length only then.

    With accumulation an epoch's optimizer steps round up: the last, shorter cycle of an epoch
    also steps.

    Raises:
        ConfigError: Neither is known: a stream without a length, and no ``trainer.max_steps``.
    """
    if trainer.max_steps:
        return int(trainer.max_steps)
    try:
        if not isinstance(batches_per_epoch, int):
            batches_per_epoch = len(batches_per_epoch)
    except TypeError:  # a stream without a length
        from runner.config import ConfigError

        raise ConfigError(
            "trainer.max_steps is null and data.train is a stream without a length, so the number of steps is not "
            "known before the stream ends; set trainer.max_steps."
        ) from None
    return trainer.max_epochs * math.ceil(batches_per_epoch / trainer.gradient_accumulation_steps)


def every(interval: int | None, step: int) -> bool:
    """Whether a cadence of ``interval`` optimizer steps falls on ``step`` (never when None)."""
    return interval is not None and step % interval == 0


def build_optimizer(optimizer_cfg: DictConfig, parameters):
    """Instantiate a ``_partial_`` optimizer config with the model's parameters."""
    from runner.training.components import build, call

    factory = build(optimizer_cfg, key="optimizer")
    return call(factory, parameters, key="optimizer", target=optimizer_cfg._target_)


def build_scheduler(scheduler_cfg: DictConfig | None, optimizer, total_steps: int):
    """Instantiate the scheduler config, giving it ``total_steps`` if it takes that argument; None if unset."""
    from runner.training.components import build, call

    if scheduler_cfg is None:
        return None
    factory = build(scheduler_cfg, key="scheduler")
    target = getattr(factory, "func", factory)
    takes_total = "total_steps" in inspect.signature(target).parameters
    if takes_total:
        factory = functools.partial(factory, total_steps=total_steps)
    return call(factory, optimizer, key="scheduler", target=scheduler_cfg._target_)


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
        if self.is_main and enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def advance(self) -> None:
        """Count an optimizer step."""
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


def finish_evaluation(accelerator, cfg, results: dict[str, float], *, step: int) -> dict[str, Any]:
    """``runner eval``'s end (``evaluate_only``): the main process logs the results and writes them to
    ``eval-<time>.json`` in the run folder, beside what training wrote, which stays as it was."""
    record = {"checkpoint": str(cfg.resume), "step": step, **results}
    if accelerator.is_main_process:
        from datetime import datetime

        project_dir = Path(accelerator.project_dir)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        path, n = project_dir / f"eval-{stamp}.json", 0
        while path.exists():
            n += 1
            path = project_dir / f"eval-{stamp}-{n}.json"
        write_metrics(path, record)
        shown = " | ".join(f"{key} {value:.6g}" for key, value in results.items())
        logger.info("Evaluated %s (step %d): %s; written to %s", cfg.resume, step, shown, path)
    accelerator.end_training()
    return record


def write_metrics(path: str | os.PathLike, metrics: dict[str, Any]) -> None:
    """Write ``metrics`` as JSON, atomically and durably, never through a link."""
    write_text_atomically(path, json.dumps(metrics, indent=2, sort_keys=True) + "\n", mode=0o644)


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
