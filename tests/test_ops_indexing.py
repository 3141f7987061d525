"""Indexing ops against CPU: advanced indexing, gather/scatter, index_*, masked ops, and the
errors for out-of-range indices (XLA would clamp them silently)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same

import torch_tpu


def pair(*shape, dtype=torch.float32):
    c = torch.randn(*shape).to(dtype)
    return c, c.clone().to("tpu")


def tpu(x):
    return x.to("tpu") if isinstance(x, torch.Tensor) else x


def test_advanced_indexing_reads():
    c, t = pair(4, 5, 6)
    i = torch.tensor([0, 3, -1])
    j = torch.tensor([[1], [3]])
    m = torch.tensor([True, False, True, True])
    cases = [
        lambda x, d: x[d(i)],
        lambda x, d: x[:, d(i)],
        lambda x, d: x[d(j), :, d(i)],  # separated advanced indices: result dims go first
        lambda x, d: x[None, d(i), ..., 2],
        lambda x, d: x[d(m)],
        lambda x, d: x[d(m), 1:3],
        lambda x, d: x[d(c > 0)],
        lambda x, d: x[1, d(torch.tensor(True))],
        lambda x, d: x[d(i).to(torch.int32)],
    ]
    for f in cases:
        assert_same(f(t, tpu), f(c, lambda a: a))


def test_index_put_and_setitem():
    c, t = pair(4, 5)
    for f in [
        lambda x, d: x.__setitem__((d(torch.tensor([0, 2])), slice(None)), 7.0),
        lambda x, d: x.__setitem__(d(x > 0.5), 0.0),
        lambda x, d: x.__setitem__(d(torch.tensor([True, False, True, False])), d(torch.arange(5.0))),
        lambda x, d: x.index_put_((d(torch.tensor([1, 1, 3])),), d(torch.ones(3, 5)), accumulate=True),
        lambda x, d: x.index_put_((d(torch.tensor([0])), d(torch.tensor([4]))), d(torch.tensor(9.0))),
    ]:
        f(c, lambda a: a)
        f(t, tpu)
        assert_same(t, c)


def test_inplace_indexing_through_views_updates_base():
    c, t = pair(5, 6)
    for f in [
        lambda x, d: x.t()[1:3, 2].fill_(7.0),
        lambda x, d: x.t().__setitem__((slice(1, 3), 2), 7.0),
        lambda x, d: x[1:].t().index_put_((d(torch.tensor([0, 5])),), d(torch.tensor(3.0))),
        lambda x, d: x.t().masked_fill_(d(x.t() > 1.0), -1.0),
        lambda x, d: x[:, 1:4].scatter_add_(1, d(torch.tensor([[0, 2], [1, 1]])), d(torch.ones(2, 2))),
        lambda x, d: x.t()[2:].index_add_(0, d(torch.tensor([0, 3, 0])), d(torch.ones(3, 5))),
        lambda x, d: x.t()[::2].index_fill_(1, d(torch.tensor([1, -1])), 4.0),
    ]:
        f(c, lambda a: a)
        f(t, tpu)
        assert_same(t, c)


def test_gather_scatter_family():
    c, t = pair(3, 5)
    idx = torch.tensor([[0, 4, 2], [1, 1, 3]])
    src = torch.randn(3, 5)
    for f in [
        lambda x, d: x.gather(1, d(idx)),
        lambda x, d: x.scatter(1, d(idx), d(src)),
        lambda x, d: x.scatter(1, d(idx), 2.5),
        lambda x, d: x.scatter(1, d(idx), d(src), reduce="add"),
        lambda x, d: x.scatter(1, d(idx), d(src), reduce="multiply"),
        lambda x, d: x.scatter_add(1, d(idx), d(src)),
        lambda x, d: x.index_select(1, d(torch.tensor([4, 0, 0]))),
        lambda x, d: x.index_copy(1, d(torch.tensor([4, 0])), d(src[:, :2])),
        lambda x, d: x.index_add(0, d(torch.tensor([2, 2])), d(src[:2]), alpha=2.0),
        lambda x, d: x.take(d(torch.tensor([[0, -1], [14, 3]]))),
        lambda x, d: x.put(d(torch.tensor([0, 0, 7])), d(torch.tensor([1.0, 2.0, 3.0])), accumulate=True),
        lambda x, d: x.masked_scatter(d(x > 0), d(src)),
        lambda x, d: x.masked_select(d(x > 0)),
        lambda x, d: torch.nonzero(d(x > 0)),
        lambda x, d: torch.select_scatter(x, d(src[0]), 0, 1),
        lambda x, d: torch.slice_scatter(x, d(src[:, :2]), 1, 1, 5, 2),
        lambda x, d: torch.diagonal_scatter(x, d(src[0, :2]), 3),
    ]:
        assert_same(f(t, tpu), f(c, lambda a: a))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_and_index_reduce(reduce, include_self):
    c, t = pair(3, 5)
    idx = torch.tensor([[0, 4, 4], [1, 1, 3]])
    src = torch.randn(2, 3)
    assert_same(
        t.scatter_reduce(1, tpu(idx), tpu(src), reduce, include_self=include_self),
        c.scatter_reduce(1, idx, src, reduce, include_self=include_self),
    )
    if reduce != "sum":
        i = torch.tensor([0, 2, 0])
        s = torch.randn(3, 5)
        assert_same(
            t.index_reduce(0, tpu(i), tpu(s), reduce, include_self=include_self),
            c.index_reduce(0, i, s, reduce, include_self=include_self),
        )


def test_out_of_range_indices_raise_like_cpu():
    c, t = pair(4, 5)
    big = torch.tensor([7])
    cases = [
        lambda x, d: x[d(big)],
        lambda x, d: x[:, d(torch.tensor([-6]))],
        lambda x, d: x.index_put_((d(big),), d(torch.tensor(1.0))),
        lambda x, d: x.index_select(1, d(big)),
        lambda x, d: x.gather(1, d(torch.tensor([[5]]))),
        lambda x, d: x.gather(1, d(torch.tensor([[-1]]))),
        lambda x, d: x.scatter(1, d(torch.tensor([[5]])), 1.0),
        lambda x, d: x.scatter_add(0, d(torch.tensor([[4]])), d(x)),
        lambda x, d: x.index_add(1, d(big), d(torch.ones(4, 1))),
        lambda x, d: x.index_copy(1, d(big), d(torch.ones(4, 1))),
        lambda x, d: x.index_fill(1, d(torch.tensor([-6])), 1.0),
        lambda x, d: x.take(d(torch.tensor([20]))),
        lambda x, d: x.put(d(torch.tensor([-21])), d(torch.tensor([1.0]))),
        lambda x, d: x[d(torch.ones(3, dtype=torch.bool))],
        lambda x, d: x.masked_scatter(d(torch.ones(4, 5, dtype=torch.bool)), d(torch.ones(3))),
    ]
    for f in cases:
        with pytest.raises(Exception) as cpu_err:
            f(c.clone(), lambda a: a)
        with pytest.raises(cpu_err.type):
            f(t.clone(), tpu)


def test_index_error_names_the_op():
    t = torch.randn(4, 5, device="tpu")
    with pytest.raises(RuntimeError, match="gather"):
        t.gather(1, torch.tensor([[9]], device="tpu"))
    with pytest.raises(IndexError, match="take"):
        t.take(torch.tensor([99], device="tpu"))


def test_no_cpu_fallback_for_indexing():
    torch_tpu.reset_metrics()
    c, t = pair(4, 5)
    t[tpu(torch.tensor([1, 2]))] = 3.0
    t.index_select(0, tpu(torch.tensor([0])))
    t.gather(0, tpu(torch.tensor([[0, 1]])))
    t[t > 0]
    torch.nonzero(t)
    assert torch_tpu.metrics()["fallback_counts"] == {}
