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


def _assert_topk_as_cpu(cpu, tpu):
    """Indices exactly, values with NaN and the sign of zero (CPU returns the picked element)."""
    torch.testing.assert_close(tpu.indices.cpu(), cpu.indices, rtol=0, atol=0)
    torch.testing.assert_close(tpu.values.cpu(), cpu.values, rtol=0, atol=0, equal_nan=True)
    if cpu.values.is_floating_point():
        assert torch.equal(torch.signbit(tpu.values.cpu()), torch.signbit(cpu.values))


def test_topk_of_equal_values_gives_cpus_indices_in_the_issues_example():
    """CPU's topk selects with std::nth_element, which is not stable: of two equal 5s it returns
    the later one first. A stable sort would give [0, 1]."""
    x = torch.tensor([5.0, 5.0, 0.0, -1.0])
    _assert_topk_as_cpu(torch.topk(x, 2), torch.topk(x.to(DEV), 2))
    assert torch.topk(x.to(DEV), 2).indices.tolist() == [1, 0]


@pytest.mark.parametrize(("n", "k"), [(5, 3), (70, 20), (130, 2), (33, 33)])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_among_equal_values_picks_cpus_elements_in_cpus_order(n, k, largest):
    """Rows drawn from three values (one of them NaN, and zeros of both signs), so that ties decide
    which elements are picked at the k-th place and their order. The sizes take both of CPU's
    paths: nth_element then sort (k * 64 > n), and partial_sort (k * 64 <= n)."""
    g = torch.Generator().manual_seed(n * 1000 + k)
    a = torch.randint(0, 3, (6, n), generator=g).float()
    a[a == 2] = float("nan")
    a[1][a[1] == 0] = -0.0
    a[2, ::3] = -0.0
    a[3] = torch.randint(0, 2, (n,), generator=g).float()  # no NaN: two values only
    for x in (a, a[:3].to(torch.bfloat16).nan_to_num(7.0), a[3:].nan_to_num(5.0).to(torch.int64)):
        _assert_topk_as_cpu(torch.topk(x, k, largest=largest), torch.topk(x.to(DEV), k, largest=largest))


def test_topk_ties_along_another_dim_and_in_graphs():
    """The same choice along dim 0 of a 3-d tensor, unsorted (CPU's elements, in sorted order), and
    in fused mode and a compiled graph, which serve topk from the same lowering."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (9, 2, 3), generator=g).float()
    _assert_topk_as_cpu(torch.topk(x, 4, dim=0), torch.topk(x.to(DEV), 4, dim=0))
    cpu, tpu = torch.topk(x, 4, dim=0, sorted=False), torch.topk(x.to(DEV), 4, dim=0, sorted=False)
    c, t = cpu.indices.sort(0).values, tpu.indices.cpu().sort(0).values
    torch.testing.assert_close(t, c, rtol=0, atol=0)  # the same elements
    with torch_tpu.set_eager_mode("fused"):
        _assert_topk_as_cpu(torch.topk(x, 2, dim=2), torch.topk(x.to(DEV), 2, dim=2))
    compiled = torch.compile(lambda t: torch.topk(t * 1, 5, dim=0), backend="tpu")
    _assert_topk_as_cpu(torch.topk(x, 5, dim=0), compiled(x.to(DEV)))


# Inputs made by McIlroy's adversary ("A killer adversary for quicksort") run against libstdc++'s
# algorithms, then halved so that equal values make the fallbacks' order visible: they exhaust
# the depth limits, so the replay's heap fallbacks run and decide the order of ties.
_SELECT_KILLER = [7, 0, 8, 1, 8, 2, 15, 3, 15, 4, 15, 5, 15, 6, 15, 0, 1, 2, 3, 4, 5, 6, 7, *[15] * 7]
_SORT_KILLER = [
    14, 0, 9, 1, 17, 2, 16, 3, 15, 4, 16, 5, 17, 6, 15, 7, 18, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 14, 13, 13, 12, 12,
    11, 11, 10, 10,
]


def test_topk_ties_past_the_depth_limits_take_cpus_heap_fallbacks():
    """introselect's heap_select fallback through topk; introsort's heapsort through the replayed
    std::sort alone, against CPU's ``sort(stable=False)``, which is std::sort on (value, index)."""
    import jax
    import jax.numpy as jnp

    from torch_tpu.ops import tie_order

    x = torch.tensor(_SELECT_KILLER)
    _assert_topk_as_cpu(torch.topk(x, 18, largest=False), torch.topk(x.to(DEV), 18, largest=False))
    n = len(_SORT_KILLER)
    packed = (jnp.asarray(_SORT_KILLER, jnp.int64) << 32) | jnp.arange(n, dtype=jnp.int64)
    replayed = jax.jit(lambda a: tie_order._sort(a, n))(packed) & 0xFFFFFFFF
    assert [int(i) for i in replayed] == torch.sort(torch.tensor(_SORT_KILLER), stable=False).indices.tolist()


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
