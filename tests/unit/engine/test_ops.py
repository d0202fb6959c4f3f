"""ops on one process: copy_tensor_to_devices returns a copy, and refuses nothing to copy."""

import pytest
import torch

from runner.engine.utils import copy_tensor_to_devices


def test_copy_tensor_to_devices_on_one_process_returns_a_copy():
    tensor = torch.arange(6.0).reshape(2, 3)
    copy = copy_tensor_to_devices(tensor)
    assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()


def test_copy_tensor_to_devices_needs_a_tensor_somewhere():
    with pytest.raises(ValueError, match="got None on the only process"):
        copy_tensor_to_devices(None)
