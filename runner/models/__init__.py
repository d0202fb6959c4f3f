"""Small reference models: plain ``nn.Module``s that know nothing about how they are parallelised."""

from runner.models.cnn import MnistCNN

__all__ = ["MnistCNN"]
