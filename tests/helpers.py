"""Small models and data shared by the engine tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, features: int = 8, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    w = torch.randn(features, 1, generator=generator)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=generator))


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
    return {k: v.detach().cpu().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}


def assert_state_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
