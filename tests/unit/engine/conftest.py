"""Fixtures of the engine's unit tests."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone (a DeviceMesh needs one), destroyed after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
