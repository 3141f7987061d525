"""Reductions and searches as CPU has them where OpInfo's samples don't look: CPU's exception
types for empty or too-many-dimension reductions and for ``out=`` tensors of the wrong dtype,
``dim=[]``, and the checks CPU's searchsorted/bucketize/histc make before computing."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import like_cpu, outcome


@pytest.mark.parametrize("op", [torch.sum, torch.nansum, torch.mean, torch.var, torch.logsumexp, torch.argmax])
def test_more_than_64_dims(op):
    """CPU reduces at most 64 dimensions along a given dim (all of them is fine). (The tensor is
    made on the device: numpy, the way up from the host, holds at most 64 dimensions.)"""
    cpu = outcome(op, torch.zeros([1] * 65), dim=0)
    tpu = outcome(op, torch.zeros([1] * 65, device="tpu"), dim=0)
    assert cpu[0] is RuntimeError and tpu[0] is RuntimeError and cpu[1] in tpu[1], (cpu, tpu)


def test_nansum_over_an_empty_dim_list_reduces_everything():
    x = torch.tensor([[1.0, math.nan, 2.0], [3.0, 4.0, math.nan]])
    like_cpu(torch.nansum, x, dim=[])
    like_cpu(torch.nansum, x, dim=[], keepdim=True)


@pytest.mark.parametrize("op", [torch.amax, torch.amin])
def test_empty_reduced_dim_without_identity(op):
    """max and min have no identity: an empty reduced dim is CPU's IndexError, a full reduction
    of an empty tensor its RuntimeError; a non-empty reduced dim of an empty tensor is fine."""
    t = torch.zeros(0, 2, 3)
    like_cpu(op, t, 0)
    like_cpu(op, t, [0, 2])
    like_cpu(op, t)
    like_cpu(op, t, 1)
    like_cpu(lambda x: torch.max(x, 0).values, t)


def test_out_of_the_wrong_dtype():
    """all/any write only bool (or uint8) outs; mode checks both outs' dtypes."""
    x = torch.ones(2, 3, dtype=torch.int8)
    for fn in (torch.all, torch.any):
        like_cpu(lambda a, o, f=fn: f(a, 0, out=o), x, torch.empty(3, dtype=torch.int8))
        like_cpu(lambda a, o, f=fn: f(a, 0, out=o), x.bool(), torch.empty(3, dtype=torch.bool))
    v = torch.ones(10, dtype=torch.uint8)
    like_cpu(lambda a, o, i: torch.mode(a, -1, out=(o, i))[0], v, torch.empty(0, dtype=torch.int8),
              torch.empty(0, dtype=torch.long))
    like_cpu(lambda a, o, i: torch.mode(a, -1, out=(o, i))[0], v, torch.empty(0, dtype=torch.uint8),
              torch.empty(0, dtype=torch.int8))


def test_searchsorted_and_bucketize_checks():
    v1 = torch.arange(1, 10)
    v3 = torch.tensor([[[1, 3, 5], [2, 4, 6]], [[1, 2, 3], [4, 5, 6]]])
    b2 = torch.tensor([[1, 2, 3], [4, 5, 6]])
    like_cpu(torch.searchsorted, b2, v3)
    like_cpu(torch.bucketize, v3, b2)
    like_cpu(torch.searchsorted, b2, 1)
    like_cpu(lambda a, b: torch.searchsorted(a, b, side="bad"), v1, v1)
    like_cpu(lambda a, b, o: torch.searchsorted(a, b, out=o), v1, v1, torch.empty(9))
    seq = torch.rand(9)
    like_cpu(lambda a, b, s: torch.searchsorted(a, b, sorter=s), seq, v1, torch.arange(8))
    like_cpu(lambda a, b, s: torch.searchsorted(a, b, sorter=s), seq, v1, torch.arange(9.0))
    like_cpu(lambda a, b, s: torch.searchsorted(a, b, sorter=s), seq, v1.float(), torch.argsort(seq))


def test_searchsorted_warns_of_non_contiguous_arguments():
    v = torch.arange(12).reshape(2, 2, 3).to("tpu").permute(2, 1, 0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = torch.searchsorted(v.to(torch.float64), v.to(torch.int32))
    assert any("non-contiguous" in str(x.message) for x in w)
    c = torch.arange(12).reshape(2, 2, 3).permute(2, 1, 0)
    assert got.cpu().tolist() == torch.searchsorted(c.double(), c.int()).tolist()


def test_histc_checks():
    like_cpu(lambda x: torch.histc(x, bins=-1), torch.tensor([1.0]))
    like_cpu(lambda x: torch.histc(x, bins=4, min=5, max=1), torch.tensor([1.0, 2.0]))
    like_cpu(torch.histc, torch.tensor([math.nan]))
    like_cpu(torch.histc, torch.tensor([1.0, 2.0, math.inf]))  # the data's range is [1, inf]
    like_cpu(lambda x: torch.histc(x, bins=4, max=3), torch.tensor([1.0, 2.0, math.inf]))  # a given range


@pytest.mark.parametrize("op", [torch.argmax, torch.argmin])
def test_argmax_of_an_empty_tensor(op):
    t = torch.zeros(2, 0, 4)
    like_cpu(op, t)
    like_cpu(op, t, 1)
    like_cpu(op, t, 2)


@pytest.mark.parametrize("op", [torch.std, torch.var, torch.var_mean, torch.std_mean])
def test_no_degrees_of_freedom_warns_each_call(op):
    x = torch.randn(10, 20, device="tpu")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):
            op(x, dim=-1, correction=20)
        op(x, dim=-1)
    # counted among what was recorded: another warning may land in the window too (in make test's
    # op group, residency's "compiled programs hold N memory mappings ... dropped" at that call)
    dof = [m for m in w if "degrees of freedom is <= 0" in str(m.message)]
    assert len(dof) == 2, [f"{m.category.__name__}: {m.message}" for m in w]


def test_selection_along_an_empty_dim():
    t = torch.zeros(2, 0, 4)
    like_cpu(lambda x: torch.median(x, 1).values, t)
    like_cpu(lambda x: torch.nanmedian(x, 1).values, t)
    like_cpu(lambda x: torch.kthvalue(x, 1, 1).values, t)
    like_cpu(lambda x: torch.median(x, 2).values, t)
    like_cpu(lambda x: torch.kthvalue(torch.arange(6.0).reshape(2, 3), 2, dim=1).values, t)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_logsumexp_and_logcumsumexp_on_cpus_branch(dtype):
    """CPU's complex logsumexp shifts by the largest real part, so its imaginary part is the
    principal log's; its logcumsumexp adds one element at a time with logaddexp's complex formula,
    whose imaginary part is not reduced. Values with large imaginary parts tell the branches apart."""
    x = torch.randn(4, 30, dtype=dtype, generator=torch.Generator().manual_seed(0)) * 5
    like_cpu(lambda t: torch.logsumexp(t, 1), x)
    like_cpu(lambda t: torch.logsumexp(t, (0, 1), keepdim=True), x)
    like_cpu(lambda t: torch.logcumsumexp(t, 1), x)
    like_cpu(lambda t: torch.logcumsumexp(t, 0), x)
    like_cpu(lambda t: torch.logcumsumexp(t[0, 0], 0), x)  # 0-dim
