"""runner/engine/numerics.py: oneMKL's vector-math kernels resolved once per process, before training."""

import pytest
import torch

from runner.engine import Accelerator, accelerator, distributed, numerics

pytestmark = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch was built without MKL")


def test_every_vector_math_function_is_called_once_on_one_element_of_each_float_type(monkeypatch):
    calls = []
    for name in numerics.VML_FUNCTIONS:
        function = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda t, f=function, n=name: calls.append((n, t.dtype, t.numel())) or f(t))
    monkeypatch.setattr(numerics, "_resolved", False)
    numerics.resolve_math_kernels()
    numerics.resolve_math_kernels()  # once per process
    wanted = [(n, d, 1) for d in (torch.float32, torch.float64) for n in numerics.VML_FUNCTIONS]
    assert calls == wanted
    assert len(numerics.VML_FUNCTIONS) == 22


def test_an_accelerator_resolves_them_before_it_sets_anything_up(monkeypatch):
    order = []
    monkeypatch.setattr(accelerator, "resolve_math_kernels", lambda: order.append("resolve"))
    real = distributed.read_environment
    monkeypatch.setattr(distributed, "read_environment", lambda **kw: order.append("environment") or real(**kw))
    Accelerator(cpu=True)
    assert order == ["resolve", "environment"]
