"""Accelerate's data order, run through either engine: the scenarios behind data/accelerate_orders.json.

Each scenario is a ported loop as an Accelerate user writes it: ``set_seed(42)``, an ``Accelerator`` with a
``DataLoaderConfiguration``, a training loader and an unshuffled evaluation loader prepared together, two epochs of
training then evaluation with ``gather_for_metrics``. It records, per rank, every batch's sample indices and a digest
of torch's global generator after ``prepare`` and after every pass (a loader that draws once too few or once too many
leaves the next epoch's shuffle and every dropout mask different).

:func:`record` runs them all with the API it is given. The reference file holds what Accelerate's records were;
``python -m tests.distributed.record_accelerate_orders`` wrote it (see that script), and tests compare
``runner.engine``'s records with it. Nothing here imports ``accelerate``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SubsetRandomSampler, TensorDataset

REFERENCE = Path(__file__).parent / "data" / "accelerate_orders.json"
SEED = 42
TRAIN_SAMPLES = 37  # 37 % 8: the last global batch of 2 processes x 4 is short and the last batch itself partial
EVAL_SAMPLES = 11
EPOCHS = 2


class _PairedBatches(BatchSampler):
    """A batch sampler of a user's own class (sharded whole by both engines): a shuffled order, cut into fours."""


def _loaders(scenario: str) -> tuple[DataLoader, dict[str, Any]]:
    """The scenario's training loader and the DataLoaderConfiguration settings it runs under."""
    data = TensorDataset(torch.arange(TRAIN_SAMPLES))
    settings: dict[str, Any] = {}
    if scenario == "shuffle":
        loader = DataLoader(data, batch_size=4, shuffle=True)
    elif scenario == "loader_generator":
        loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    elif scenario == "user_sampler":
        loader = DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(range(1, TRAIN_SAMPLES, 2)))
    elif scenario == "batch_sampler":
        loader = DataLoader(data, batch_sampler=_PairedBatches(RandomSampler(data), batch_size=4, drop_last=False))
    elif scenario == "drop_last":
        loader = DataLoader(data, batch_size=4, shuffle=True, drop_last=True)
    elif scenario == "uneven":
        loader, settings = DataLoader(data, batch_size=4, shuffle=True), {"even_batches": False}
    elif scenario == "split_batches":
        loader, settings = DataLoader(data, batch_size=4, shuffle=True), {"split_batches": True}
    elif scenario == "seedable":
        loader, settings = DataLoader(data, batch_size=4, shuffle=True), {"use_seedable_sampler": True}
    elif scenario == "seedable_loader_generator":  # the seed is torch's, not the generator's
        loader = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
        settings = {"use_seedable_sampler": True}
    elif scenario == "seedable_data_seed":
        loader = DataLoader(data, batch_size=4, shuffle=True)
        settings = {"use_seedable_sampler": True, "data_seed": 3}
    else:
        raise ValueError(f"no scenario {scenario!r}")
    return loader, settings


SCENARIOS = (
    "shuffle",
    "loader_generator",
    "user_sampler",
    "batch_sampler",
    "drop_last",
    "uneven",
    "split_batches",
    "seedable",
    "seedable_loader_generator",
    "seedable_data_seed",
)


def _rng() -> str:
    """A digest of torch's global CPU generator: equal exactly when both engines left it in the same state."""
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def run_scenario(api: SimpleNamespace, scenario: str) -> dict[str, Any]:
    """One scenario's record on this rank, run with ``api`` (Accelerate's or the engine's names)."""
    api.set_seed(SEED)
    train, settings = _loaders(scenario)
    evaluation = DataLoader(TensorDataset(torch.arange(EVAL_SAMPLES)), batch_size=4)
    accelerator = api.Accelerator(cpu=True, dataloader_config=api.DataLoaderConfiguration(**settings))
    train, evaluation = accelerator.prepare(train, evaluation)
    record: dict[str, Any] = {"after_prepare": _rng(), "epochs": []}
    for _ in range(EPOCHS):
        epoch: dict[str, Any] = {"train": [batch.tolist() for (batch,) in train], "after_train": _rng()}
        seen, gathered = [], []
        for (batch,) in evaluation:
            seen.append(batch.tolist())
            if settings.get("even_batches") is not False:  # uneven, the ranks may run different numbers of steps
                gathered.extend(accelerator.gather_for_metrics(batch).tolist())
        epoch.update(evaluate=seen, gathered=gathered, after_evaluate=_rng())
        record["epochs"].append(epoch)
    return record


def run_training(api: SimpleNamespace) -> dict[str, Any]:
    """A small model with dropout trained two epochs (accumulating 2 batches) and evaluated after each: every step's
    loss, every evaluation's gathered per-sample losses, and the final weights."""
    api.set_seed(SEED)
    data = TensorDataset(torch.randn(TRAIN_SAMPLES, 4), torch.randn(TRAIN_SAMPLES, 1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    accelerator = api.Accelerator(cpu=True, gradient_accumulation_steps=2)
    train = DataLoader(data, batch_size=4, shuffle=True)
    evaluation = DataLoader(data, batch_size=4)
    model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
    record: dict[str, Any] = {"losses": [], "evaluations": []}
    for _ in range(EPOCHS):
        model.train()
        for inputs, targets in train:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            record["losses"].append(loss.item())
        model.eval()
        with torch.no_grad():
            losses = [
                accelerator.gather_for_metrics(torch.nn.functional.mse_loss(model(x), y, reduction="none")).flatten()
                for x, y in evaluation
            ]
        record["evaluations"].append(torch.cat(losses).tolist())
    record["weights"] = [value.flatten().tolist() for value in accelerator.unwrap_model(model).state_dict().values()]
    return record


def record(api: SimpleNamespace) -> dict[str, Any]:
    """Every scenario's record on this rank, and the training's."""
    return {**{scenario: run_scenario(api, scenario) for scenario in SCENARIOS}, "training": run_training(api)}


def runner_api() -> SimpleNamespace:
    from runner.engine import Accelerator, DataLoaderConfiguration, set_seed

    return SimpleNamespace(Accelerator=Accelerator, DataLoaderConfiguration=DataLoaderConfiguration, set_seed=set_seed)


def record_with_runner() -> dict[str, Any]:
    """This rank's records with ``runner.engine`` (a worker function of the distributed tests)."""
    return record(runner_api())


def reference(num_processes: int) -> list[dict[str, Any]]:
    """Accelerate's records, by rank, for ``num_processes`` processes."""
    return json.loads(REFERENCE.read_text())[str(num_processes)]
