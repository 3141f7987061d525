"""Reduction, scan, softmax and sort lowerings against CPU."""

from __future__ import annotations

import pytest
import torch

import torch_tpu

DEV = "tpu"


def _same(fn, *args):
    cpu = fn(*args)
    tpu = fn(*[a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args])
    cpu = cpu if isinstance(cpu, tuple) else (cpu,)
    tpu = tpu if isinstance(tpu, tuple) else (tpu,)
    for c, t in zip(cpu, tpu):
        torch.testing.assert_close(t.cpu(), c, equal_nan=True)


@pytest.fixture(autouse=True)
def _no_fallback():
    torch_tpu.reset_metrics()
    yield
    assert not torch_tpu.metrics()["fallback_counts"]


torch.manual_seed(0)
A = torch.randn(4, 5, 6)
N = torch.tensor([[1.0, float("nan"), 3.0, -2.0], [4.0, 4.0, -1.0, 0.5], [2.0, 2.0, 2.0, 7.0]])
INT = torch.randint(-5, 5, (3, 7))
T = torch.tensor([[3.0, 1.0, 3.0, 2.0, 1.0, 3.0], [0.0, -0.0, 5.0, 5.0, -1.0, 0.0]])


@pytest.mark.parametrize("fn", [
    lambda a: a.sum(), lambda a: a.sum((0, 2)), lambda a: a.sum(1, keepdim=True), lambda a: a.mean(-1),
    lambda a: a.prod(1), lambda a: a.amax((0, 1)), lambda a: a.amin(), lambda a: a.max(), lambda a: a.max(1),
    lambda a: a.min(2, keepdim=True), lambda a: a.argmax(), lambda a: a.argmin(1), lambda a: a.aminmax(dim=0),
    lambda a: a.var(1), lambda a: a.std((0, 2), correction=0), lambda a: torch.var_mean(a, 1, keepdim=True),
    lambda a: torch.std_mean(a, correction=2), lambda a: a.logsumexp(1), lambda a: a.norm(),
    lambda a: torch.linalg.vector_norm(a, float("inf"), dim=1), lambda a: torch.linalg.vector_norm(a, 0),
    lambda a: torch.linalg.vector_norm(a, 3.5, dim=(0, 1)), lambda a: torch.linalg.vector_norm(a, 1),
    lambda a: a.norm(p=-float("inf"), dim=2), lambda a: a.cumsum(1), lambda a: a.cumprod(2),
    lambda a: a.cummax(1), lambda a: a.cummin(0), lambda a: a.logcumsumexp(2), lambda a: a.softmax(1),
    lambda a: a.log_softmax(-1), lambda a: a.sort(1), lambda a: a.sort(1, descending=True),
    lambda a: a.topk(3, 2), lambda a: a.topk(2, 0, largest=False), lambda a: a.kthvalue(2, 1),
    lambda a: a.median(), lambda a: a.median(1), lambda a: a.nanmedian(2), lambda a: (a > 0).all(1),
    lambda a: (a > 0).any(), lambda a: a.count_nonzero(1), lambda a: a.nansum(1), lambda a: a.argsort(0),
])
def test_float(fn):
    _same(fn, A)


@pytest.mark.parametrize("fn", [
    lambda a: a.max(1), lambda a: a.min(1), lambda a: a.argmax(1), lambda a: a.median(1), lambda a: a.nanmedian(1),
    lambda a: a.nanmedian(), lambda a: a.median(), lambda a: a.cummax(1), lambda a: a.cummin(1),
    lambda a: a.sort(1), lambda a: a.sort(1, descending=True), lambda a: a.topk(2).values, lambda a: a.nansum(),
    lambda a: a.amax(1), lambda a: a.logsumexp(1),
])
def test_nan(fn):
    _same(fn, N)


@pytest.mark.parametrize("fn", [
    lambda a: a.sum(), lambda a: a.sum(1, dtype=torch.float64), lambda a: a.prod(1), lambda a: a.cumsum(0),
    lambda a: a.max(1), lambda a: a.sort(dim=1, stable=True), lambda a: a.mode(1), lambda a: a.count_nonzero(),
    lambda a: a.to(torch.uint8).sum(), lambda a: a.bool().all(), lambda a: a.median(1), lambda a: a.cummax(1),
])
def test_int(fn):
    _same(fn, INT)


def test_stable_sort_ties_and_signed_zero():
    _same(lambda a: a.sort(dim=1, stable=True), T)
    _same(lambda a: a.sort(dim=1, stable=True, descending=True), T)
    _same(lambda a: a.cummax(1), T)
    _same(lambda a: a.mode(1), T)


def test_low_precision_accumulates_in_float32():
    x = torch.full((4096,), 0.01, dtype=torch.bfloat16)
    _same(lambda a: a.sum(), x)
    _same(lambda a: a.mean(), x)
    _same(lambda a: a.cumsum(0), x)
    _same(lambda a: a.softmax(0), x)


def test_zero_dim_and_empty():
    s = torch.tensor(2.5)
    for fn in (lambda a: a.sum(0), lambda a: a.max(0), lambda a: a.cumsum(0), lambda a: a.softmax(0),
               lambda a: a.sort(0), lambda a: a.argmax(0), lambda a: a.logsumexp(0)):
        _same(fn, s)
    e = torch.empty(0, 3)
    _same(lambda a: a.sum(0), e)
    _same(lambda a: a.mean(), e)
    _same(lambda a: a.prod(1), e)
    _same(lambda a: (a > 0).all(0), e)


def test_softmax_backward():
    xc = A.clone().requires_grad_()
    xt = A.to(DEV).requires_grad_()
    w = torch.arange(A.numel()).reshape(A.shape).float()
    for f in (lambda a: a.softmax(1), lambda a: a.log_softmax(2)):
        (gc,) = torch.autograd.grad((f(xc) * w).sum(), xc)
        (gt,) = torch.autograd.grad((f(xt) * w.to(DEV)).sum(), xt)
        torch.testing.assert_close(gt.cpu(), gc)


def test_errors():
    with pytest.raises(RuntimeError):
        torch.ones(3, device=DEV).kthvalue(5)
    with pytest.raises(RuntimeError):
        torch.ones(3, device=DEV).topk(5)
    with pytest.raises(IndexError):
        torch.ones(3, device=DEV).sum(3)
    with pytest.raises(RuntimeError):
        torch.ones(3, device=DEV, dtype=torch.int64).mean()
