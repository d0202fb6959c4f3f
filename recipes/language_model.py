"""Character-level language modelling: build -> prepare -> train (accumulate, backward, clip) -> evaluate
-> save -> sample.

python -m runner experiment=shakespeare_gpt
python -m runner experiment=shakespeare_gpt_ddp trainer.mixed_precision=bf16

Returns ``objective.metric``'s final value: the experiments set the eval loss (nats per character),
which a sweep minimises.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils.data import DataLoader, RandomSampler

from runner.data.text import VOCAB_FILE, CharVocab
from runner.engine import Accelerator, CheckpointError, set_seed
from runner.files import write_text_atomically
from runner.folders.layout import METRICS_FILE, MODEL_DIR, SAMPLES_FILE
from runner.models.gpt import next_token_loss
from runner.models.run_weights import reading
from runner.training import preemption, startup, tracker_setup
from runner.training.components import build, build_datasets
from runner.training.loop import (
    TrainingLoop,
    TrainingProgress,
    build_optimizer,
    build_scheduler,
    finish_evaluation,
    model_flops_utilization,
    peak_bf16_flops,
    total_optimizer_steps,
    write_metrics,
)

logger = logging.getLogger("runner")

SAMPLE_COUNT, SAMPLE_LENGTH, SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 3, 300, 0.8, 40


def parameter_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only, not on biases and LayerNorm gains.

    The first group takes the optimizer's configured ``weight_decay``; the second sets it to 0.
    """
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": others, "weight_decay": 0.0}]


def evaluate(model, loader, accelerator: Accelerator, *, stop_on_signal: bool = False) -> dict[str, float]:
    """Mean loss per character over every window of the eval split exactly once, across all processes.

    Every window holds the same number of characters, so the mean of the windows' mean losses is the
    mean over all characters. ``stop_on_signal`` (runner eval): a stop signal ends it at a batch
    (:func:`runner.training.preemption.stop_evaluation`).
    """
    model.eval()
    losses = []
    with torch.no_grad():
        for index, (inputs, targets) in enumerate(loader):
            if stop_on_signal:
                preemption.stop_evaluation(accelerator, index)
            logits = model(inputs)
            loss = F.cross_entropy(logits.transpose(1, 2).float(), targets, reduction="none").mean(dim=1)
            losses.append(accelerator.gather_for_metrics(loss))
    if stop_on_signal:
        preemption.stop_evaluation(accelerator)
    model.train()
    loss = torch.cat(losses).mean().item()
    return {"eval/loss": loss, "eval/perplexity": math.exp(loss)}


def generate_samples(model, vocab: CharVocab, accelerator: Accelerator, *, seed: int) -> list[str]:
    """Text sampled from ``model``, starting from a newline; the same on every process.

    Every process samples (under FSDP each forward gathers the shards from all of them), from the
    same seed and the same weights, so they agree on every draw.
    """
    module = accelerator.unwrap_model(model)
    start = vocab.chars.index("\n") if "\n" in vocab.chars else 0
    prompt = torch.full((SAMPLE_COUNT, 1), start, dtype=torch.long, device=accelerator.device)
    generator = torch.Generator().manual_seed(seed)
    module.eval()
    # A compiled model would recompile for every prompt length; sampling is short, so it runs eagerly.
    with torch.compiler.set_stance("force_eager"):
        tokens = module.generate(
            prompt, SAMPLE_LENGTH, temperature=SAMPLE_TEMPERATURE, top_k=SAMPLE_TOP_K, generator=generator
        )
    module.train()
    return [vocab.decode(row[1:]) for row in tokens.cpu()]


def train(cfg: DictConfig, accelerator: Accelerator) -> float | None:
    set_seed(cfg.seed)
    train_set, eval_set = build_datasets(cfg.data, accelerator)
    vocab = train_set.vocab
    # A resumed run's checkpoint holds every weight: a from_run in the model node reads nothing.
    model = build(reading(cfg.model, "checkpoint") if cfg.resume else cfg.model, key="model", vocab_size=len(vocab))
    flops_per_token = model.flops_per_token()
    logger.info("GPT with %.2fM parameters, vocabulary of %d characters", model.num_parameters() / 1e6, len(vocab))
    if cfg.trainer.compile:
        # In place and before prepare: parameter names, the class (FSDP finds its shard units by class
        # name) and checkpoints stay those of the plain model; DDP and FSDP then wrap the compiled module
        # (FSDP's hooks are excluded from compilation, so each block runs compiled between them).
        model.compile()
    optimizer = build_optimizer(cfg.optimizer, parameter_groups(model))
    shuffle = torch.Generator().manual_seed(cfg.seed)  # the prepared loader shuffles from its seed
    # Random windows: each epoch draws samples_per_epoch window offsets (all of them when null) from a
    # fresh seeded permutation, the same on any number of processes and resumable at any sample.
    train_loader = DataLoader(
        train_set,
        batch_size=cfg.data.batch_size,
        sampler=RandomSampler(train_set, num_samples=cfg.data.samples_per_epoch, generator=shuffle),
        num_workers=cfg.data.num_workers,
    )
    eval_loader = DataLoader(eval_set, batch_size=cfg.data.eval_batch_size, num_workers=cfg.data.num_workers)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    total_steps = total_optimizer_steps(cfg.trainer, train_loader)
    scheduler = build_scheduler(cfg.scheduler, optimizer.optimizer, total_steps)
    if scheduler is not None:
        scheduler = accelerator.prepare(scheduler)
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)

    def save_vocab(models, weights, output_dir: str) -> None:  # every checkpoint can be decoded on its own
        if accelerator.is_main_process:
            vocab.save(Path(output_dir) / VOCAB_FILE)

    accelerator.register_save_state_pre_hook(save_vocab)
    if cfg.resume:
        saved = Path(cfg.resume) / VOCAB_FILE
        if saved.is_file() and CharVocab.load(saved) != vocab:
            raise CheckpointError(
                f"{saved} differs from the vocabulary of the corpus in {cfg.data.root}; resume with the text the run "
                "was trained on."
            )
        accelerator.load_state(cfg.resume)
        logger.info("Resumed at step %d (epoch %d) from %s", progress.step, train_loader.iteration, cfg.resume)
    if cfg.evaluate_only:  # runner eval: a stop signal ends it before it writes anything
        results = evaluate(model, eval_loader, accelerator, stop_on_signal=True)
        finish_evaluation(accelerator, cfg, results, step=progress.step)
        return None
    tracker_setup.start(accelerator, cfg)

    peak_flops = peak_bf16_flops(accelerator.device)

    def utilization(tokens_per_second: float) -> dict[str, float]:  # MFU, on GPUs whose peak is known
        if peak_flops is None:
            return {}
        mfu = model_flops_utilization(
            tokens_per_second, flops_per_token=flops_per_token, peak_flops=peak_flops, devices=accelerator.num_processes
        )
        return {"train/mfu": mfu}

    loop = TrainingLoop(
        accelerator, cfg, progress=progress, total_steps=total_steps,
        evaluate=lambda: evaluate(model, eval_loader, accelerator), unit="tokens", extra_logs=utilization,
    )  # fmt: skip
    max_grad_norm = cfg.trainer.max_grad_norm
    model.train()
    while loop.step < total_steps:  # epoch after epoch, until the step budget is spent
        for inputs, targets in train_loader:
            with accelerator.accumulate(model):
                # Forward and backward (under pipeline parallelism, one step of the pipeline's schedule).
                loss = accelerator.forward_backward(model, inputs, target=targets, loss_fn=next_token_loss)
                if accelerator.sync_gradients and max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()  # after a real optimizer step only (the engine's AcceleratedScheduler)
                optimizer.zero_grad()
            loop.micro_step(loss, samples=inputs.numel(), batch=(inputs, targets))  # tokens
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
    accelerator.save_model(model, project_dir / MODEL_DIR)
    samples = generate_samples(model, vocab, accelerator, seed=cfg.seed)
    if accelerator.is_main_process:
        vocab.save(project_dir / MODEL_DIR / VOCAB_FILE)
        write_text_atomically(project_dir / SAMPLES_FILE, "\n\n---\n\n".join(samples) + "\n")
        summary = {**loop.metrics, "step": progress.step, "epoch": train_loader.iteration, **startup.timings()}
        write_metrics(project_dir / METRICS_FILE, summary)
        accelerator.log({"samples": "\n\n---\n\n".join(samples)}, step=progress.step)  # text, where a tracker takes it
        tracker_setup.finish(accelerator, cfg)
    accelerator.end_training()
    return loop.objective(cfg.objective.metric)
