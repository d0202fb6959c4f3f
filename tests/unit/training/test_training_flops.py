"""Model FLOPs utilisation: the GPU peak table and the arithmetic the language-model recipe logs."""

import pytest
import torch

from runner.training.loop import model_flops_utilization, peak_bf16_flops


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla T4", None),
    ],
)
def test_peak_bf16_flops_by_gpu_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_bf16_flops(torch.device("cuda", 0)) == peak


def test_no_peak_and_so_no_mfu_on_the_cpu():
    assert peak_bf16_flops(torch.device("cpu")) is None


def test_mfu_is_achieved_over_peak_flops_of_all_devices():
    # 2 GPUs together at 400k tokens/s of a 1 GFLOP/token model: 4e14 FLOP/s of 2 x 1e15 peak.
    assert model_flops_utilization(4e5, flops_per_token=1e9, peak_flops=1e15, devices=2) == pytest.approx(0.2)
