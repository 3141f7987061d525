"""FFT lowerings and complex-number support against CPU: values, dtypes, gradients, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import cpu_error

import torch_tpu

DEV = "tpu"
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _no_fallback():
    torch_tpu.reset_metrics()
    yield
    assert not torch_tpu.metrics()["fallback_counts"]


def _tpu(x):
    return x.to(DEV) if isinstance(x, torch.Tensor) else x


def _same(fn, *args, **kw):
    cpu = fn(*args, **kw)
    tpu = fn(*[_tpu(a) for a in args], **kw)
    assert tpu.device.type == DEV
    torch.testing.assert_close(tpu.cpu(), cpu, rtol=1e-4, atol=1e-5, equal_nan=True)


R = torch.randn(4, 6, 5)
Z = torch.randn(4, 6, 5, dtype=torch.complex64)


# ------------------------------------------------------------------------------- ATen primitives
@pytest.mark.parametrize("norm", [0, 1, 2])
@pytest.mark.parametrize("onesided", [True, False])
def test_fft_r2c(norm, onesided):
    _same(lambda x: aten._fft_r2c(x, [0, 2], norm, onesided), R)


@pytest.mark.parametrize("norm", [0, 1, 2])
@pytest.mark.parametrize("forward", [True, False])
def test_fft_c2c(norm, forward):
    _same(lambda x: aten._fft_c2c(x, [1, 2], norm, forward), Z)


@pytest.mark.parametrize("norm", [0, 1, 2])
@pytest.mark.parametrize("last", [8, 9])
def test_fft_c2r(norm, last):
    _same(lambda x: aten._fft_c2r(x, [0, 2], norm, last), Z)


# ---------------------------------------------------------------------------------- torch.fft.*
@pytest.mark.parametrize("name", ["fft", "ifft", "rfft", "ihfft"])
@pytest.mark.parametrize("norm", [None, "ortho", "forward"])
def test_fft_1d_real(name, norm):
    _same(lambda x: getattr(torch.fft, name)(x, n=7, dim=1, norm=norm), R)


@pytest.mark.parametrize("name", ["fft", "ifft", "irfft", "hfft"])
def test_fft_1d_complex(name):
    _same(lambda x: getattr(torch.fft, name)(x, dim=0), Z)


@pytest.mark.parametrize("name", ["fft2", "ifft2", "rfft2", "irfft2", "hfft2", "ihfft2", "fftn", "ifftn", "rfftn",
                                  "irfftn", "hfftn", "ihfftn"])
def test_fft_nd(name):
    x = R if name.startswith(("rfft", "ihfft")) else Z
    _same(lambda x: getattr(torch.fft, name)(x, s=(4, 6), dim=(0, 1)), x)


def test_fft_float64():
    x = torch.randn(16, dtype=torch.float64)
    _same(torch.fft.rfft, x)
    _same(torch.fft.irfft, torch.fft.rfft(x))


def test_fft_out():
    x = torch.randn(8)
    out = torch.zeros(5, dtype=torch.complex64, device=DEV)
    torch.fft.rfft(x.to(DEV), out=out)
    torch.testing.assert_close(out.cpu(), torch.fft.rfft(x))


@pytest.mark.parametrize("name", ["fft", "rfft", "irfft", "hfft", "ihfft", "fft2", "irfftn"])
def test_fft_grad(name):
    x = R if name in ("rfft", "ihfft") else Z
    cpu = x.clone().requires_grad_()
    tpu = x.to(DEV).requires_grad_()
    (gc,) = torch.autograd.grad(torch.view_as_real(getattr(torch.fft, name)(cpu) * 1j).sum() if name not in (
        "irfft", "hfft", "irfftn") else getattr(torch.fft, name)(cpu).square().sum(), cpu)
    (gt,) = torch.autograd.grad(torch.view_as_real(getattr(torch.fft, name)(tpu) * 1j).sum() if name not in (
        "irfft", "hfft", "irfftn") else getattr(torch.fft, name)(tpu).square().sum(), tpu)
    torch.testing.assert_close(gt.cpu(), gc, rtol=1e-4, atol=1e-4)


def test_fft_errors():
    cases = [
        (torch.fft.fft, torch.zeros(4, dtype=torch.float16), "Unsupported dtype Half"),
        (torch.fft.rfft, torch.zeros(4, dtype=torch.complex64), "real input"),
        (torch.fft.fft, torch.zeros(0), "Invalid number of data points"),
    ]
    for fn, x, message in cases:
        with pytest.raises(cpu_error(fn, x), match=message):
            fn(x.to(DEV))


# ------------------------------------------------------------------------------------- complex
def test_view_as_real_and_complex():
    _same(torch.view_as_real, Z)
    _same(torch.view_as_complex, R[..., :2].contiguous())
    _same(lambda z: torch.view_as_complex(torch.view_as_real(z) * 2), Z)
    with pytest.raises(cpu_error(torch.view_as_complex, R), match="last dimension of size 2"):
        torch.view_as_complex(R.to(DEV))
    with pytest.raises(cpu_error(torch.view_as_real, R), match="complex"):
        torch.view_as_real(R.to(DEV))


def test_real_imag_conj():
    _same(lambda z: z.real, Z)
    _same(lambda z: z.imag, Z)
    _same(lambda z: z.conj(), Z)
    _same(lambda z: z.conj() * z + 1, Z)
    _same(lambda z: z.conj().imag, Z)
    _same(lambda z: z.mH @ z, Z[:, :, 0])
    _same(torch.conj_physical, Z)
    _same(lambda z: z.clone().conj_physical_(), Z)
    _same(lambda z: torch.conj_physical(z, out=torch.empty_like(z)), Z)


def test_complex_polar_angle():
    a, b = torch.rand(3, 1), torch.randn(4)
    _same(torch.complex, a, b)
    _same(torch.polar, a, b)
    _same(torch.complex, a.double(), b.double().expand(3, 4))
    _same(torch.angle, Z)
    _same(torch.abs, Z)
    with pytest.raises(RuntimeError):
        torch.complex(a.to(DEV), b.double().to(DEV))


def test_complex_grads():
    def f(z):
        return (z * z.conj()).real.sum() + torch.view_as_real(z.exp()).sum() + z.abs().sum() + z.angle().sum()

    zc = Z.clone().requires_grad_()
    zt = Z.to(DEV).requires_grad_()
    (gc,) = torch.autograd.grad(f(zc), zc)
    (gt,) = torch.autograd.grad(f(zt), zt)
    torch.testing.assert_close(gt.cpu(), gc, rtol=1e-4, atol=1e-4)

    a, b = torch.rand(5).requires_grad_(), torch.randn(5).requires_grad_()
    ta, tb = a.detach().to(DEV).requires_grad_(), b.detach().to(DEV).requires_grad_()
    gc = torch.autograd.grad(torch.view_as_real(torch.polar(a, b) * (1 + 2j)).sum(), (a, b))
    gt = torch.autograd.grad(torch.view_as_real(torch.polar(ta, tb) * (1 + 2j)).sum(), (ta, tb))
    for x, y in zip(gt, gc):
        torch.testing.assert_close(x.cpu(), y)


def test_writes_through_real_views():
    z, cpu = Z.to(DEV), Z.clone()
    for x in (z, cpu):
        x.real.zero_()
        x.imag[1:, ::2] = 5
    torch.testing.assert_close(z.cpu(), cpu)
