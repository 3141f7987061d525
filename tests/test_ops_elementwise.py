"""Pointwise lowerings against CPU: values, dtypes, promotion and error types."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_tpu

DEV = "tpu"


def _same(fn, *args, **kw):
    """Runs ``fn`` on CPU and on tpu copies of the tensor arguments and compares."""
    cpu = fn(*args, **kw)
    tpu = fn(*[a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args], **kw)
    if isinstance(cpu, tuple):
        for c, t in zip(cpu, tpu):
            torch.testing.assert_close(t.cpu(), c, equal_nan=True)
    else:
        torch.testing.assert_close(tpu.cpu(), cpu, equal_nan=True)


@pytest.fixture(autouse=True)
def _no_fallback():
    torch_tpu.reset_metrics()
    yield
    assert not torch_tpu.metrics()["fallback_counts"]


X = torch.tensor([-3.5, -2.5, -1.0, -0.0, 0.0, 0.4, 0.5, 1.5, 2.5, 7.0])
Y = torch.tensor([2.0, -1.5, 3.0, 1.0, -2.0, 0.0, 0.7, -4.0, 2.5, 3.0])
IA = torch.tensor([-7, -3, 0, 2, 5, 9], dtype=torch.int32)
IB = torch.tensor([2, -2, 3, 3, -4, 4], dtype=torch.int32)


@pytest.mark.parametrize("fn", [
    torch.add, torch.sub, torch.mul, torch.div, torch.remainder, torch.fmod, torch.atan2, torch.hypot,
    torch.copysign, torch.maximum, torch.minimum, torch.fmax, torch.fmin, torch.logaddexp, torch.xlogy,
    torch.eq, torch.lt, torch.ge, torch.nextafter, torch.floor_divide, torch.pow,
    lambda a, b: torch.div(a, b, rounding_mode="floor"), lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    lambda a, b: torch.add(a, b, alpha=2.5), lambda a, b: torch.lerp(a, b, 0.3),
    lambda a, b: torch.addcdiv(a, a, b, value=0.5), lambda a, b: torch.where(a > 0, a, b),
])
def test_binary_float(fn):
    _same(fn, X, Y)


@pytest.mark.parametrize("fn", [
    torch.add, torch.mul, torch.remainder, torch.floor_divide, torch.bitwise_and, torch.bitwise_xor,
    torch.bitwise_left_shift, torch.bitwise_right_shift, torch.div, torch.maximum, torch.ne,
    lambda a, b: torch.div(a, b, rounding_mode="trunc"), lambda a, b: a.abs() ** b.abs(),
])
def test_binary_int(fn):
    _same(fn, IA, IB)


def test_shifts_out_of_range_and_bitwise_not():
    a = torch.tensor([1, -8, 100], dtype=torch.int8)
    s = torch.tensor([9, 7, -1], dtype=torch.int8)
    _same(torch.bitwise_left_shift, a, s)
    _same(torch.bitwise_right_shift, a, s)
    _same(torch.bitwise_not, a)


def test_promotion_with_scalars_and_zero_dim():
    h = torch.tensor([1.0, 2.0009765625, 3.0], dtype=torch.float16)
    z = torch.tensor(2.0009765625, dtype=torch.float32)
    _same(torch.eq, h, z)  # compared in float16, as CPU does
    _same(lambda a: a * 2.5, IA)
    _same(lambda a: a + 3, IA.to(torch.int8))
    _same(lambda a: a / 2, IA)
    _same(lambda a: a.to(torch.bfloat16) * 0.1, X)


@pytest.mark.parametrize("exp", [2, 3, -1, 0.5, 2.0, -2.5, 0])
def test_pow_scalar(exp):
    _same(lambda a: a**exp, X.abs() + 0.5)


def test_pow_int_negative_raises():
    with pytest.raises(RuntimeError, match="Integers to negative integer powers"):
        IA.to(DEV) ** -2


@pytest.mark.parametrize("name", [
    "abs", "sign", "sgn", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt",
    "reciprocal", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "atanh",
    "erf", "erfc", "erfinv", "lgamma", "digamma", "i0", "sigmoid", "logit", "floor", "ceil", "round", "trunc",
    "frac", "nan_to_num", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "signbit", "neg", "deg2rad",
    "rad2deg", "sinc", "angle",
])
def test_unary(name):
    x = torch.cat([X / 8, torch.tensor([float("nan"), float("inf"), -float("inf")])])
    _same(getattr(torch, name), x)


def test_unary_int_and_bf16():
    _same(torch.exp, IA)
    _same(torch.sqrt, X.abs().to(torch.bfloat16))
    _same(torch.floor, IA)
    _same(lambda a: torch.round(a, decimals=2), X / 3)
    _same(lambda a: torch.round(a, decimals=-1), X * 30)


def test_special_functions():
    x = torch.linspace(0.1, 5, 9)
    for fn in (torch.special.i0e, torch.special.i1, torch.special.ndtri, torch.special.log_ndtr,
               torch.special.erfcx, torch.special.entr, torch.special.spherical_bessel_j0):
        _same(fn, x / 6 if fn is torch.special.ndtri else x)
    n = torch.tensor([0.0, 1, 2, 3, 5, 7, 9, 12, 3])
    xs = torch.tensor([0.3, -0.7, 1.0, -1.0, 0.0, 0.5, 0.9, -0.2, 2.0])
    for fn in (torch.special.chebyshev_polynomial_t, torch.special.chebyshev_polynomial_u,
               torch.special.chebyshev_polynomial_v, torch.special.chebyshev_polynomial_w,
               torch.special.hermite_polynomial_h, torch.special.hermite_polynomial_he,
               torch.special.laguerre_polynomial_l, torch.special.legendre_polynomial_p,
               torch.special.shifted_chebyshev_polynomial_t):
        _same(fn, xs, n)


def test_clamp_forms():
    _same(lambda a: torch.clamp(a, min=-1.0), X)
    _same(lambda a: torch.clamp(a, max=1.0), X)
    _same(lambda a: torch.clamp(a, 2.0, -2.0), X)  # min > max gives max
    _same(lambda a, lo: torch.clamp(a, lo, lo + 1), X, Y)
    _same(lambda a, lo: torch.clamp_min(a, lo), X, Y)


def test_masked_fill_fill_zero_clone():
    _same(lambda a: a.masked_fill(a > 0, 9.0), X)
    _same(lambda a, v: a.masked_fill(a > 0, v), X, torch.tensor(-1.0))
    _same(lambda a: a.clone().fill_(3.0), X)
    _same(lambda a: a.clone().zero_(), X)
    _same(lambda a: a.clone().add_(1.0).mul_(2), X)


@pytest.mark.parametrize("fn", [
    F.relu, F.gelu, lambda a: F.gelu(a, approximate="tanh"), F.silu, F.mish, F.elu, F.celu, F.selu,
    lambda a: F.leaky_relu(a, 0.2), F.hardtanh, F.hardsigmoid, F.hardswish, F.softplus, F.logsigmoid,
    lambda a: F.threshold(a, 0.5, -2.0), F.softshrink, F.hardshrink, torch.sigmoid, torch.tanh, F.relu6,
    lambda a: F.glu(a.reshape(2, 5).repeat(1, 2)),
])
def test_activation_forward_and_grad(fn):
    xc = (X + 0.1).requires_grad_()
    xt = (X + 0.1).to(DEV).requires_grad_()
    yc, yt = fn(xc), fn(xt)
    torch.testing.assert_close(yt.cpu(), yc)
    (gc,) = torch.autograd.grad(yc.sum(), xc)
    (gt,) = torch.autograd.grad((yt * torch.ones_like(yc).to(DEV)).sum(), xt)
    torch.testing.assert_close(gt.cpu(), gc)


def test_prelu_forward_and_grad():
    for dev in ("cpu", DEV):
        x = (X.reshape(5, 2) + 0.1).to(dev).requires_grad_()
        w = torch.tensor([0.25, -0.5]).to(dev).requires_grad_()
        y = F.prelu(x, w)
        gx, gw = torch.autograd.grad((y * torch.arange(10.0).reshape(5, 2).to(dev)).sum(), (x, w))
        if dev == "cpu":
            ref = (y.detach(), gx, gw)
        else:
            for a, b in zip((y, gx, gw), ref):
                torch.testing.assert_close(a.detach().cpu(), b)


def test_errors_match_cpu():
    with pytest.raises(RuntimeError):
        torch.add(torch.ones(3, device=DEV), torch.ones(4, device=DEV))
    with pytest.raises(RuntimeError):
        torch.ones(3, device=DEV, dtype=torch.int64).add_(torch.ones(3, device=DEV))  # float into int in place
    with pytest.raises(RuntimeError):
        torch.bitwise_and(torch.ones(3, device=DEV), torch.ones(3, device=DEV))
