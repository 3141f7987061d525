"""Sparse COO tensors on tpu (torch_tpu/dispatch/sparse.py), compared with CPU: the life cycle, coalesce,
to_dense, the ops SparseAdam needs, nn.Embedding(sparse=True) training, and clear errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_same
from torch import nn

import torch_tpu

TPU = torch.device("tpu", 0)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "sparse invariant checks are implicitly disabled"
        yield


def dup():
    """A 2-D COO tensor with duplicate, unsorted indices."""
    i = torch.tensor([[1, 0, 1, 0, 1], [2, 2, 0, 2, 2]])
    v = torch.tensor([3.0, 4.0, 5.0, 6.0, -1.0])
    return torch.sparse_coo_tensor(i, v, (2, 3))


def hybrid():
    """Sparse dim 1, dense dim 1 (the layout of an embedding gradient), with duplicates."""
    i = torch.tensor([[4, 1, 4, 0]])
    v = torch.randn(4, 3)
    return torch.sparse_coo_tensor(i, v, (5, 3))


def test_construct_and_fields():
    c = dup()
    t = torch.sparse_coo_tensor(c._indices().to("tpu"), c._values().to("tpu"), (2, 3), device="tpu")
    assert t.device == TPU and t.is_sparse and t.layout == torch.sparse_coo
    assert (t._nnz(), t.sparse_dim(), t.dense_dim(), t.is_coalesced()) == (5, 2, 0, False)
    assert_same(t._indices(), c._indices())
    assert_same(t._values(), c._values())
    # CPU parts with device="tpu", and the size inferred from the indices
    t2 = torch.sparse_coo_tensor(c._indices(), c._values(), device="tpu")
    assert t2.device == TPU and t2.shape == torch.Size([2, 3])
    assert "device='tpu:0'" in repr(t)


def test_round_trip_and_clone():
    for c in (dup(), hybrid(), dup().coalesce()):
        t = c.to("tpu")
        assert t.device == TPU and t.is_sparse and t._values().device == TPU
        assert t.is_coalesced() == c.is_coalesced()
        for back in (t.cpu(), t.to("cpu")):
            assert back.device.type == "cpu" and back.is_sparse
            assert torch.equal(back._indices(), c._indices()) and torch.equal(back._values(), c._values())
        k = t.clone()
        assert k.device == TPU and k.is_coalesced() == c.is_coalesced()
        k._values().mul_(2)  # the clone owns its values
        assert_same(t._values(), c._values())
    assert t.to(torch.float64).dtype == torch.float64


def test_coalesce_sums_duplicates_and_sorts():
    for c in (dup(), hybrid()):
        t = c.to("tpu").coalesce()
        ref = c.coalesce()
        assert t.is_coalesced() and t._nnz() == ref._nnz()
        assert_same(t._indices(), ref._indices())
        assert_same(t._values(), ref._values())
        assert_same(t.indices(), ref.indices())
        assert_same(t.values(), ref.values())
        assert t.coalesce() is t  # already coalesced: no work


def test_values_of_uncoalesced_raises_as_cpu():
    with pytest.raises(RuntimeError, match="coalesce"):
        dup().values()
    with pytest.raises(RuntimeError, match="coalesce"):
        dup().to("tpu").values()


def test_to_dense():
    for c in (dup(), hybrid(), dup().coalesce()):
        assert_same(c.to("tpu").to_dense(), c.to_dense())


def test_zeros_zero_and_copy():
    z = torch.zeros(3, 4, layout=torch.sparse_coo, device="tpu")
    assert z.device == TPU and z._nnz() == 0
    assert_same(z.to_dense(), torch.zeros(3, 4))
    t = dup().to("tpu")
    t.zero_()
    assert t._nnz() == 0 and t.shape == torch.Size([2, 3])
    t.copy_(dup())  # CPU sparse into tpu sparse
    assert t.device == TPU
    assert_same(t.to_dense(), dup().to_dense())


def test_add_sub_and_scalar_ops():
    a, b = dup(), dup().coalesce()
    d = torch.randn(2, 3)
    ta, tb, td = a.to("tpu"), b.to("tpu"), d.to("tpu")
    assert_same(torch.add(td, ta, alpha=0.5), torch.add(d, a, alpha=0.5))
    assert_same((ta + tb).to_dense(), (a + b).to_dense())
    assert (tb + tb).is_coalesced() == (b + b).is_coalesced()
    assert_same((tb + tb).coalesce(), (b + b).coalesce())
    assert_same((ta - tb).to_dense(), (a - b).to_dense())
    assert_same((ta * 2.5).to_dense(), (a * 2.5).to_dense())
    assert_same((ta / 4).to_dense(), (a / 4).to_dense())
    assert_same((-ta).to_dense(), (-a).to_dense())
    assert_same((torch.tensor(3.0, device="tpu") * ta).to_dense(), (torch.tensor(3.0) * a).to_dense())
    td2, d2 = td.clone(), d.clone()
    td2.add_(ta, alpha=-2)
    d2.add_(a, alpha=-2)
    assert_same(td2, d2)
    with pytest.raises(RuntimeError, match="add\\(sparse, dense\\) is not supported"):
        ta + td
    with pytest.raises(RuntimeError, match="same size"):
        torch.zeros(3, 3, device="tpu") + ta
    with pytest.raises(RuntimeError, match="Can't convert result type Float to output Long"):
        torch.ones(2, 3, dtype=torch.long, device="tpu").add_(ta)
    with pytest.raises(RuntimeError, match="same device"):
        td + a


def test_sparse_mask():
    d = torch.randn(2, 3)
    for m in (dup(), dup().coalesce()):
        r, tr = d.sparse_mask(m), d.to("tpu").sparse_mask(m.to("tpu"))
        assert tr.is_sparse and tr.is_coalesced() == r.is_coalesced()
        assert_same(tr._indices(), r._indices())
        assert_same(tr._values(), r._values())
    h, dh = hybrid(), torch.randn(5, 3)
    assert_same(dh.to("tpu").sparse_mask(h.to("tpu")).to_dense(), dh.sparse_mask(h).to_dense())
    with pytest.raises(RuntimeError, match="incompatible sizes"):
        torch.zeros(3, 3, device="tpu").sparse_mask(dup().to("tpu"))


def test_sparse_mask_of_sparse():
    a = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]]), torch.randn(4, 2), (2, 3, 2))
    m = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1, 0, 1], [2, 1, 0, 2, 2]]), torch.randn(5, 2), (2, 3, 2))
    for mm in (m, m.coalesce()):
        r, tr = a.sparse_mask(mm), a.to("tpu").sparse_mask(mm.to("tpu"))
        assert tr.is_coalesced() == r.is_coalesced()
        assert_same(tr._indices(), r._indices())
        assert_same(tr._values(), r._values())


def test_gradient_through_the_constructor():
    i = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
    grads = []
    for dev in ("cpu", "tpu"):
        v = torch.tensor([3.0, 4.0, 5.0, 6.0], device=dev, requires_grad=True)
        s = torch.sparse_coo_tensor(i.to(dev), v, (2, 3))
        (s.to_dense() * torch.arange(6.0, device=dev).view(2, 3)).sum().backward()
        grads.append(v.grad)
    assert_same(grads[1], grads[0])


@pytest.mark.parametrize("maximize", [False, True])
def test_embedding_sparse_adam_matches_cpu(maximize):
    torch.manual_seed(0)
    mc = nn.Embedding(10, 4, sparse=True, padding_idx=0)
    mt = copy.deepcopy(mc).to("tpu")
    ids = torch.tensor([[1, 2, 4, 1], [4, 3, 0, 9]])
    grads = []
    torch_tpu.reset_metrics()
    for m, dev in ((mc, "cpu"), (mt, "tpu")):
        opt = torch.optim.SparseAdam(m.parameters(), lr=0.1, maximize=maximize)
        x = ids.to(dev)
        for _ in range(3):
            opt.zero_grad()
            # two uses: autograd adds two sparse gradients
            loss = m(x).square().sum() + m(x[:, :2]).sum()
            loss.backward()
            grads.append(m.weight.grad)
            opt.step()
    assert mt.weight.device == TPU and grads[-1].is_sparse and grads[-1].device == TPU
    # CPU merges two uncoalesced gradients pairwise, tpu lists both: equal once coalesced
    assert_same(grads[-1].coalesce(), grads[2].coalesce(), rtol=1e-4, atol=1e-5)
    assert_same(mt.weight.detach(), mc.weight.detach(), rtol=1e-4, atol=1e-5)
    assert not torch_tpu.metrics()["fallback_counts"]  # all the math ran on the device


@pytest.mark.parametrize("mode,padding_idx,weighted", [("mean", None, False), ("sum", 0, False), ("sum", 0, True),
                                                         ("mean", 0, False)])
def test_embedding_bag_sparse_gradient_and_sparse_adam_match_cpu(mode, padding_idx, weighted):
    """EmbeddingBag(sparse=True) gives a sparse COO weight gradient, its padding rows left out, as
    CPU does (the tpu kernel returned a dense one, and torch's meta kernel failed with padding)."""
    torch.manual_seed(0)
    mc = nn.EmbeddingBag(10, 3, mode=mode, sparse=True, padding_idx=padding_idx)
    mt = copy.deepcopy(mc).to("tpu")
    ids = torch.tensor([0, 2, 1, 4, 0, 0, 3, 3, 9])
    offsets = torch.tensor([0, 4])
    psw = torch.rand(9) if weighted else None
    grads = []
    for m, dev in ((mc, "cpu"), (mt, "tpu")):
        opt = torch.optim.SparseAdam(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            out = m(ids.to(dev), offsets.to(dev), per_sample_weights=None if psw is None else psw.to(dev))
            (out * torch.arange(6.0, device=dev).view(2, 3)).sum().backward()
            grads.append(m.weight.grad)
            opt.step()
    assert grads[-1].is_sparse and grads[-1].device == TPU
    assert torch.equal(grads[-1].coalesce().indices().cpu(), grads[1].coalesce().indices())
    assert_same(grads[-1].coalesce(), grads[1].coalesce(), rtol=1e-5, atol=1e-6)
    assert_same(mt.weight.detach(), mc.weight.detach(), rtol=1e-5, atol=1e-6)


def test_unsupported_op_raises_not_implemented():
    t = dup().to("tpu")
    with pytest.raises(NotImplementedError, match="sin.*sparse tpu"):
        t.sin()
    with pytest.raises(NotImplementedError, match="sparse tpu"):
        t * t
    with pytest.raises(NotImplementedError, match="sparse tpu"):
        torch.sparse.mm(t, torch.randn(3, 2, device="tpu"))
