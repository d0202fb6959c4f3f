"""Image classification: build -> prepare -> train (accumulate, backward, clip) -> evaluate -> save.

python -m runner experiment=mnist
python -m runner experiment=mnist_ddp trainer.mixed_precision=fp16
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from runner import preemption
from runner.data import build_dataset
from runner.engine import Accelerator, set_seed
from runner.training import (
    ProgressReporter,
    Throughput,
    TrainingProgress,
    build_optimizer,
    build_scheduler,
    config_hash,
    every,
    total_optimizer_steps,
    write_metrics,
)

logger = logging.getLogger("runner")

# What train() returns, for sweeps: Hydra's sweepers optimise it, and sweep summaries rank jobs by it.
OBJECTIVE = ("eval/accuracy", "maximize")


def evaluate(model, loader, accelerator: Accelerator) -> dict[str, float]:
    """Loss and accuracy over every sample of the eval split exactly once, across all processes."""
    model.eval()
    losses, hits = [], []
    with torch.no_grad():
        for images, labels in loader:
            logits = model(images)
            loss = F.cross_entropy(logits, labels, reduction="none")
            loss, hit = accelerator.gather_for_metrics((loss, logits.argmax(dim=-1) == labels))
            losses.append(loss)
            hits.append(hit)
    model.train()
    return {"eval/loss": torch.cat(losses).mean().item(), "eval/accuracy": torch.cat(hits).float().mean().item()}


def train(cfg: DictConfig, accelerator: Accelerator) -> float:
    set_seed(cfg.seed)
    with accelerator.main_process_first():
        train_set = build_dataset(
            cfg.data.name, root=cfg.data.root, split=cfg.data.train_split, download=cfg.data.download
        )
        eval_set = build_dataset(
            cfg.data.name, root=cfg.data.root, split=cfg.data.eval_split, download=cfg.data.download
        )
    model = instantiate(cfg.model)
    if cfg.trainer.compile:
        model.compile()  # in place, before prepare: parameter names and checkpoints stay the plain model's
    optimizer = build_optimizer(cfg.optimizer, model.parameters())
    shuffle = torch.Generator().manual_seed(cfg.seed)  # the prepared loader shuffles from its seed
    train_loader = DataLoader(
        train_set,
        batch_size=cfg.data.batch_size,
        shuffle=True,
        num_workers=cfg.data.num_workers,
        generator=shuffle,
    )
    eval_loader = DataLoader(eval_set, batch_size=cfg.data.eval_batch_size, num_workers=cfg.data.num_workers)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    total_steps = total_optimizer_steps(cfg.trainer, len(train_loader))
    scheduler = build_scheduler(cfg.scheduler, optimizer.optimizer, total_steps)
    if scheduler is not None:
        scheduler = accelerator.prepare(scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    if cfg.resume:
        accelerator.load_state(cfg.resume)
        logger.info("Resumed at step %d (epoch %d) from %s", progress.step, train_loader.iteration, cfg.resume)
    accelerator.init_trackers("", config=OmegaConf.to_container(cfg, resolve=True))

    trainer = cfg.trainer
    log_every, eval_every, save_every = (
        trainer.log_every_n_steps,
        trainer.eval_every_n_steps,
        trainer.checkpoint_every_n_steps,
    )
    max_grad_norm = trainer.max_grad_norm
    config_sha256 = config_hash(cfg)
    reporter = ProgressReporter(accelerator, total=total_steps, initial=progress.step, enabled=trainer.progress_bar)
    throughput = Throughput()
    running_loss, micro_batches = progress.running_loss(accelerator), progress.micro_batches
    metrics: dict[str, float] = {}
    last_eval, last_checkpoint = -1, progress.step if cfg.resume else -1

    def evaluate_and_log() -> None:
        nonlocal last_eval
        metrics.update(evaluate(model, eval_loader, accelerator))
        accelerator.log({k: v for k, v in metrics.items() if k.startswith("eval/")}, step=progress.step)
        reporter.report(progress.step, {k: v for k, v in metrics.items() if k.startswith("eval/")})
        last_eval = progress.step

    def checkpoint() -> None:
        nonlocal last_checkpoint
        progress.keep_running_loss(accelerator, running_loss, micro_batches)
        accelerator.save_state(metadata={"step": progress.step, "config_sha256": config_sha256})
        last_checkpoint = progress.step

    model.train()
    while progress.step < total_steps:
        for images, labels in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(images), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients and max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                if scheduler is not None and accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                optimizer.zero_grad()
            running_loss += loss.detach()
            micro_batches += 1
            throughput.add(len(images) * accelerator.num_processes)
            if not accelerator.sync_gradients:
                continue

            progress.step += 1
            reporter.advance()
            if every(log_every, progress.step):
                mean_loss = accelerator.reduce(running_loss / micro_batches, reduction="mean").item()
                running_loss.zero_()
                micro_batches = 0
                metrics["train/loss"] = mean_loss
                logged = {"train/loss": mean_loss, "train/lr": optimizer.param_groups[0]["lr"],
                          "train/samples_per_second": throughput.read()}  # fmt: skip
                accelerator.log(logged, step=progress.step)
                reporter.report(progress.step, logged)
            if every(eval_every, progress.step):
                evaluate_and_log()
            if every(save_every, progress.step):
                checkpoint()
            if preemption.agreed(accelerator, progress.step):  # a stop signal reached some process: all stop here
                if last_checkpoint != progress.step:
                    checkpoint()
                accelerator.wait_for_checkpoint()
                raise preemption.Preempted(preemption.received() or "a peer's signal", progress.step)
            if progress.step >= total_steps:
                break
        else:  # the epoch ended (rather than the step budget)
            if eval_every is None and last_eval != progress.step:
                evaluate_and_log()
            if save_every is None and last_checkpoint != progress.step:
                checkpoint()

    if last_eval != progress.step:
        evaluate_and_log()
    if last_checkpoint != progress.step:
        checkpoint()
    reporter.close()

    project_dir = Path(accelerator.project_dir)
    accelerator.save_model(model, project_dir / "model")
    if accelerator.is_main_process:
        write_metrics(project_dir / "metrics.json", {**metrics, "step": progress.step, "epoch": train_loader.iteration})
    accelerator.end_training()
    return metrics["eval/accuracy"]
