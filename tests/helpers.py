"""Small models and data shared by the engine tests."""

from __future__ import annotations

import contextlib
import functools
import http.server
import threading
import urllib.request
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, features: int = 8, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    w = torch.randn(features, 1, generator=generator)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=generator))


class StepCounter:
    """A user object registered for checkpointing."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class SampleCount:
    """A plain metric (no torchmetrics): how many samples it saw, to tell each sample was counted once."""

    def __init__(self) -> None:
        self.count = 0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.count += len(targets)

    def compute(self) -> int:
        return self.count

    def reset(self) -> None:
        self.count = 0


class StatefulRange(torch.utils.data.IterableDataset):
    """range(n) as a stream that records its position (``state_dict``) and counts the samples it reads. A loaded
    state applies to the next pass only; any other pass starts at 0, as Hugging Face's streams do."""

    def __init__(self, n: int) -> None:
        self.n, self.next, self.start, self.reads = n, 0, 0, 0

    def __iter__(self):
        start, self.start = self.start, 0
        self.next = start
        for index in range(start, self.n):
            self.reads += 1
            self.next = index + 1
            yield index

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.start = self.next = state["next"]


class ShardedRange(torch.utils.data.IterableDataset):
    """range(n) in ``shards`` shards (shard k: k, k + shards, ...), dealt to the loader's workers as Hugging Face's
    streams deal theirs (worker w reads shards w, w + workers, ...). Its state is the position in this worker's
    shards; ``reads`` counts the samples read in every worker process (forked loader workers share it)."""

    def __init__(self, n: int, shards: int = 4) -> None:
        import multiprocessing

        self.n, self.shards, self.start = n, shards, None
        self.position = {"shard": 0, "index": 0}
        self.reads = multiprocessing.get_context("fork").Value("i", 0)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = [range(shard, self.n, self.shards) for shard in range(worker, self.shards, workers)]
        start, self.start = self.start or {"shard": 0, "index": 0}, None
        for shard in range(start["shard"], len(mine)):
            first = start["index"] if shard == start["shard"] else 0
            for index in range(first, len(mine[shard])):
                with self.reads.get_lock():
                    self.reads.value += 1
                self.position = {"shard": shard, "index": index + 1}
                yield mine[shard][index]

    def state_dict(self) -> dict:
        return dict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.start = dict(state)


def small_model(features: int = 8, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 1))


def loader(dataset, batch_size: int, *, shuffle: bool = True, seed: int = 1234, drop_last: bool = False) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=generator, drop_last=drop_last)


def train(
    accelerator,
    *,
    batch_size: int,
    epochs: int = 2,
    lr: float = 0.05,
    n: int = 64,
    scheduler: bool = False,
) -> dict[str, torch.Tensor]:
    """Train small_model on regression_data through ``accelerator``; return the final weights (CPU)."""
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    objects = [model, optimizer, loader(regression_data(n), batch_size)]
    if scheduler:
        objects.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5))
    prepared = accelerator.prepare(*objects)
    model, optimizer, train_loader = prepared[:3]
    for _ in range(epochs):
        for x, y in train_loader:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                if scheduler:
                    prepared[3].step()
                optimizer.zero_grad()
    return {k: v.detach().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}


def assert_state_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def indexed_regression_data(n: int = 60, features: int = 8, seed: int = 0) -> TensorDataset:
    """regression_data plus each sample's index, so a test can see which samples were used."""
    x, y = regression_data(n, features, seed).tensors
    return TensorDataset(x, y, torch.arange(n))


class AugmentedData(torch.utils.data.Dataset):
    """indexed_regression_data with random noise drawn in ``__getitem__``, from the global RNG."""

    def __init__(self, n: int) -> None:
        self.base = indexed_regression_data(n)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        x, y, i = self.base[index]
        return x + 0.1 * torch.rand(x.shape), y, i


def checkpointed_run(project_dir, **project_options):
    """An Accelerator that names and rotates its checkpoints (total_limit=2), with small_model, AdamW, a
    shuffled loader and a StepLR, prepared: ``accelerator, model, optimizer, loader, scheduler``."""
    from runner.engine import Accelerator, ProjectConfiguration

    project = ProjectConfiguration(project_dir, automatic_checkpoint_naming=True, total_limit=2, **project_options)
    accelerator = Accelerator(project_config=project)
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return accelerator, *accelerator.prepare(model, optimizer, loader(regression_data(), 4), scheduler)


def train_steps(accelerator, model, optimizer, train_loader, scheduler, count: int) -> None:
    """``count`` optimizer and scheduler steps of a :func:`checkpointed_run` on MSE."""
    for step, (x, y) in enumerate(train_loader):
        if step == count:
            break
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def resumable_run(
    project_dir,
    *,
    epochs: int = 3,
    n: int = 60,
    batch_size: int = 4,
    accumulation: int = 1,
    precision: str = "no",
    stop_after: int | None = None,
    resume: bool = False,
    augment: bool = False,
    num_workers: int = 0,
    fsdp: bool = False,
    seedable: bool = False,
) -> dict:
    """A plain engine script that trains with shuffling and dropout, optionally stopping after
    ``stop_after`` micro-steps (saving a checkpoint) or resuming from the newest checkpoint.

    Returns what a comparison needs: the sample ids each micro-step used, the losses, and (when it
    ran to the end) the final weights and optimizer state.
    """
    from runner.engine import (
        Accelerator,
        DataLoaderConfiguration,
        FullyShardedDataParallelPlugin,
        GradScalerKwargs,
        ProjectConfiguration,
    )
    from runner.engine.checkpoint.sharded_state import gather_full

    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable),
        gradient_accumulation_steps=accumulation,
        mixed_precision=precision,
        project_config=ProjectConfiguration(str(project_dir), automatic_checkpoint_naming=True),
        kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10, growth_interval=3)],
        fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"]) if fsdp else None,
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)
    if augment:  # random draws in the dataset, and no generator of the user's on the loader
        data = DataLoader(AugmentedData(n), batch_size=batch_size, shuffle=True, num_workers=num_workers)
    else:
        data = loader(indexed_regression_data(n), batch_size)
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    torch.manual_seed(1000 + accelerator.process_index)  # dropout streams differ per rank
    if resume:
        accelerator.load_state()
    seen, losses, micro_steps = [], [], 0
    while data.iteration < epochs:
        for x, y, ids in data:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            seen.append(ids.tolist())
            losses.append(loss.item())
            micro_steps += 1
            if micro_steps == stop_after:
                accelerator.save_state()
                return {"seen": seen, "losses": losses, "rank": accelerator.process_index}
    return {
        "seen": seen,
        "losses": losses,
        "rank": accelerator.process_index,
        "weights": {k: v.clone() for k, v in accelerator.get_state_dict(model).items()},
        # Under FSDP the full state, keyed by parameter name (every rank takes part in gathering it).
        "optimizer": gather_full([accelerator.unwrap_model(model)], [optimizer])[1][0]
        if fsdp
        else optimizer.state_dict(),
        "scale": accelerator.scaler.get_scale() if accelerator.scaler else None,
    }


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        for key, value in state.items():
            other = b["state"][index][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (index, key)


@contextlib.contextmanager
def http_mirror(folder, monkeypatch) -> Iterator[str]:
    """Serve ``folder`` on a local HTTP server (no proxies); yields its base URL, ``http://127.0.0.1:PORT/``."""
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    # urlopen reuses an opener whose proxies were read once; use one without proxies so only 127.0.0.1 is contacted.
    monkeypatch.setattr(urllib.request, "_opener", urllib.request.build_opener(urllib.request.ProxyHandler({})))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass
