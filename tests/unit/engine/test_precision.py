import warnings

import pytest
import torch
from torch import nn

from runner.engine import Accelerator, GradScalerKwargs, precision
from runner.engine.precision import Fp16OnCpuWarning, PrecisionType, warn_if_fp16_on_cpu
from tests.helpers import loader, regression_data, small_model


def _losses(accelerator, epochs=15):
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader(regression_data(), 8))
    losses = []
    for _ in range(epochs):
        total = 0.0
        for x, y in data:
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
        losses.append(total / len(data))
    return losses, model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_reduces_the_loss_with_fp32_master_weights(precision):
    losses, model = _losses(Accelerator(mixed_precision=precision))
    assert losses[-1] < 0.3 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize(("precision", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_forward_runs_under_autocast_and_returns_fp32(precision, dtype):
    accelerator = Accelerator(mixed_precision=precision)
    seen = []
    model = accelerator.prepare(nn.Sequential(nn.Linear(4, 4)))
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    assert model(torch.randn(2, 4)).dtype == torch.float32
    assert seen == [dtype]
    with accelerator.autocast():
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == dtype
    assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float32


def fp16_accelerator() -> Accelerator:
    # torch's default initial scale (65536) overflows fp16 on the first steps by design; start lower
    # so that only the deliberately infinite loss below skips a step.
    return Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])


def test_fp16_skips_the_step_on_an_inf_loss_and_the_scheduler_does_not_advance():
    accelerator = fp16_accelerator()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    x = torch.randn(8, 4)

    before = [p.detach().clone() for p in model.parameters()]
    scale = accelerator.scaler.get_scale()
    accelerator.backward(model(x).sum() * float("inf"))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    assert optimizer.step_was_skipped and accelerator.optimizer_step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scheduler.get_last_lr() == [0.1] and scheduler.last_epoch == 0
    assert accelerator.scaler.get_scale() == scale / 2

    accelerator.backward(model(x).sum())
    optimizer.step()
    scheduler.step()
    assert not optimizer.step_was_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scheduler.get_last_lr() == [0.05]


def test_clip_grad_norm_unscales_first_under_fp16():
    def grads_after_clip(precision):
        accelerator = fp16_accelerator() if precision == "fp16" else Accelerator()
        model = nn.Linear(4, 1)
        torch.nn.init.constant_(model.weight, 0.5)
        optimizer = accelerator.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        model = accelerator.prepare_model(model)
        accelerator.backward(model(torch.ones(2, 4)).sum())
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)
        accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0)  # a second clip must not unscale twice
        optimizer.step()
        return norm, torch.cat([model.weight.grad.flatten(), model.bias.grad])

    norm_fp32, grad_fp32 = grads_after_clip("no")
    norm_fp16, grad_fp16 = grads_after_clip("fp16")
    assert norm_fp32.item() == pytest.approx(5.0**0.5 * 2, rel=1e-6)  # |(2, 2, 2, 2, 2)| before clipping
    assert norm_fp16.item() == pytest.approx(norm_fp32.item(), rel=1e-3)
    torch.testing.assert_close(grad_fp16, grad_fp32, rtol=1e-3, atol=1e-4)
    assert grad_fp32.norm().item() == pytest.approx(1.0, rel=1e-5)  # clipped to max_norm


def test_clip_grad_value_unscales_first_under_fp16():
    accelerator = fp16_accelerator()
    model = nn.Linear(2, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.full((1, 2), 3.0)).sum())
    accelerator.clip_grad_value_(model.parameters(), 0.5)
    assert model.weight.grad.tolist() == [[0.5, 0.5]] and model.bias.grad.tolist() == [0.5]


def test_bad_precision_values_are_rejected_in_one_sentence():
    with pytest.raises(ValueError, match=r"mixed_precision='fp17' is not supported; use one of 'no', 'fp16'"):
        Accelerator(mixed_precision="fp17")
    with pytest.raises(ValueError, match=r"mixed_precision='fp8' needs an NVIDIA GPU of compute capability 8.9"):
        Accelerator(mixed_precision="fp8")


def test_fp16_refuses_parameters_that_are_already_fp16():
    accelerator = Accelerator(mixed_precision="fp16")
    with pytest.raises(
        ValueError,
        match=r"parameter 'weight' is already fp16 \(the loss scaler would fail with 'Attempting to unscale FP16 "
        r"gradients'\); build the model in fp32",
    ):
        accelerator.prepare(nn.Linear(2, 2).half())


@pytest.mark.parametrize("build_scheduler_first", [True, False])
def test_fp16_optimizer_wrapping_keeps_torchs_scheduler_order_check_quiet(build_scheduler_first, recwarn):
    accelerator = fp16_accelerator()
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if build_scheduler_first:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
        scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1))
    accelerator.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
    scheduler.step()
    assert not optimizer.step_was_skipped
    assert [str(w.message)[:40] for w in recwarn if "lr_scheduler" in str(w.message)] == []


@pytest.fixture
def fp16_on_cpu_not_yet_warned():
    """Forget that this process warned about fp16 on the CPU, before and after the test."""
    precision._warn_fp16_on_cpu.cache_clear()
    yield
    precision._warn_fp16_on_cpu.cache_clear()


def _fp16_on_cpu_warnings(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the once-per-process rule must hold without help from the filters
        build()
    return [w for w in caught if issubclass(w.category, Fp16OnCpuWarning)]


def test_fp16_on_the_cpu_warns_once_per_process_at_the_callers_line(fp16_on_cpu_not_yet_warned):
    def build_two():
        Accelerator(mixed_precision="fp16", cpu=True)
        Accelerator(mixed_precision="fp16", cpu=True)

    caught = _fp16_on_cpu_warnings(build_two)
    assert [str(w.message) for w in caught] == [
        "mixed_precision='fp16' on the CPU runs torch's slow CPU fp16 kernels (convolution backward above all), "
        "about 40-100x slower than fp32 for a small CNN; use mixed_precision='bf16' or 'no' on the CPU, "
        "or train in fp16 on a GPU."
    ]
    assert caught[0].filename == __file__  # the line that built the first Accelerator, not the engine's
    assert _fp16_on_cpu_warnings(lambda: Accelerator(mixed_precision="fp16", cpu=True)) == []  # a third, later


@pytest.mark.parametrize("mixed_precision", ["bf16", "no"])
def test_other_precisions_on_the_cpu_do_not_warn(fp16_on_cpu_not_yet_warned, mixed_precision):
    assert _fp16_on_cpu_warnings(lambda: Accelerator(mixed_precision=mixed_precision)) == []


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "mps"])
def test_fp16_on_an_accelerator_device_does_not_warn(fp16_on_cpu_not_yet_warned, device):
    assert _fp16_on_cpu_warnings(lambda: warn_if_fp16_on_cpu(PrecisionType.FP16, torch.device(device))) == []
    caught = _fp16_on_cpu_warnings(lambda: warn_if_fp16_on_cpu(PrecisionType.FP16, torch.device("cpu")))
    assert len(caught) == 1  # the same helper, on the CPU


# /proc/cpuinfo's flags lines: an AVX2 CPU without bf16 (the machine of the 4x slower GPT run), this kind of AVX-512
# server with avx512_bf16, a Sapphire Rapids with AMX, an Arm server with BF16.
AVX2 = "processor : 0\nflags : fpu vme sse sse2 avx avx2 fma f16c bmi2\n"
AVX512_BF16 = "processor : 0\nflags : fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16\n"
AMX = "processor : 0\nflags : fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
ARM = "processor : 0\nFeatures : fp asimd evtstrm aes sha2 crc32 atomics fphp asimdhp bf16 i8mm\n"


@pytest.mark.parametrize(("cpuinfo", "has"), [(AVX2, False), (AVX512_BF16, True), (AMX, True), (ARM, True), ("", None)])
def test_bf16_instructions_are_read_from_the_cpus_flags(cpuinfo, has):
    assert precision.cpu_has_bf16(cpuinfo) is has


def test_bf16_on_a_cpu_without_bf16_instructions_warns_once_per_process(monkeypatch):
    precision._warn_bf16_on_cpu.cache_clear()
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)  # the AVX2 CPU above; this machine may have them

    def build_two():
        Accelerator(mixed_precision="bf16", cpu=True)
        Accelerator(mixed_precision="bf16", cpu=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_two()
    found = [w for w in caught if issubclass(w.category, precision.Bf16OnCpuWarning)]
    assert [str(w.message) for w in found] == [precision.BF16_ON_CPU_WARNING] and found[0].filename == __file__
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)
    precision._warn_bf16_on_cpu.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Accelerator(mixed_precision="bf16", cpu=True)
    assert not [w for w in caught if issubclass(w.category, precision.Bf16OnCpuWarning)]
    precision._warn_bf16_on_cpu.cache_clear()
