"""Unary ops as CPU has them where OpInfo's samples don't look: ``out=`` tensors of other dtypes
(CPU's errors in CPU's words, or the cast values), and special values (infinities, NaN, the
exact zeros of lgamma, the edges of the incomplete gamma functions)."""

from __future__ import annotations

import math

import pytest
import torch

INF, NAN = math.inf, math.nan
DTYPES = [torch.bool, torch.uint8, torch.int64, torch.float16, torch.float32, torch.float64, torch.complex64]


def _outcome(fn, x, out):
    """("ok", values) or (exception type, message) of ``fn(x, out=out)``."""
    try:
        fn(x, out=out)
    except Exception as e:  # the comparison is the test
        return type(e), str(e)
    return "ok", out.cpu()


def _inputs(dtype):
    return torch.tensor([True, False, True]) if dtype is torch.bool else (torch.arange(3) - 1).to(dtype)


@pytest.mark.parametrize("name", ["abs", "angle", "neg", "sign", "floor", "round", "sqrt", "exp",
                                  "isposinf", "signbit", "nan_to_num", "bitwise_not", "conj_physical"])
def test_out_of_another_dtype_like_cpu(name):
    """Every (input dtype, out dtype) pair: CPU's exception type with CPU's message inside ours,
    or CPU's values cast to the out dtype."""
    fn = getattr(torch, name)
    for di in DTYPES:
        x = _inputs(di)
        try:
            fn(x)
        except Exception:  # no such op for this input dtype on CPU either
            continue
        for do in DTYPES:
            cpu = _outcome(fn, x, torch.empty(3, dtype=do))
            tpu = _outcome(fn, x.to("tpu"), torch.empty(3, dtype=do, device="tpu"))
            where = f"{name}({di}) out={do}"
            if cpu[0] == "ok":
                assert tpu[0] == "ok", f"{where}: {tpu}"
                torch.testing.assert_close(tpu[1], cpu[1], equal_nan=True, atol=1e-3, rtol=1e-3, msg=where)
            else:
                assert tpu[0] is cpu[0], f"{where}: {tpu} where CPU raised {cpu}"
                assert cpu[1] in tpu[1], where


def test_program_of_one_out_dtype_does_not_serve_another():
    """The same op and input with a uint8 ``out`` first, then an int64 one: the second gets
    int64 values, not the first's uint8 program (which wrapped -1 to 255)."""
    x = torch.tensor([-1, 0, 1], device="tpu")
    with pytest.raises(RuntimeError, match="Found dtype Byte but expected Long"):
        torch.neg(x, out=torch.empty(3, dtype=torch.uint8, device="tpu"))
    out = torch.empty(3, dtype=torch.int64, device="tpu")
    torch.neg(x, out=out)
    assert out.tolist() == [1, 0, -1]
    f32 = torch.empty(3, device="tpu")
    torch.sin(x, out=f32)
    f64 = torch.empty(3, dtype=torch.float64, device="tpu")
    torch.sin(x, out=f64)
    assert f64.dtype == torch.float64
    torch.testing.assert_close(f64.cpu(), torch.sin(x.cpu().double()), atol=1e-6, rtol=1e-6)


def test_complex_abs_into_a_wider_or_narrower_out():
    """CPU writes |z| of complex64 into float16 and float64 outs; the meta kernel alone refuses."""
    z = torch.tensor([3 + 4j, -1j, 0j], dtype=torch.complex64)
    for do in (torch.float16, torch.float64, torch.complex64):
        cpu = torch.abs(z, out=torch.empty(0, dtype=do))
        tpu = torch.abs(z.to("tpu"), out=torch.empty(0, dtype=do, device="tpu"))
        assert tpu.dtype == do
        torch.testing.assert_close(tpu.cpu(), cpu)
    with pytest.raises(RuntimeError, match="In-place abs is not supported for complex tensors"):
        z.to("tpu").abs_()
    with pytest.raises(RuntimeError, match="result type Float can't be cast to the desired output type Long"):
        torch.angle(z.to("tpu"), out=torch.empty(0, dtype=torch.long, device="tpu"))


def test_non_boolean_out_of_isposinf_and_frexp_dtypes():
    t = torch.tensor([INF, -INF, 1.2], device="tpu")
    for fn in (torch.isposinf, torch.isneginf):
        with pytest.raises(RuntimeError, match="does not support non-boolean outputs"):
            fn(t, out=torch.empty(3, device="tpu"))
    x = torch.randn(4, 4, device="tpu")
    with pytest.raises(RuntimeError, match=r"torch\.frexp\(\) expects mantissa to have dtype"):
        torch.frexp(x, out=(torch.empty_like(x, dtype=torch.float64), torch.empty_like(x, dtype=torch.int)))
    with pytest.raises(RuntimeError, match=r"torch\.frexp\(\) expects exponent to have int dtype"):
        torch.frexp(x, out=(torch.empty_like(x), torch.empty_like(x, dtype=torch.int64)))


_PARTS = [INF, -INF, NAN, 0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 1.5707964, -1.5707964, 1e30]


@pytest.mark.parametrize("name", ["exp", "exp2", "abs", "sqrt", "rsqrt", "reciprocal", "sigmoid", "atan", "atanh",
                                  "asinh"])
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_special_values(name, dtype):
    """Every pair of parts from infinities, NaN, zero and a few finite numbers: C99's values as
    CPU gives them (no inf * NaN in exp, hypot's inf in abs, Smith division's NaNs in 1/z)."""
    t = torch.tensor([complex(a, b) for a in _PARTS for b in _PARTS], dtype=dtype)
    fn = getattr(torch, name)
    torch.testing.assert_close(fn(t.to("tpu")).cpu(), fn(t), equal_nan=True, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_igamma_igammac_edges(dtype):
    """a = 0, x = 0, infinite a or x, negative and NaN arguments: CPU's values, not XLA's NaNs."""
    a = torch.tensor([0, 0, 0, 1e-3, 1, INF, INF, INF, INF, 0, -1, 2, NAN, 1, 3], dtype=dtype)
    x = torch.tensor([1e-3, 1, INF, 0, 0, 0, 1, 1e3, INF, 0, 1, -1, 1, NAN, 2.5], dtype=dtype)
    for fn in (torch.igamma, torch.igammac):
        torch.testing.assert_close(fn(a.to("tpu"), x.to("tpu")).cpu(), fn(a, x), equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_lgamma_exact_zeros(dtype):
    x = torch.tensor([1, 2, 3, -1, 0], dtype=dtype)
    got = torch.lgamma(x.to("tpu")).cpu()
    torch.testing.assert_close(got, torch.lgamma(x))
    assert got[0].item() == 0.0 and got[1].item() == 0.0


@pytest.mark.parametrize("name", ["tanh", "sigmoid"])
def test_complex_backward_takes_the_conjugate_like_cpu(name):
    """The dedicated backward kernels of tanh and sigmoid, and autograd through them, on complex
    inputs: CPU multiplies the incoming gradient by the derivative's conjugate (PyTorch's
    convention for complex gradients), which a real-only formula silently leaves out."""
    from conftest import like_cpu

    g0 = torch.randn(2, 1, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(0))
    x0 = torch.randn(2, 1, 3, dtype=torch.complex128, generator=torch.Generator().manual_seed(1))
    backward = getattr(torch.ops.aten, f"{name}_backward")
    like_cpu(lambda g, x: backward(g, getattr(torch, name)(x)), g0, x0)

    def grad(g, x):
        x = x.clone().requires_grad_()
        return torch.autograd.grad(getattr(torch, name)(x), x, g)[0]

    like_cpu(grad, g0, x0)
