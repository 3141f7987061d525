"""Views alias exactly, and in-place writes through views update the base, as on CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, like_cpu

import torch_tpu


def pair(*shape):
    c = torch.randn(*shape)
    return c, c.clone().to("tpu")


def test_views_read_like_cpu():
    c, t = pair(4, 5, 6)
    cases = [
        lambda x: x[1:3],
        lambda x: x[:, ::2],
        lambda x: x.transpose(0, 2),
        lambda x: x.permute(2, 0, 1)[1:, :, 2],
        lambda x: x.view(20, 6)[3:7],
        lambda x: x[1].t()[2:],
        lambda x: x.unflatten(2, (2, 3)),
        lambda x: x[:, :1, :].expand(4, 3, 6),
        lambda x: x[0].diagonal(),
        lambda x: x.diagonal(offset=1, dim1=1, dim2=2),
        lambda x: x.as_strided((3, 3), (7, 2), 5),
        lambda x: x.unfold(2, 3, 2),
        lambda x: x.narrow(1, 1, 3).select(2, 4),
        lambda x: x.reshape(-1)[::7],
    ]
    for f in cases:
        assert_same(f(t), f(c))


def test_views_share_storage():
    t = torch.zeros(3, 4, device="tpu")
    v = t[1]
    assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert v._base is t


_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


@pytest.mark.skipif(not _SWAP, reason="a tpu storage gets an address through _swap_data_ptr_ (torch >= 2.13)")
def test_data_ptr_tells_views_from_copies_like_cpu():
    """Code written for CUDA tells a copy from a view, and shared weights from distinct ones, by
    data_ptr(): each tpu storage has its own address, a view's is its storage's plus its offset in
    bytes, and an empty tensor's is 0, as on CPU."""
    for d in ("cpu", "tpu"):
        a = torch.arange(24.0, device=d).reshape(4, 6)
        st = a.untyped_storage()
        assert st.data_ptr() != 0 and a.data_ptr() == st.data_ptr()
        assert a[1:].data_ptr() == a.data_ptr() + 6 * 4
        assert a.view(24).data_ptr() == a.data_ptr() and a.t().data_ptr() == a.data_ptr()
        assert a[1:].untyped_storage().data_ptr() == st.data_ptr()
        assert a.t().reshape(24).data_ptr() != a.data_ptr()  # reshape copies here
        assert a.clone().data_ptr() != a.data_ptr()
        assert (a + 1).untyped_storage().data_ptr() != st.data_ptr()
        b = torch.zeros(6, device=d)
        ends = sorted([(a.data_ptr(), a.data_ptr() + 96), (b.data_ptr(), b.data_ptr() + 24)])
        assert ends[0][1] <= ends[1][0]  # two live storages never overlap
        assert torch.empty(0, device=d).data_ptr() == 0
        a.unsqueeze_(0)  # geometry changes keep the address
        assert a.data_ptr() == st.data_ptr()
        a.resize_(40)  # growing may move it, and the data comes along
        assert a.untyped_storage().nbytes() == 160
        torch.testing.assert_close(a[:24].cpu(), torch.arange(24.0))
    t = torch.ones(3, device="tpu")
    t.untyped_storage().nbytes()  # a synced size without an address still gets one
    assert t.untyped_storage().data_ptr() == t.data_ptr() != 0
    t.untyped_storage().resize_(0)
    assert t.untyped_storage().data_ptr() == 0
    t.untyped_storage().resize_(12)
    assert t.untyped_storage().data_ptr() != 0


def test_inplace_on_views_updates_base():
    c, t = pair(4, 6)
    for x in (c, t):
        x.t()[1:3, 2].add_(5)
        x[:, 1].mul_(2)
        v = x.view(2, 12)
        v[1, ::3] = 7.0
        x.diagonal().zero_()
        x[2:].transpose(0, 1)[0] = torch.tensor([1.0, 2.0]).to(x.device)
    assert_same(t, c)


def test_view_of_view_write():
    c, t = pair(3, 8)
    for x in (c, t):
        a = x[:, 2:]
        b = a.view(3, 3, 2)[:, 1]
        b.fill_(-1)
    assert_same(t, c)


def test_slicing_assignment_forms():
    c, t = pair(5, 5)
    for x in (c, t):
        x[0] = 1.0
        x[1, 1:4] = torch.arange(3.0).to(x.device)
        x[..., -1] = x[..., 0]
        x[2:4, 2:4] += 10
    assert_same(t, c)


def test_inplace_ops_keep_identity_and_version():
    t = torch.ones(3, device="tpu")
    before = t._version
    same = t.add_(1)
    assert same is t and t._version > before
    assert_same(t, torch.full((3,), 2.0))


def test_type_promotion():
    a = torch.tensor([1, 2, 3], dtype=torch.int32)
    b = torch.tensor([0.5, 1.5, 2.5], dtype=torch.float16)
    assert_same(a.to("tpu") + b.to("tpu"), a + b)
    assert_same(a.to("tpu") * 2.5, a * 2.5)
    assert_same(a.to("tpu") / 2, a / 2)
    assert_same(b.to("tpu") + torch.tensor(1.0, dtype=torch.float64), b + torch.tensor(1.0, dtype=torch.float64))
    x = torch.tensor([1.0, 2.0]).to(torch.bfloat16)
    assert_same(x.to("tpu") * 3, x * 3)


def test_cpu_scalar_tensor_mixes_like_cuda():
    c = torch.randn(3)
    s = torch.tensor(2.0)
    assert_same(c.to("tpu") * s, c * s)


def test_transpose_of_a_flattened_view_reads_and_writes_without_a_gather():
    """grad.view(-1, D).t() (a Linear's weight gradient on a 3-d input) spans two dims of its base:
    it is read as a reshape and a transpose, not as a gather of every element."""
    from torch_tpu.tensor import storage as _storage

    c = torch.randn(2, 3, 4)
    t = c.to("tpu")
    for x in (c, t):
        v = x.view(6, 4).t()
        v[1:3].mul_(-2)
    torch.testing.assert_close(t.cpu(), c)
    torch.testing.assert_close(t.view(6, 4).t().cpu(), c.view(6, 4).t())
    torch.testing.assert_close(t.view(6, 4)[::2].t().cpu(), c.view(6, 4)[::2].t())
    assert _storage._plan((2, 3, 4), (4, 6), (1, 4), 0)[0] == "reshaped"
    assert _storage._plan((2, 3, 4), (4, 3), (1, 8), 0)[0] == "reshaped"


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_heads_of_a_fused_qkv_projection_read_and_write_like_cpu(mode):
    """``q, k, v = qkv.split(D, -1)`` viewed as heads ``[B, H, T, hd]``: each head view is read (and
    written) from its own run of the base, sliced before the reshape to heads (the "cut" plan), not
    from the whole ``[B, T, 3D]`` base reshaped (a relayout copy of all of it on a TPU)."""
    from torch_tpu.tensor import storage as _storage

    B, T, H, hd = 2, 5, 3, 4
    c = torch.randn(B, T, 3 * H * hd)
    with torch_tpu.set_eager_mode(mode):
        t = c.to("tpu")
        read = {}
        for x in (c, t):
            heads = [p.view(B, T, H, hd).transpose(1, 2) for p in x.split(H * hd, -1)]
            heads[1][:, 1:].mul_(-3)  # a write through k's heads reaches qkv
            read[x.device.type] = [h * 1 for h in heads]
        torch.testing.assert_close(t.cpu(), c)
        for a, b in zip(read["tpu"], read["cpu"]):
            torch.testing.assert_close(a.cpu(), b)
    k = t.split(H * hd, -1)[1].view(B, T, H, hd).transpose(1, 2)
    plan = _storage._plan(t.untyped_storage()._shape, tuple(k.shape), k.stride(), k.storage_offset())
    assert plan[0] == "cut" and plan[2] == (B, T, H * hd), plan


def test_storage_resize_like_cpu():
    """``UntypedStorage.resize_`` as FSDP2 uses it (free with resize_(0), re-allocate with resize_(nbytes)),
    and as CPU does it: the leading bytes survive a resize, ``size()``/``nbytes()`` follow it."""
    for device in ("cpu", "tpu"):
        t = torch.arange(6.0, device=device)
        st = t.untyped_storage()
        st.resize_(40)
        assert (st.size(), st.nbytes()) == (40, 40)
        torch.testing.assert_close(torch.as_strided(t, (6,), (1,)).cpu(), torch.arange(6.0))
        st.resize_(16)
        assert st.size() == 16
        torch.testing.assert_close(torch.as_strided(t, (4,), (1,)).cpu(), torch.arange(4.0))
        st.resize_(0)
        assert st.size() == 0
        st.resize_(24)  # re-allocated: a write through a view fills it again
        assert st.size() == 24
        torch.as_strided(t, (6,), (1,)).copy_(torch.full((6,), 2.0))
        torch.testing.assert_close(t.cpu(), torch.full((6,), 2.0))
    t = torch.zeros(4, device="tpu")
    torch.ops.inductor.resize_storage_bytes_(t, 0)  # the op compiled graphs resize with
    assert t.untyped_storage().size() == 0
    torch.ops.inductor.resize_storage_bytes_(t, 16)
    assert t.untyped_storage().size() == 16
    st = torch.zeros(4, device="tpu").untyped_storage()
    assert st.resize_(0) is st
    assert st._jx is None  # resize_(0) frees the device array
    with pytest.raises(RuntimeError, match="whole number"):
        torch.zeros(4, device="tpu").untyped_storage().resize_(6)


def test_storage_free_and_realloc_without_swap(monkeypatch):
    """torch < 2.13 has no UntypedStorage._swap_data_ptr_, so a storage cannot shrink in C++: resize_(0)
    frees the device array but keeps its size, and FSDP2's cycle (alloc when the size differs, write the
    all-gather into a view, free) still reads what it wrote."""
    from torch_tpu.tensor import storage as _storage

    monkeypatch.setattr(_storage, "_CAN_SHRINK", False)
    flat = torch.empty(8, device="tpu")
    st = flat.untyped_storage()
    param = torch.as_strided(flat, (2, 4), (4, 1))
    for step in range(2):
        if st.size() != 32:
            st.resize_(32)
        flat.copy_(torch.arange(8.0) + step)
        torch.testing.assert_close(param.cpu(), (torch.arange(8.0) + step).reshape(2, 4))
        st.resize_(0)
        assert st._jx is None and st.size() == 32
    with pytest.raises(NotImplementedError, match="torch >= 2.13"):
        st.resize_(16)


_VIEW_DTYPES = [torch.bool, torch.uint8, torch.int16, torch.float32, torch.int64, torch.bfloat16,
                torch.complex64, torch.complex128]


def _sample(dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(-50, 50, shape).to(dtype)


def test_view_dtype_to_and_from_bool_and_complex_like_cpu():
    """The same bits as CPU reads them (bool is a byte of 0 or 1; a complex is its two reals),
    with CPU's shapes; and CPU's error where the sizes don't fit."""
    for src in _VIEW_DTYPES:
        c = _sample(src, (3, 16))
        t = c.to("tpu")
        for dst in _VIEW_DTYPES:
            if dst == torch.bool and src != torch.bool:  # other bytes than 0/1 are not bools
                continue
            expected = c.view(dst)
            got = t.view(dst)
            assert got.shape == expected.shape and got.dtype == dst
            torch.testing.assert_close(got.cpu(), expected, equal_nan=True, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match=r"self.dim\(\) cannot be 0"):
        torch.tensor(1.0, device="tpu").view(torch.complex128)


def test_view_dtype_shares_the_storage_like_cpu():
    """view(dtype) is a view: a write through it changes the base's bits, and the other way round,
    also for a slice (its storage offset in the new element size) and a complex view."""
    results = []
    for d in ("cpu", "tpu"):
        a = torch.arange(12.0, device=d).reshape(3, 4)
        halves = a[1:].view(torch.int16)
        assert halves.storage_offset() == 8
        halves[0, 1] = 0x4000  # the high half of a[1, 0]: 2.0
        pairs = a.view(torch.complex64)
        pairs[2, 1] = 7 + 8j
        a[0, 0] = -1.0
        flags = a.view(torch.uint8)[:4].view(torch.bool)  # bytes 0/1 of a float read as bools
        results.append((a.cpu(), halves.cpu(), pairs.cpu(), flags.shape))
    for tpu_value, cpu_value in zip(results[1][:3], results[0][:3]):
        torch.testing.assert_close(tpu_value, cpu_value, rtol=0, atol=0)
    assert results[1][3] == results[0][3]


def test_view_dtype_error_names_the_storage_offset_of_a_slice():
    """A slice keeps its storage offset, so view(dtype) reports the offset as CPU does."""
    for d in ("cpu", "tpu"):
        a = torch.zeros(4, 4, 5, device=d)
        assert a[:, :, 1:].storage_offset() == 1
        with pytest.raises(RuntimeError, match=r"self.storage_offset\(\) must be divisible by 2"):
            a[:, :, 1:].view(torch.complex64)


def test_copies_and_views_like_cpu():
    """Where CPU copies (reshape of a non-contiguous tensor, a[True]), a write into the result
    leaves the source alone; where CPU makes a view, it writes through. (The pointers themselves
    are compared in test_data_ptr_tells_views_from_copies_like_cpu.)"""
    results = []
    for d in ("cpu", "tpu"):
        a = torch.arange(24.0, device=d).reshape(4, 6)
        copied = a.t().reshape(24)
        copied[0] = 100.0
        picked = a[True]
        picked[0, 0, 1] = 55.0
        viewed = a.reshape(2, 12)
        viewed[0, 2] = -1.0
        results.append((a.cpu(), copied._is_view(), picked._is_view(), viewed._is_view()))
    (ca, *cflags), (ta, *tflags) = results
    assert tflags == cflags == [False, False, True]
    torch.testing.assert_close(ta, ca)


@pytest.mark.parametrize("geometry", [
    ((3, 3), (1, 1), 0),  # overlapping, inside the storage
    ((2, 2), (1, 2), 4),  # the last element past the end: CPU refuses rather than read beyond
    ((7,), (1,), 0),
    ((0, 9), (1, 1), 100),  # no elements: any offset
    ((2,), (1,), -1),
    ((2, 3), (3, 1), 0),
])
def test_as_strided_checks_the_storage_bounds_like_cpu(geometry):
    from conftest import like_cpu

    like_cpu(lambda x: x.as_strided(*geometry), torch.arange(6.0))
    # a view of a view is checked against the whole storage, in bytes for a dtype view
    like_cpu(lambda x: x[2:].as_strided((3,), (1,), 3), torch.arange(6.0))
    like_cpu(lambda x: x[2:].as_strided((4,), (1,), 3), torch.arange(6.0))
    like_cpu(lambda x: x.view(torch.int16).as_strided((12,), (1,), 0), torch.arange(6.0))
    like_cpu(lambda x: x.view(torch.int16).as_strided((13,), (1,), 0), torch.arange(6.0))


_STRIDED = [
    lambda x, i: x[:, i % 7],
    lambda x, i: x[i % 6, :, 1::3],
    lambda x, i: x[:, i % 7].t(),
    lambda x, i: x[1:5:2, i % 7, ::2],
    lambda x, i: x[i % 6].t()[2:5],
    lambda x, i: x[:, 1:6:2, i % 8].unsqueeze(1).expand(6, 3, 3),
]


@pytest.mark.parametrize("view", range(len(_STRIDED)))
def test_strided_views_at_many_offsets_read_and_write_like_cpu(view):
    # the same strided window at another offset runs one program with the offset as an argument
    make = _STRIDED[view]
    for i in range(6):
        c, t = pair(6, 7, 8)
        assert torch.equal(make(t, i).cpu(), make(c, i))
        if make(c, i).stride()[0] == 0 or 0 in make(c, i).stride():
            continue  # an expanded view is read-only
        value = torch.randn(make(c, i).shape)
        make(c, i).copy_(value)
        make(t, i).copy_(value.to("tpu"))
        make(c, i).mul_(3)
        make(t, i).mul_(3)
        assert_same(t, c)


def test_jacobian_columns_at_each_offset_compile_once():
    # gradcheck writes a jacobian column per input element: one program for every column, where a
    # program per offset made gradgradcheck of a 686-element input compile 1,400 programs
    from torch_tpu.runtime import metrics

    jac = torch.zeros(40, 50, device="tpu")
    col = torch.randn(40, device="tpu")
    jac[:, 0] = col
    _ = jac[3, 1:9].cpu()
    before = metrics.metrics()["compile_count"]
    for i in range(1, 50):
        jac[:, i] = col
        _ = jac[i % 40, 1:9].cpu()
    assert metrics.metrics()["compile_count"] - before <= 1
    assert torch.equal(jac.cpu(), col.cpu()[:, None].expand(40, 50))


def test_a_host_mask_write_is_a_select_compiled_once_per_shape():
    # ``x[cpu_mask] = v`` used to turn the mask into indices on the host, so each new mask (a new
    # True count) compiled a new scatter; PyTorch's tests fill random masks of one shape many times
    from torch_tpu.runtime import metrics

    def compiles():
        m = metrics.metrics()
        return m["compile_count"] + m["fused_compile_count"]

    c, t = pair(6, 5, 3)
    gen = torch.Generator().manual_seed(0)
    before = None
    for i in range(6):
        mask = torch.rand(6, 5, generator=gen) > 0.3 + 0.1 * i  # a different True count each time
        for value in (float("nan"), -2.0, 7):
            c[mask] = value
            t[mask] = value
        assert_same(t, c)
        if i == 0:
            before = compiles()
    assert compiles() == before
    # the same for a mask of the full shape and a one-element value tensor
    full = torch.rand(6, 5, 3, generator=gen) > 0.5
    c[full] = torch.tensor([3.5])
    t[full] = torch.tensor([3.5], device="tpu")
    assert_same(t, c)


def _writes_through_bit_views(x: torch.Tensor, z: torch.Tensor) -> dict:
    """Writes through negative and conjugate views, then what the bases and views hold."""
    dev = x.device
    got = {}
    v = x._neg_view()
    got["neg flag"] = torch.tensor([v.is_neg(), v[0].is_neg(), v.clone().is_neg()])
    v[1].copy_(torch.tensor([9.0, 8.0, 7.0, 6.0]).to(dev))
    v[:, 2].fill_(5.0)
    v.mul_(2)
    v.t()[0].add_(torch.ones(3, device=dev))
    got["x"] = x.clone()
    got["neg view read"] = v + 0
    got["neg view sum"] = v.sum()
    c = z.conj()
    got["conj flag"] = torch.tensor([c.is_conj(), c.clone().is_conj(), c.resolve_conj().is_conj()])
    c[0].copy_(torch.tensor([1 + 1j, 2 + 2j, 3 - 3j]).to(dev))
    c.add_(1j)
    got["z after conj writes"] = z.clone()
    imag = z.conj().imag  # a negative view of the imaginary parts
    got["imag flag"] = torch.tensor([imag.is_neg()])
    got["imag read"] = imag.clone()
    imag[1].copy_(torch.tensor([4.0, 5.0, 6.0]).to(dev))
    got["z after imag write"] = z.clone()
    into = torch.zeros(2, 3, dtype=torch.complex64, device=dev)
    into.copy_(c)
    got["copy of a conj view"] = into
    return got


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_writes_through_negative_and_conjugate_views_reach_the_base_like_cpu(mode):
    """``x._neg_view()``, ``z.conj()`` and ``z.conj().imag`` are views with a bit: a write through
    one reaches the base (it was lost, a silent wrong answer), reads see the negated or conjugated
    values, and a clone holds the values without the bit, as on CPU."""
    x = torch.arange(12.0).reshape(3, 4)
    z = torch.complex(torch.randn(2, 3), torch.randn(2, 3))
    with torch_tpu.set_eager_mode(mode):
        got = _writes_through_bit_views(x.to("tpu"), z.to("tpu"))
        got = {k: v.cpu() for k, v in got.items()}
    want = _writes_through_bit_views(x, z)
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)


_CONJ_PRODUCTS = {
    "mm": lambda a, b, c: torch.mm(a.conj(), b),
    "mm of a conj transpose": lambda a, b, c: a.mH @ b,
    "matmul right": lambda a, b, c: a @ b.conj(),
    "addmm": lambda a, b, c: torch.addmm(c.conj(), a.conj(), b.conj()),
    "addmm_ into a conj view": lambda a, b, c: c.conj().addmm_(a, b) + c,
    "bmm": lambda a, b, c: torch.bmm(a.conj()[None], b[None]),
    "baddbmm": lambda a, b, c: torch.baddbmm(c[None], a[None], b.conj()[None]),
    "dot": lambda a, b, c: torch.dot(a[0].conj(), b[:, 0]),
    "vdot": lambda a, b, c: torch.vdot(a[0], b[:, 0].conj()),
    "solve_triangular": lambda a, b, c: torch.linalg.solve_triangular(
        (a.triu() + 4 * torch.eye(3, device=a.device)).conj(), b.conj(), upper=True),
    "conj of a neg imag": lambda a, b, c: a.conj().imag * 2,
}


@pytest.mark.parametrize("name", list(_CONJ_PRODUCTS))
def test_matrix_products_read_conjugate_views_like_cpu(name):
    """torch hands matrix products a conjugate view unresolved (CPU's BLAS reads it conjugated):
    our lowerings see the conjugated values, and an in-place product writes under the bit."""
    f = _CONJ_PRODUCTS[name]
    a, b, c = (torch.complex(torch.randn(3, 3), torch.randn(3, 3)) for _ in range(3))
    like_cpu(f, a, b, c)


def test_gradients_through_a_conjugate_product_like_cpu():
    a = torch.complex(torch.randn(3, 3), torch.randn(3, 3))
    grads = []
    for dev in ("cpu", "tpu"):
        leaf = a.to(dev, copy=True).requires_grad_()
        (leaf @ leaf.conj().T).abs().sum().backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0])


def test_copy_from_tpu_into_a_cpu_negative_view_like_cpu():
    src = torch.arange(4.0)
    want, got = torch.zeros(4), torch.zeros(4)
    want._neg_view().copy_(src)
    got._neg_view().copy_(src.to("tpu"))
    torch.testing.assert_close(got, want)


_VIEW_BATTERY = """
import torch, torch_tpu
from torch_tpu.dispatch import op_kernel
x = torch.arange(24.0).reshape(2, 3, 4)
t = x.to("tpu")
views = (
    lambda a: a.transpose(0, 2), lambda a: a[:, 1:, ::2], lambda a: a.view(6, 4), lambda a: a.unfold(2, 2, 1),
    lambda a: a.flatten(), lambda a: a.as_strided((3, 3), (2, 1), 1), lambda a: a.unsqueeze(0).expand(2, 2, 3, 4),
    lambda a: a.view(torch.int32)[0], lambda a: a[1].t().reshape(12), lambda a: a.select(1, 2).diagonal(),
)
for make in views:
    c, d = make(x), make(t)
    assert (d.shape, d.stride(), d.storage_offset(), d.dtype) == (c.shape, c.stride(), c.storage_offset(), c.dtype)
    assert torch.equal(d.cpu(), c)
    shares = d.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert shares == (c.untyped_storage().data_ptr() == x.untyped_storage().data_ptr())
for bad in (lambda a: a.as_strided((5, 6), (6, 1)), lambda a: a.transpose(0, 2).view(24), lambda a: a.unfold(2, 5, 1)):
    errors = []
    for a in (x, t):
        try:
            bad(a)
            errors.append(None)
        except Exception as e:
            errors.append((type(e), str(e)))
    assert errors[0] is not None and errors[0] == errors[1], errors
torch_tpu.reset_metrics()
t.t() if t.dim() == 2 else t.transpose(1, 2)[0]
print(op_kernel.REGISTERED["aten.as_strided.default"], torch_tpu.metrics()["op_counts"].get("aten.as_strided.default"))
"""


def test_views_are_cpus_own_kernels_and_count_in_metrics():
    """With the C++ extension the tpu views are CPU's own kernels (csrc/views.cpp): the same sizes,
    strides, offsets, storage and errors as CPU, each call still counted in metrics(), which a reset
    clears."""
    import subprocess
    import sys

    from torch_tpu.core import extension

    if not extension.views_in_cpp():
        pytest.skip(f"the C++ extension serves no views here: {extension.why_not() or 'TORCH_TPU_PYTHON_VIEWS=1'}")
    from torch_tpu.dispatch import op_kernel

    assert op_kernel.REGISTERED["aten.as_strided.default"] == "view (C++)"
    namespace: dict = {}
    exec(_VIEW_BATTERY, namespace)  # noqa: S102 - the same checks as the Python kernels' run below
    x = torch.arange(12.0, device="tpu").reshape(3, 4)
    torch_tpu.reset_metrics()
    x.t()[1:]
    x.view(12)
    counts = torch_tpu.metrics()["op_counts"]
    assert counts.get("aten.as_strided.default") == 2 and counts.get("aten.view.default") == 1, counts
    torch_tpu.reset_metrics()
    assert "aten.as_strided.default" not in torch_tpu.metrics()["op_counts"]
    # the Python kernels (without the extension, or TORCH_TPU_PYTHON_VIEWS=1) pass the same checks
    import os

    r = subprocess.run([sys.executable, "-c", _VIEW_BATTERY], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TORCH_TPU_PYTHON_VIEWS": "1"})
    assert r.returncode == 0 and r.stdout.split()[-3:] == ["view", "(meta)", "2"], (r.stdout, r.stderr[-3000:])
