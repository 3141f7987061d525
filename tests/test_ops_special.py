"""Bessel and Airy lowerings against CPU: values over the whole range, edge values, dtypes, errors."""

from __future__ import annotations

import pytest
import torch

import torch_tpu

DEV = "tpu"
NAMES = ["airy_ai", "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_k0", "modified_bessel_k1",
         "scaled_modified_bessel_k0", "scaled_modified_bessel_k1"]

# every branch of each approximation, their joins, and the edges CPU defines
GRID = torch.cat([
    torch.linspace(-40, 40, 4001),
    torch.logspace(-20, 3, 200),
    -torch.logspace(-20, 3, 200),
    torch.tensor([0.0, -0.0, 2.0, 3.0, 5.0, -5.0, float("inf"), float("-inf"), float("nan")]),
])


@pytest.fixture(autouse=True)
def _no_fallback():
    torch_tpu.reset_metrics()
    yield
    assert not torch_tpu.metrics()["fallback_counts"]


@pytest.mark.parametrize("name", NAMES)
def test_values_float32(name):
    f = getattr(torch.special, name)
    torch.testing.assert_close(f(GRID.to(DEV)).cpu(), f(GRID), rtol=1e-3, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("name", NAMES)
def test_values_float64(name):
    f = getattr(torch.special, name)
    x = GRID.double()
    # the approximations hold to ~1e-7 of the envelope; CPU's float64 airy_ai is itself off by 3e-6 near x = -2
    torch.testing.assert_close(f(x.to(DEV)).cpu(), f(x), rtol=1e-5, atol=5e-6, equal_nan=True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int64])
def test_integer_inputs(name, dtype):
    f = getattr(torch.special, name)
    x = torch.tensor([0, 1, 2, 3, 7]).to(dtype)
    torch.testing.assert_close(f(x.to(DEV)).cpu(), f(x), rtol=1e-3, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("name", NAMES)
def test_out_and_errors(name):
    f = getattr(torch.special, name)
    out = torch.empty(5, device=DEV)
    f(GRID[:5].to(DEV), out=out)
    torch.testing.assert_close(out.cpu(), f(GRID[:5]), rtol=1e-3, atol=1e-4, equal_nan=True)
    for dtype in (torch.float16, torch.bfloat16, torch.complex64):
        with pytest.raises(NotImplementedError, match=f'"{name}_cpu" not implemented'):
            f(torch.zeros(2, dtype=dtype, device=DEV))
    with pytest.raises(RuntimeError):
        f(torch.zeros(2, device=DEV), out=torch.empty(2, dtype=torch.int64, device=DEV))
