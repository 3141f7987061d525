"""Behaviour that PyTorch's test_torch and test_autograd device-type tests found different from CPU.

Each test checks tpu against CPU on the same inputs: the storage API (sizes, bytes, new storages,
copies), strides of tensors with a zero-size dim, and dense -> sparse conversion with its backward.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from conftest import like_cpu

import torch_tpu  # noqa: F401

warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")


def _both(fn):
    return fn("cpu"), fn("tpu")


# ------------------------------------------------------------------- strides of empty tensors
@pytest.mark.parametrize("shape", [(5, 1, 0, 2), (0, 3), (2, 0), (3, 0, 4)])
def test_zero_size_dim_strides_match_cpu(shape):
    """A size-0 dim counts as 1 in the strides of the dims before it, as on CPU (gradcheck refuses
    an input with a stride-0 dim of size > 1, so (5, 1, 0, 2) with strides (0, 0, 2, 1) failed)."""
    cpu, tpu = _both(lambda d: torch.empty(shape, device=d))
    assert tpu.stride() == cpu.stride()
    assert torch.zeros(shape, device="tpu").stride() == cpu.stride()
    assert torch.randn(shape).to("tpu").stride() == cpu.stride()
    assert tpu.is_contiguous()


def test_gradcheck_accepts_empty_tpu_input():
    x = torch.randn(5, 1, 0, 2, dtype=torch.float64, device="tpu", requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: t * 2, (x,))


# ----------------------------------------------------------------------- the storage API
def test_storage_sizes_and_elements_match_cpu():
    c = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = c.to("tpu")
    assert t.untyped_storage().nbytes() == c.untyped_storage().nbytes() == 48
    assert t.storage().size() == len(t.storage()) == 12
    assert t.storage()[7] == c.storage()[7] == 7.0
    assert t[1:].storage().size() == 12  # a view's storage is its base's
    assert t.storage().tolist() == c.storage().tolist()


@pytest.mark.parametrize("dtype", [torch.int16, torch.float32, torch.float64, torch.bool, torch.complex64])
def test_untyped_storage_bytes_match_cpu(dtype):
    """An untyped storage reads as the array's bytes, in memory order, as CPU's does."""
    c = torch.tensor([1, 0, 3], dtype=dtype) if dtype != torch.bool else torch.tensor([True, False, True])
    t = c.to("tpu")
    assert t.untyped_storage().tolist() == c.untyped_storage().tolist()
    assert list(t.untyped_storage()[1:3]) == list(c.untyped_storage()[1:3])


def test_untyped_storage_write_reaches_tensor():
    c, t = _both(lambda d: torch.zeros(2, dtype=torch.int16, device=d))
    for x in (c, t):
        x.untyped_storage()[0] = 7
        x.untyped_storage()[3] = 1
    assert t.tolist() == c.tolist() == [7, 256]


def test_new_tpu_storage_like_cpu():
    """``UntypedStorage(n | bytes, device="tpu")`` (and TypedStorage on top) used to crash in C++."""
    s = torch.UntypedStorage(8, device="tpu")
    assert (s.device.type, s.nbytes()) == ("tpu", 8)
    assert torch.UntypedStorage(device="tpu").nbytes() == 0
    s = torch.UntypedStorage([1, 2, 255], device="tpu")
    assert s.tolist() == [1, 2, 255]
    ts = torch.TypedStorage([1.5, 2.5], dtype=torch.float32, device="tpu")
    assert (ts.size(), ts[1]) == (2, 2.5)
    assert torch.TypedStorage(3, dtype=torch.float64, device="tpu").nbytes() == 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                                   torch.complex64, torch.complex128])
def test_storage_type_is_the_devices_legacy_class_like_cuda(dtype):
    """``storage_type()`` names ``torch.tpu.<X>Storage``, where CPU's names ``torch.<X>Storage``
    (and CUDA's ``torch.cuda.<X>Storage``); it was None. The class makes and recognises tpu storages."""
    c = torch.ones(3, dtype=dtype)
    t = c.to("tpu")
    cls = t.storage_type()
    assert cls is not None and cls.__name__ == c.storage_type().__name__ and cls.__module__ == "torch.tpu"
    assert cls is getattr(torch.tpu, cls.__name__) and cls.dtype == dtype
    assert isinstance(t.storage(), cls) and not isinstance(c.storage(), cls)
    assert not isinstance(t.storage(), c.storage_type())
    made, ref = cls([1, 0, 1]), c.storage_type()([1, 0, 1])
    assert (made.device.type, made.dtype, made.tolist()) == ("tpu", dtype, ref.tolist())
    assert (cls(4).size(), cls(4).device.type) == (4, "tpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16, torch.bfloat16])
def test_storage_moves_to_tpu_as_to_cuda(dtype):
    """``storage.tpu()`` and ``storage.is_tpu``, as CUDA's ``storage.cuda()`` and ``is_cuda``."""
    c = torch.arange(5).to(dtype)
    moved = c.untyped_storage().tpu()
    assert (moved.device.type, moved.is_tpu, c.untyped_storage().is_tpu) == ("tpu", True, False)
    assert moved.tolist() == c.untyped_storage().tolist() and moved.tpu() is moved
    typed = c.storage().tpu()
    assert (typed.device.type, typed.dtype, typed.is_tpu) == ("tpu", dtype, True)
    assert typed.tolist() == c.storage().tolist()
    assert not moved.cpu().is_tpu


def test_tpu_legacy_storage_refuses_host_buffers():
    with pytest.raises(RuntimeError, match="from_buffer: Not available for tpu storage"):
        torch.tpu.FloatStorage.from_buffer(b"\0" * 8, "native")


def test_storage_clone_copy_fill_like_cpu():
    c = torch.arange(4, dtype=torch.int32)
    t = c.to("tpu")
    for x in (c, t):
        st = x.untyped_storage()
        dup = st.clone()
        assert dup.device == x.device and dup.tolist() == st.tolist()
        st.fill_(1)  # every byte
    assert t.tolist() == c.tolist() == [0x01010101] * 4
    back = t.untyped_storage().cpu()
    assert back.device.type == "cpu" and back.tolist() == c.untyped_storage().tolist()
    dst = torch.zeros(4, dtype=torch.int32, device="tpu")
    dst.untyped_storage().copy_(torch.arange(4, dtype=torch.int32).untyped_storage())
    assert dst.tolist() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="size does not match"):
        dst.untyped_storage().copy_(torch.zeros(3, device="tpu").untyped_storage())


def test_storage_meta_twin_has_same_size():
    t = torch.randn(4, 5, device="tpu")
    assert t.to("meta").untyped_storage().nbytes() == t.untyped_storage().nbytes() == 80


def test_deepcopy_of_storages():
    t = torch.arange(6.0, device="tpu")
    a, s = copy.deepcopy([t, t.storage()])
    assert a.tolist() == t.tolist() and s.tolist() == t.storage().tolist()


# ------------------------------------------------------------------------ dense -> sparse
@pytest.mark.parametrize("sparse_dim", [1, 2])
def test_to_sparse_matches_cpu(sparse_dim):
    c = torch.tensor([[0.0, 1.0], [0.0, 0.0], [2.0, float("nan")]])
    cs, ts = c.to_sparse(sparse_dim), c.to("tpu").to_sparse(sparse_dim)
    assert ts.device.type == "tpu" and ts.is_coalesced()
    torch.testing.assert_close(ts._indices().cpu(), cs._indices())
    torch.testing.assert_close(ts._values().cpu(), cs._values(), equal_nan=True)


@pytest.mark.parametrize("x", [torch.tensor(3.0), torch.tensor(0.0), torch.zeros(2, 3), torch.zeros(0, 3)])
def test_to_sparse_degenerate_inputs_match_cpu(x):
    cs, ts = x.to_sparse(), x.to("tpu").to_sparse()
    assert ts._indices().shape == cs._indices().shape and ts._values().shape == cs._values().shape


@pytest.mark.parametrize("bad", [3, 0, -1])
def test_to_sparse_bad_sparse_dim_errors_like_cpu(bad):
    x = torch.ones(3, 2)
    with pytest.raises(RuntimeError) as cpu_err:
        x.to_sparse(bad)
    with pytest.raises(RuntimeError) as tpu_err:
        x.to("tpu").to_sparse(bad)
    assert str(tpu_err.value) == str(cpu_err.value)


def test_sparse_mask_backward_like_cpu():
    grads = []
    for d in ("cpu", "tpu"):
        x = torch.arange(3.0, device=d, requires_grad=True)
        mask = torch.tensor([1.0, 0.0, 1.0], device=d).to_sparse()
        x.sparse_mask(mask).to_dense().sum().backward()
        grads.append(x.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


def test_storage_slice_reads_like_cpu():
    """``storage[a:b]`` of a tpu storage is a copy of those bytes (CPU's shares them)."""
    c = torch.arange(6, dtype=torch.int16)
    t = c.to("tpu")
    assert t.untyped_storage()[2:6].tolist() == c.untyped_storage()[2:6].tolist()
    assert t.untyped_storage()[5:2].nbytes() == 0


# --------------------------------------------------------------------------------- resize_
@pytest.mark.parametrize("new", [(3,), (8,), (2, 5)])
def test_resize_keeps_storage_like_cpu(new):
    """``resize_`` keeps the storage (grown, never shrunk) and its leading bytes, as on CPU."""
    out = []
    for d in ("cpu", "tpu"):
        t = torch.arange(6.0, device=d)
        t.resize_(new)
        assert t.untyped_storage().nbytes() == max(24, 4 * math.prod(new))
        out.append((t.shape, t.stride(), t.flatten()[: min(6, t.numel())].cpu().tolist()))
    assert out[0] == out[1]


def test_deterministic_fill_like_cpu():
    """Under ``use_deterministic_algorithms`` new memory is NaN (floats) or the largest integer."""
    from torch.testing._internal.common_utils import DeterministicGuard

    with DeterministicGuard(True):
        for dtype in (torch.float32, torch.int32):
            top = torch.iinfo(dtype).max if dtype == torch.int32 else None
            for t in (torch.empty(2, 3, dtype=dtype, device="tpu"),
                      torch.empty_strided((2, 3), (1, 2), dtype=dtype, device="tpu"),
                      torch.ones(2, dtype=dtype, device="tpu").resize_(5)[2:]):
                assert bool(t.isnan().all() if top is None else t.eq(top).all())
    assert not torch.empty(4, device="tpu").isnan().any()  # zeros outside it


def test_deepcopy_keeps_view_and_storage_sharing_like_cpu():
    """A tensor, its view and its storage deep-copied together share the copied storage."""
    res = []
    for d in ("cpu", "tpu"):
        a = torch.arange(6.0, device=d)
        view = a.view(2, 3)
        a2, st2, v2 = copy.deepcopy([a, a.untyped_storage(), view])
        a2.add_(1)
        res.append((v2.cpu().tolist(), torch.tensor([], device=d).set_(st2).cpu().tolist(), a.cpu().tolist()))
    assert res[0] == res[1]


# ------------------------------------------------------------------- copy_, gather, scatter_add
@pytest.mark.parametrize("dst,src", [((1,), (2, 1, 2, 1)), ((3,), (2,)), ((2, 3), (3, 2))])
def test_copy_broadcast_errors_like_cpu(dst, src):
    with pytest.raises(RuntimeError) as cpu_err:
        torch.zeros(dst).copy_(torch.ones(src))
    with pytest.raises(RuntimeError) as tpu_err:
        torch.zeros(dst, device="tpu").copy_(torch.ones(src, device="tpu"))
    assert str(tpu_err.value) == str(cpu_err.value)


def test_gather_with_zero_dim_tensors_like_cpu():
    for d in ("cpu", "tpu"):
        one = torch.tensor([5.0], device=d)
        assert torch.gather(one, 0, torch.zeros((), dtype=torch.int64, device=d)).shape == ()
        assert torch.gather(one[0], 0, torch.zeros(1, dtype=torch.int64, device=d)).shape == (1,)


def test_scatter_add_bool_is_logical_or_like_cpu():
    idx = torch.tensor([[0, 1, 2, 0, 0], [2, 0, 0, 1, 2]])
    src = torch.ones(2, 5, dtype=torch.bool)
    c = torch.zeros(3, 5, dtype=torch.bool).scatter_add_(0, idx, src)
    t = torch.zeros(3, 5, dtype=torch.bool, device="tpu").scatter_add_(0, idx.to("tpu"), src.to("tpu"))
    assert t.dtype == torch.bool and torch.equal(t.cpu(), c)


def test_is_set_to_like_cpu():
    """``is_set_to`` compares storage, offset, sizes and strides (it used to compare CPU copies)."""
    res = []
    for d in ("cpu", "tpu"):
        a = torch.empty(3, 4, device=d)
        b = torch.tensor([], device=d).set_(a)
        res.append((a.is_set_to(b), b.is_set_to(a), a.is_set_to(torch.empty(3, 4, device=d)),
                    a.is_set_to(a.view(4, 3)), a.is_set_to(a[:])))
    assert res[0] == res[1] == (True, True, False, False, True)


def test_map_and_map2_like_cpu():
    """``map_``/``map2_`` (a Python callable per element) run on a host copy of a tpu tensor."""
    res = []
    for d in ("cpu", "tpu"):
        a, b, c = (torch.arange(6.0, device=d).reshape(2, 3) * k for k in (1, 2, 3))
        a.map_(b[0], lambda x, y: x + y)
        a.map2_(b, c, lambda x, y, z: x * y - z)
        res.append(a.cpu())
    assert res[1].dtype == res[0].dtype and torch.equal(res[1], res[0])


def test_gradcheck_through_sparse_constructor_with_empty_dims():
    """gradcheck of a function building a sparse tensor from values with a zero-size dim, and of
    one with no sparse dims (``sparse_mask`` at the single position), as on CPU."""
    for size, sd, nnz in (([1, 0, 2], 0, 5), ([1, 2], 0, 3)):
        v = torch.randn([nnz] + size[sd:], dtype=torch.float64, device="tpu", requires_grad=True)
        idx = torch.zeros(sd, nnz, dtype=torch.long, device="tpu")

        def fn(values, idx=idx, size=size):
            return torch.sparse_coo_tensor(idx, values, size).coalesce().values().tanh()

        assert torch.autograd.gradcheck(fn, (v,), check_batched_grad=False)


# ----------------------------------------------------------- out= dtypes CPU refuses by name
@pytest.mark.parametrize("op", ["logcumsumexp", "cummax"])
def test_out_of_another_dtype_refused_like_cpu(op):
    """CPU's non-structured cumulative kernels refuse an out tensor of another dtype with
    "expected scalar_type Double but found Float" (an underscore, not "scalar type"): that refusal
    is CPU's verdict on the out dtype, so tpu raises it too instead of casting into ``out``."""

    def call(d):
        x = torch.randn(5, 2, dtype=torch.float64, device=d)
        if op == "cummax":
            return torch.cummax(x, 1, out=(torch.empty(0, dtype=torch.float32, device=d),
                                           torch.empty(0, dtype=torch.int64, device=d)))
        return torch.logcumsumexp(x, 1, out=torch.zeros(5, 2, dtype=torch.float32, device=d))

    with pytest.raises(RuntimeError, match="expected scalar_type Double but found Float") as cpu:
        call("cpu")
    with pytest.raises(type(cpu.value), match="expected scalar_type Double but found Float"):
        call("tpu")


def test_cumulative_out_of_same_dtype_still_written():
    x = torch.randn(4, 8, dtype=torch.float64)
    out = torch.empty(4, 16, dtype=torch.float64, device="tpu")[:, ::2]
    torch.logcumsumexp(x.to("tpu"), 0, out=out)
    torch.testing.assert_close(out.cpu(), torch.logcumsumexp(x, 0))
    assert not out.is_contiguous()


def _close_inputs(dtype):
    gen = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.rand(64, generator=gen) > 0.5, torch.rand(64, generator=gen) > 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
        a = torch.randint(lo, hi, (64,), generator=gen).to(dtype)
        return a, torch.randint(lo, hi, (64,), generator=gen).to(dtype).where(torch.arange(64) % 2 == 0, a + 1)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    a = torch.randn(64, generator=gen, dtype=wide)
    b = a * (1 + 0.01 * torch.randn(64, generator=gen, dtype=torch.float64))
    a, b = a.to(dtype), b.to(dtype)
    a[:4], b[2:6] = float("nan"), float("nan")
    a[8], b[8], a[9], b[10] = float("inf"), float("inf"), float("-inf"), float("inf")
    return a, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64,
                                   torch.int64, torch.int8, torch.uint8, torch.bool])
@pytest.mark.parametrize("rtol, atol", [(1e-5, 1e-8), (0.0, 0.0), (1e-2, 1e-3), (0.1, 0.0), (0.0, 120.0)])
def test_isclose_matches_cpu(dtype, rtol, atol):
    # integers are subtracted in the default float dtype on CPU (uint8 5 - 6 is not 255 there)
    a, b = _close_inputs(dtype)
    for equal_nan in (False, True):
        want = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan)
        got = torch.isclose(a.to("tpu"), b.to("tpu"), rtol=rtol, atol=atol, equal_nan=equal_nan)
        assert got.dtype == torch.bool and torch.equal(got.cpu(), want)


def test_isclose_of_integers_follows_the_default_dtype():
    a, b = torch.tensor([2**30, 2**40, -2**62]), torch.tensor([2**30 + 1, 2**40 + 1, 2**62])
    old = torch.get_default_dtype()
    try:
        for default in (torch.float32, torch.float64):
            torch.set_default_dtype(default)
            want = torch.isclose(a, b, rtol=0, atol=0.5)
            assert torch.equal(torch.isclose(a.to("tpu"), b.to("tpu"), rtol=0, atol=0.5).cpu(), want)
    finally:
        torch.set_default_dtype(old)


def test_isclose_is_one_op_with_cpu_errors():
    # torch's composite dispatched a dozen ops (a compiled program each, per shape); one here
    from torch_tpu.runtime import metrics

    a = torch.randn(3, 5, 2, device="tpu")
    before = dict(metrics.metrics()["op_counts"])
    assert bool(torch.isclose(a, a.clone()).all())
    after = metrics.metrics()["op_counts"]
    assert after["aten.isclose.default"] == before.get("aten.isclose.default", 0) + 1
    assert after.get("aten.abs.default", 0) == before.get("aten.abs.default", 0)
    assert torch.isclose(torch.ones(2, 3, device="tpu"), torch.ones(3, device="tpu")).shape == (2, 3)
    for args, kwargs in [((torch.ones(3), torch.ones(3, dtype=torch.float64)), {}),
                         ((torch.ones(3), torch.ones(3)), {"rtol": -1.0}),
                         ((torch.ones(3), torch.ones(3)), {"atol": -1.0})]:
        with pytest.raises(RuntimeError) as want:
            torch.isclose(*args, **kwargs)
        with pytest.raises(RuntimeError) as got:
            torch.isclose(*(t.to("tpu") for t in args), **kwargs)
        assert str(want.value) in str(got.value)


def test_isclose_in_a_compiled_graph_matches_cpu():
    # with a tpu kernel, graphs name isclose whole instead of torch's decomposition
    fn = torch.compile(lambda a, b: torch.isclose(a, b, rtol=0.05, equal_nan=True), backend="tpu")
    for dtype in (torch.float32, torch.int64):
        a, b = _close_inputs(dtype)
        want = torch.isclose(a, b, rtol=0.05, equal_nan=True)
        assert torch.equal(fn(a.to("tpu"), b.to("tpu")).cpu(), want)


@pytest.mark.parametrize("fn", [
    lambda x, i, s: x.index_add(0, i[:, 0], s),
    lambda x, i, s: x.put(i[:, 0], s[:, 0], accumulate=True),
    lambda x, i, s: x.index_put((i[:, 0],), s, accumulate=True),
    lambda x, i, s: x.scatter_add(0, i, s),
    lambda x, i, s: x.scatter_reduce(0, i, s, "sum", include_self=False),
    lambda x, i, s: x.scatter_reduce(0, i, s, "sum"),
    lambda x, i, s: x.scatter_reduce(0, i, s, "prod", include_self=False),
    lambda x, i, s: x.scatter_reduce(0, i, s, "amin", include_self=False),
    lambda x, i, s: x.scatter_reduce(0, i, s, "amax"),
], ids=["index_add", "put", "index_put", "scatter_add", "sum", "sum-self", "prod", "amin", "amax"])
def test_accumulating_into_bool_tensors_like_cpu(fn):
    """Sums into a bool tensor saturate (a logical or), products are ands, and include_self=False
    starts from the reduction's identity, as on CPU (XLA refused to add bools, and a bool sum
    ignored include_self)."""
    g = torch.Generator().manual_seed(0)
    x, s = torch.rand(4, 3, generator=g) > 0.5, torch.rand(4, 3, generator=g) > 0.5
    i = torch.randint(0, 4, (4, 3), generator=g)
    like_cpu(fn, x, i, s)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.float32])
def test_dropout_backward_of_an_integer_gradient_is_float_like_cpu(dtype):
    g = torch.tensor([1, 1, 0, 3]).to(dtype)
    mask = torch.tensor([True, False, True, True])
    like_cpu(lambda g, m: torch.ops.aten.native_dropout_backward(g, m, 2.0), g, mask)


def _complex32_story(device: str) -> dict:
    """complex32 through casts, copies, views of its bits and parts, indexing, item and arithmetic."""
    torch.manual_seed(5)
    src = torch.randn(6, dtype=torch.complex64)
    got = {}
    h = src.to(device).to(torch.complex32)
    got["cast"] = h
    got["item"] = torch.tensor(complex(h[2].item()))
    parts = torch.view_as_real(h)
    got["parts"] = parts
    parts[0, 0] = 7.0  # a write through the float16 view reaches the complex32 tensor
    got["after a write through the parts"] = h
    got["bits"] = h.view(torch.int32)
    got["halves"] = h.view(torch.float16)
    into = torch.zeros(6, dtype=torch.complex32, device=device)
    into.copy_(torch.arange(6.0).to(device) / 3)  # float32 values, rounded to float16 parts
    got["copy into"] = into
    back = torch.zeros(6, dtype=torch.complex64, device=device)
    back.copy_(h)
    got["copy out"] = back
    got["cat"] = torch.cat([h, into])
    got["gather"] = h[torch.tensor([4, 1]).to(device)]
    got["sum of two"] = h + into  # computed in complex64, rounded as complex32 holds it
    got["from parts"] = torch.view_as_complex(torch.ones(3, 2, dtype=torch.float16, device=device) / 3)
    got["to float"] = torch.view_as_real(h).float()
    return got


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex32_holds_cpu_values():
    """complex32, which XLA lacks, is held as complex64 with each part rounded to float16 whenever
    it is made: the same values and bits as a CPU complex32 tensor (it raised TypeError)."""
    want = _complex32_story("cpu")
    got = _complex32_story("tpu")
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        g = got[k].cpu()
        assert torch.equal(torch.view_as_real(g) if v.is_complex() else g,
                           torch.view_as_real(v) if v.is_complex() else v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.complex64])
def test_shallow_copy_shares_the_data_like_cpu(dtype):
    """``copy.copy`` of a tensor shares its storage (a write through the copy shows in the
    original), while pickling and ``deepcopy`` copy the data; tpu's copy.copy went through its
    pickling path and copied."""
    results = {}
    for dev in ("cpu", "tpu"):
        x = torch.tensor([1, 0, 3, 4]).to(dtype).to(dev)
        y = copy.copy(x)
        y[1:3].fill_(1)
        d = copy.deepcopy(x)
        d.fill_(0)
        shared = y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        results[dev] = (x.cpu(), y.cpu(), y.storage_offset(), shared)
    assert results["tpu"][2:] == results["cpu"][2:]
    torch.testing.assert_close(results["tpu"][0], results["cpu"][0])
    torch.testing.assert_close(results["tpu"][1], results["cpu"][1])


@pytest.mark.parametrize("make", [
    lambda d: torch.empty(3, dtype=torch.chalf, device=d),
    lambda d: torch.zeros(3, dtype=torch.chalf, device=d),
    lambda d: torch.randn(3, dtype=torch.chalf, device=d),
    lambda d: torch.empty_strided((2, 2), (1, 2), dtype=torch.chalf, device=d),
    lambda d: torch.ones_like(torch.ones(2, device=d), dtype=torch.chalf),
])
def test_making_complex32_memory_warns_as_on_cpu(make):
    """CPU warns "ComplexHalf support is experimental" whenever complex32 memory is made (once a
    process, or every time under torch._C._set_warnAlways(True), as PyTorch's own tests set)."""
    was = torch._C._get_warnAlways()
    torch._C._set_warnAlways(True)
    try:
        for device in ("cpu", "tpu"):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                make(device)
            assert any("ComplexHalf support is experimental" in str(w.message) for w in seen), device
    finally:
        torch._C._set_warnAlways(was)
