"""A small convolutional network for 28x28 single-channel images."""

from __future__ import annotations

import torch
from torch import nn

from runner.models.checks import check_dropout, check_sizes


class MnistCNN(nn.Module):
    """conv(3x3) -> conv(3x3) -> max-pool -> dropout -> linear -> dropout -> linear to 10 classes.

    Args:
        channels: Channels of the first convolution (the second has twice as many).
        hidden: Width of the hidden linear layer.
        dropout: Dropout probability after pooling and after the hidden layer.
        num_classes: Output classes.
    """

    def __init__(self, channels: int = 32, hidden: int = 128, dropout: float = 0.25, num_classes: int = 10) -> None:
        super().__init__()
        check_sizes(channels=channels, hidden=hidden, num_classes=num_classes)
        check_dropout(dropout)
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Dropout(dropout),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(2 * channels * 12 * 12, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))
