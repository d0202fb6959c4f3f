"""Character-level language modelling: build -> prepare -> train (accumulate, backward, clip) -> evaluate
-> save -> sample.

python -m runner experiment=shakespeare_gpt
python -m runner experiment=shakespeare_gpt_ddp trainer.mixed_precision=bf16

Returns the final eval loss (nats per character): a sweep over this recipe minimises its objective
(the classification recipe returns accuracy, which is maximised).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, RandomSampler

from runner import preemption
from runner.data import build_dataset
from runner.data.text import VOCAB_FILE, CharVocab
from runner.engine import Accelerator, CheckpointError, set_seed
from runner.training import (
    ProgressReporter,
    Throughput,
    TrainingProgress,
    build_optimizer,
    build_scheduler,
    config_hash,
    every,
    model_flops_utilization,
    peak_bf16_flops,
    total_optimizer_steps,
    write_metrics,
)

logger = logging.getLogger("runner")

# What train() returns, for sweeps: the validation loss, which a sweeper minimises.
OBJECTIVE = ("eval/loss", "minimize")

SAMPLES_FILE = "samples.txt"
SAMPLE_COUNT, SAMPLE_LENGTH, SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 3, 300, 0.8, 40


def parameter_groups(model: torch.nn.Module) -> list[dict]:
    """Weight decay on matrices (linear and embedding weights) only, not on biases and LayerNorm gains.

    The first group takes the optimizer's configured ``weight_decay``; the second sets it to 0.
    """
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices}, {"params": others, "weight_decay": 0.0}]


def evaluate(model, loader, accelerator: Accelerator) -> dict[str, float]:
    """Mean loss per character over every window of the eval split exactly once, across all processes.

    Every window holds the same number of characters, so the mean of the windows' mean losses is the
    mean over all characters.
    """
    model.eval()
    losses = []
    with torch.no_grad():
        for inputs, targets in loader:
            logits = model(inputs)
            loss = F.cross_entropy(logits.transpose(1, 2).float(), targets, reduction="none").mean(dim=1)
            losses.append(accelerator.gather_for_metrics(loss))
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


def train(cfg: DictConfig, accelerator: Accelerator) -> float:
    set_seed(cfg.seed)
    block_size = cfg.model.block_size
    windows = {"block_size": block_size, "val_fraction": cfg.data.val_fraction}
    with accelerator.main_process_first():
        train_set = build_dataset(
            cfg.data.name, root=cfg.data.root, split=cfg.data.train_split, download=cfg.data.download, **windows
        )
        eval_set = build_dataset(
            cfg.data.name, root=cfg.data.root, split=cfg.data.eval_split, download=cfg.data.download, **windows
        )
    vocab = train_set.vocab
    model = instantiate(cfg.model, vocab_size=len(vocab))
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

    total_steps = total_optimizer_steps(cfg.trainer, len(train_loader))
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
    accelerator.init_trackers("", config=OmegaConf.to_container(cfg, resolve=True))

    trainer = cfg.trainer
    log_every, eval_every, save_every = (
        trainer.log_every_n_steps,
        trainer.eval_every_n_steps,
        trainer.checkpoint_every_n_steps,
    )
    max_grad_norm = trainer.max_grad_norm
    config_sha256 = config_hash(cfg)
    peak_flops = peak_bf16_flops(accelerator.device)
    reporter = ProgressReporter(accelerator, total=total_steps, initial=progress.step, enabled=trainer.progress_bar)
    throughput = Throughput()  # counts tokens
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
        for inputs, targets in train_loader:
            with accelerator.accumulate(model):
                _, loss = model(inputs, targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients and max_grad_norm:
                    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
                optimizer.step()
                if scheduler is not None and accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
                    scheduler.step()
                optimizer.zero_grad()
            running_loss += loss.detach()
            micro_batches += 1
            throughput.add(inputs.numel() * accelerator.num_processes)
            if not accelerator.sync_gradients:
                continue

            progress.step += 1
            reporter.advance()
            if every(log_every, progress.step):
                mean_loss = accelerator.reduce(running_loss / micro_batches, reduction="mean").item()
                running_loss.zero_()
                micro_batches = 0
                metrics["train/loss"] = mean_loss
                tokens_per_second = throughput.read()
                logged = {"train/loss": mean_loss, "train/lr": optimizer.param_groups[0]["lr"],
                          "train/tokens_per_second": tokens_per_second}  # fmt: skip
                if peak_flops is not None:
                    logged["train/mfu"] = model_flops_utilization(
                        tokens_per_second,
                        flops_per_token=flops_per_token,
                        peak_flops=peak_flops,
                        devices=accelerator.num_processes,
                    )
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
    samples = generate_samples(model, vocab, accelerator, seed=cfg.seed)
    if accelerator.is_main_process:
        vocab.save(project_dir / "model" / VOCAB_FILE)
        (project_dir / SAMPLES_FILE).write_text("\n\n---\n\n".join(samples) + "\n", encoding="utf-8")
        write_metrics(project_dir / "metrics.json", {**metrics, "step": progress.step, "epoch": train_loader.iteration})
    accelerator.end_training()
    return metrics["eval/loss"]
