import pytest
import torch

from runner.engine.utils import find_executable_batch_size


def test_the_batch_size_shrinks_by_a_tenth_until_the_function_fits():
    tried = []

    @find_executable_batch_size(starting_batch_size=128)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > 20:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size * scale

    assert train(2) == 38
    assert tried == [128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19]


def test_a_real_cpu_allocation_failure_counts_as_out_of_memory():
    @find_executable_batch_size(starting_batch_size=16, reduce_batch_size_fn=lambda size: size // 2)
    def allocate(batch_size):
        # 2**62 bytes is beyond any address space: the CPU allocator refuses it at once.
        return torch.empty(2**62 if batch_size > 4 else batch_size, dtype=torch.uint8).numel()

    assert allocate() == 4


def test_other_errors_propagate_and_zero_means_nothing_fits():
    @find_executable_batch_size(starting_batch_size=8)
    def broken(batch_size):
        raise ValueError(f"bad config at {batch_size}")

    with pytest.raises(ValueError, match="bad config at 8"):
        broken()

    @find_executable_batch_size(starting_batch_size=4)
    def never_fits(batch_size):
        raise MemoryError

    with pytest.raises(RuntimeError, match=r"never_fits\(\) ran out of memory at every batch size down to 1"):
        never_fits()


def test_passing_the_batch_size_yourself_is_refused():
    @find_executable_batch_size
    def train(batch_size, lr):
        return batch_size, lr

    assert train(0.1) == (128, 0.1)
    with pytest.raises(TypeError, match=r"call train\(lr\) without it"):
        train(64, 0.1)
