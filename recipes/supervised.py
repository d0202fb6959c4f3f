"""Supervised training of any declared model, datasets, loss and metrics: build -> prepare -> train
(accumulate, backward, clip, step) -> evaluate -> save.

python -m runner experiment=mnist
python -m runner experiment=mnist_ddp trainer.mixed_precision=fp16
runner --config-dir ./conf experiment=mine          # your own model, datasets, loss and metrics

``recipe=classification`` is this recipe under its earlier name. Returns ``objective.metric``'s final value.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from runner.engine import Accelerator, set_seed
from runner.engine.loaders.dispatch import slice_rows
from runner.folders.layout import METRICS_FILE, MODEL_DIR
from runner.metrics import Metrics, build_metrics
from runner.models.adapters import trainable_parameters
from runner.models.run_weights import reading
from runner.training import preemption, startup, tracker_setup
from runner.training.components import (
    batch_size,
    build,
    build_datasets,
    build_loaders,
    build_loss,
    call_arguments,
    compute_loss,
    forward,
    labels,
    predictions,
    save_final_model,
    split_batch,
)
from runner.training.loop import (
    TrainingLoop,
    TrainingProgress,
    build_optimizer,
    build_scheduler,
    finish_evaluation,
    total_optimizer_steps,
    write_metrics,
)

logger = logging.getLogger("runner")


def evaluate(
    model, loader, accelerator: Accelerator, *, loss_fn, metrics: Metrics, stop_on_signal: bool = False
) -> dict[str, float]:
    """The loss and every metric over each eval sample exactly once, across all processes.

    Predictions (the outputs, or their logits) and targets are gathered without the last batch's
    padding, so every rank holds every sample: the loss is the mean over samples, and the metrics
    update once on the gathered tensors. A loss the model computes itself is a batch mean: it is
    weighed by the batch's samples, and at the padded last step taken over the real samples only.
    ``stop_on_signal`` (runner eval): a stop signal ends it at a batch
    (:func:`runner.training.preemption.stop_evaluation`).
    """
    model_loss = loss_fn is None
    model.eval()
    metrics.reset()
    total, count = torch.zeros((), device=accelerator.device), 0
    with torch.no_grad():
        for index, batch in enumerate(loader):
            if stop_on_signal:
                preemption.stop_evaluation(accelerator, index)
            inputs, targets = split_batch(batch, model_loss=model_loss)
            outputs = forward(model, inputs, targets, model_loss=model_loss)
            if model_loss:
                loss = compute_loss(None, outputs, None).detach().float()
                if loader.end_of_dataloader and loader.remainder > 0:  # the padded last step, alike on every rank
                    loss = _real_rows_loss(model, inputs, loader.real_rows(batch_size(inputs)), fallback=loss)
                losses = accelerator.gather_for_metrics(loss.expand(batch_size(inputs)))
                total, count = total + losses.sum(), count + len(losses)
                if not metrics:
                    continue
                targets = labels(inputs, targets)
            outputs, targets = accelerator.gather_for_metrics((predictions(outputs), targets))
            if not model_loss:
                total, count = total + loss_fn(outputs, targets).float() * len(outputs), count + len(outputs)
            metrics.update(outputs, targets)
    if stop_on_signal:
        preemption.stop_evaluation(accelerator)
    model.train()
    return {"eval/loss": (total / max(count, 1)).item(), **metrics.compute()}


def _real_rows_loss(model, inputs, real: int, *, fallback: torch.Tensor) -> torch.Tensor:
    """The model's loss over the first ``real`` rows of ``inputs``: a batch mean over the padded last step's real
    samples only. Every rank runs this forward, so sharded models gather their parameters in step; a rank whose
    batch is all padding runs one row and keeps ``fallback`` (its rows are dropped from the gathered losses)."""
    loss = compute_loss(None, forward(model, slice_rows(inputs, 0, max(real, 1)), model_loss=True), None)
    return loss.detach().float() if real else fallback


def train(cfg: DictConfig, accelerator: Accelerator) -> float | None:
    set_seed(cfg.seed)
    datasets = build_datasets(cfg.data, accelerator)
    # A resumed run's checkpoint holds every weight: a from_run in the model node reads nothing.
    model = build(reading(cfg.model, "checkpoint") if cfg.resume else cfg.model, key="model")
    if cfg.trainer.compile:
        model.compile()  # in place, before prepare: parameter names and checkpoints stay the plain model's
    optimizer = build_optimizer(cfg.optimizer, trainable_parameters(model))
    train_loader, eval_loader = build_loaders(cfg.data, seed=cfg.seed, datasets=datasets)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)
    loss_fn, metrics = build_loss(cfg.loss), build_metrics(cfg.metrics, device=accelerator.device)
    if isinstance(loss_fn, torch.nn.Module):
        loss_fn.to(accelerator.device)
    model_loss = loss_fn is None
    model_loss_fn = functools.partial(compute_loss, loss_fn)  # (outputs, targets) -> the loss

    total_steps = total_optimizer_steps(cfg.trainer, train_loader)
    scheduler = build_scheduler(cfg.scheduler, optimizer.optimizer, total_steps)
    if scheduler is not None:
        scheduler = accelerator.prepare(scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    if cfg.resume:
        accelerator.load_state(cfg.resume)
        logger.info("Resumed at step %d (epoch %d) from %s", progress.step, train_loader.iteration, cfg.resume)

    def evaluate_split() -> dict[str, float]:
        return evaluate(model, eval_loader, accelerator, loss_fn=loss_fn, metrics=metrics)

    if cfg.evaluate_only:  # runner eval: a stop signal ends it before it writes anything
        results = evaluate(model, eval_loader, accelerator, loss_fn=loss_fn, metrics=metrics, stop_on_signal=True)
        finish_evaluation(accelerator, cfg, results, step=progress.step)
        return None
    tracker_setup.start(accelerator, cfg)

    loop = TrainingLoop(
        accelerator, cfg, progress=progress, total_steps=total_steps,
        evaluate=evaluate_split if eval_loader is not None else None,
    )  # fmt: skip
    max_grad_norm = cfg.trainer.max_grad_norm
    model.train()
    while loop.step < total_steps:  # epoch after epoch, until the step budget is spent
        for batch in train_loader:
            inputs, targets = split_batch(batch, model_loss=model_loss)
            args, kwargs = call_arguments(inputs, targets, model_loss=model_loss)
            with accelerator.accumulate(model):
                # Forward and backward (under pipeline parallelism, one step of the pipeline's schedule).
                loss = accelerator.forward_backward(model, *args, target=targets, loss_fn=model_loss_fn, **kwargs)
                if accelerator.sync_gradients and max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()  # after a real optimizer step only (the engine's AcceleratedScheduler)
                optimizer.zero_grad()
            loop.micro_step(loss, samples=batch_size(inputs), batch=batch)
            if not accelerator.sync_gradients:
                continue
            loop.optimizer_step(lr=optimizer.param_groups[0]["lr"])  # counted, and logged on its cadence
            if loop.evaluation_due():
                loop.evaluate()
            if loop.checkpoint_due():
                loop.checkpoint()
            if loop.stop_requested():  # a stop signal reached some process: every process saves and stops here
                if not loop.saved:
                    loop.checkpoint()
                loop.stop()
            if loop.step >= total_steps:
                break
        else:  # the epoch ended before the budget: the cadences left null evaluate and save here
            if loop.evaluation_due(epoch_ended=True):
                loop.evaluate()
            if loop.checkpoint_due(epoch_ended=True):
                loop.checkpoint()
    if not loop.evaluated:  # the last step is always evaluated and saved
        loop.evaluate()
    if not loop.saved:
        loop.checkpoint()
    loop.close()

    project_dir = Path(accelerator.project_dir)
    save_final_model(accelerator, model, project_dir / MODEL_DIR)
    if accelerator.is_main_process:
        summary = {**loop.metrics, "step": progress.step, "epoch": train_loader.iteration, **startup.timings()}
        write_metrics(project_dir / METRICS_FILE, summary)
        tracker_setup.finish(accelerator, cfg)
    accelerator.end_training()
    return loop.objective(cfg.objective.metric)
