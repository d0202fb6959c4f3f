"""Fixtures of the engine's unit tests."""

import gc

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
        # A DeviceMesh keeps the group in reference cycles. Left to the garbage collector, the group could be
        # destroyed in a process a later test forks from this one (a DataLoader worker), where its gloo threads
        # were never started: the destructor aborts that worker ("std::system_error: Invalid argument").
        gc.collect()
