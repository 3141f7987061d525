"""Shape, factory, random and linear-algebra ops against CPU."""

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


# ------------------------------------------------------------------------------------ shape
def test_shape_ops_match_cpu():
    c, t = pair(3, 4)
    i = torch.tensor([3, 1, 2, 3, 1, 1])
    cases = [
        lambda x, d: torch.cat([x, d(torch.empty(0)), x[:1]]),
        lambda x, d: torch.cat([x, d(torch.ones(3, 2, dtype=torch.int64))], dim=1),  # promotes
        lambda x, d: torch.stack([x, x * 2], dim=-1),
        lambda x, d: x.flip(0, 1),
        lambda x, d: x.roll(2),
        lambda x, d: x.roll((1, -1), (0, 1)),
        lambda x, d: x.repeat(2, 1, 3),
        lambda x, d: x.tile((2,)),
        lambda x, d: torch.constant_pad_nd(x, [1, -1, 2, 0], 3.5),
        lambda x, d: x.tril(-1),
        lambda x, d: x.triu(1),
        lambda x, d: torch.diag_embed(x, 1, 0, 2),
        lambda x, d: torch.diag(x[0]),
        lambda x, d: torch.linalg.cross(x[:, :3], x[:, 1:]),
        lambda x, d: torch.kron(x, x[:2, :2]),
        lambda x, d: torch.searchsorted(d(torch.tensor([0.0, 1.0, 2.0])), x, right=True),
        lambda x, d: torch.bucketize(x, d(torch.tensor([-1.0, 0.0, 1.0]))),
        lambda x, d: torch.histc(x, 5),
        lambda x, d: torch.histc(x, 4, -1, 1),
        lambda x, d: torch.bincount(d(i)),
        lambda x, d: torch.bincount(d(i), d(torch.arange(6.0)), minlength=7),
        lambda x, d: torch.unique(d(i), return_inverse=True, return_counts=True),
        lambda x, d: torch.unique_consecutive(d(i), return_inverse=True, return_counts=True),
        lambda x, d: torch.unique(d(torch.tensor([[1, 2], [0, 1], [1, 2]])), dim=0, return_inverse=True),
        lambda x, d: torch.repeat_interleave(d(torch.tensor([2, 0, 3]))),
        lambda x, d: x.repeat_interleave(d(torch.tensor([1, 2, 0])), dim=0),
    ]
    for f in cases:
        out_t, out_c = f(t, tpu), f(c, lambda a: a)
        for a, b in zip(out_t if isinstance(out_t, tuple) else [out_t], out_c if isinstance(out_c, tuple) else [out_c]):
            assert_same(a, b)


def test_bincount_errors_like_cpu():
    for f in [lambda d: torch.bincount(d(torch.tensor([-1]))), lambda d: torch.bincount(d(torch.ones(2)))]:
        with pytest.raises(Exception) as e:
            f(lambda a: a)
        with pytest.raises(e.type):
            f(tpu)


# -------------------------------------------------------------------------------- factories
def test_factories_match_cpu():
    cases = [
        lambda **k: torch.arange(10, **k),
        lambda **k: torch.arange(1, 4, 0.3, **k),
        lambda **k: torch.arange(-5, 5, 2, dtype=torch.float32, **k),
        lambda **k: torch.full((2, 3), 1.5, **k),
        lambda **k: torch.zeros(2, 3, dtype=torch.int32, **k),
        lambda **k: torch.ones(4, **k),
        lambda **k: torch.scalar_tensor(3, **k),
        lambda **k: torch.linspace(-1, 1, 7, **k),
        lambda **k: torch.linspace(-3, 10, 7, dtype=torch.int64, **k),
        lambda **k: torch.logspace(0, 2, 5, base=2.0, **k),
        lambda **k: torch.eye(3, 4, **k),
        lambda **k: torch.tril_indices(4, 3, -1, **k),
        lambda **k: torch.triu_indices(3, 5, 1, **k),
    ]
    torch_tpu.reset_metrics()
    for f in cases:
        assert_same(f(device="tpu"), f())
    assert torch_tpu.metrics()["fallback_counts"] == {}


def test_arange_out_and_errors():
    out = torch.empty(0, device="tpu", dtype=torch.int32)
    torch.arange(2, 9, 3, out=out)
    assert_same(out, torch.arange(2, 9, 3, dtype=torch.int32))
    with pytest.raises(RuntimeError):
        torch.arange(0, 5, 0, device="tpu")
    with pytest.raises(RuntimeError):
        torch.arange(5, 0, 1, device="tpu")


def test_empty_like_is_uninitialised_but_usable():
    t = torch.empty_like(torch.ones(3, device="tpu"))
    assert t.shape == (3,) and t.device.type == "tpu"


# ----------------------------------------------------------------------------------- random
def _draws():
    x = torch.empty(1000, device="tpu")
    return [
        torch.rand(5, device="tpu"),
        torch.randn(5, device="tpu"),
        torch.randint(0, 10, (5,), device="tpu"),
        torch.randperm(7, device="tpu"),
        x.clone().uniform_(2, 3),
        x.clone().bernoulli_(0.3),
        torch.multinomial(torch.ones(6, device="tpu"), 4),
    ]


def test_manual_seed_reproduces():
    torch.manual_seed(123)
    a = [t.cpu() for t in _draws()]
    torch.manual_seed(123)
    b = [t.cpu() for t in _draws()]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    torch.manual_seed(124)
    assert not torch.equal(torch.rand(5, device="tpu").cpu(), a[0])


def test_distributions_roughly_right():
    n = 200_000
    x = torch.empty(n, device="tpu")

    def stats(t):
        t = t.cpu().double()
        return t.mean().item(), t.var().item()

    m, v = stats(x.uniform_(-1, 3))
    assert abs(m - 1) < 0.02 and abs(v - 16 / 12) < 0.03
    m, v = stats(x.normal_(2, 3))
    assert abs(m - 2) < 0.03 and abs(v - 9) < 0.15
    m, v = stats(torch.normal(torch.zeros(n, device="tpu"), torch.full((n,), 2.0, device="tpu")))
    assert abs(m) < 0.03 and abs(v - 4) < 0.1
    m, _ = stats(x.exponential_(2.0))
    assert abs(m - 0.5) < 0.01
    m, _ = stats(x.geometric_(0.25))
    assert abs(m - 4) < 0.05 and x.min().item() >= 1
    m, _ = stats(x.bernoulli_(0.3))
    assert abs(m - 0.3) < 0.01
    m, _ = stats(torch.bernoulli(torch.full((n,), 0.7, device="tpu")))
    assert abs(m - 0.7) < 0.01
    m, _ = stats(x.log_normal_(0.0, 0.5))
    assert abs(m - 1.1331) < 0.01
    med = x.cauchy_(1.0, 2.0).cpu().median().item()
    assert abs(med - 1.0) < 0.05
    r = x.random_(3, 8).cpu()
    assert r.min().item() == 3 and r.max().item() == 7
    r = torch.empty(n, dtype=torch.int64, device="tpu").random_(5).cpu()
    assert r.min().item() == 0 and r.max().item() == 4
    assert sorted(torch.randperm(50, device="tpu").cpu().tolist()) == list(range(50))
    s = torch.multinomial(torch.tensor([0.0, 1.0, 3.0], device="tpu"), 20000, replacement=True).cpu()
    assert (s != 0).all() and abs((s == 2).double().mean().item() - 0.75) < 0.02
    s = torch.multinomial(torch.tensor([[0.0, 1.0, 3.0, 1.0]], device="tpu"), 3).cpu()
    assert sorted(s[0].tolist()) == [1, 2, 3]


def test_random_argument_errors():
    t = torch.empty(4, device="tpu")
    for f in [
        lambda x: x.uniform_(3, 2),
        lambda x: x.normal_(0, -1),
        lambda x: x.bernoulli_(1.5),
        lambda x: x.random_(5, 3),
        lambda x: torch.multinomial(x.fill_(0), 2),
        lambda x: torch.multinomial(torch.ones_like(x), 5),
    ]:
        with pytest.raises(RuntimeError):
            f(t)


def test_dropout_scales_kept_values():
    x = torch.ones(10000, device="tpu")
    out, mask = torch.ops.aten.native_dropout(x, 0.25, True)
    o, m = out.cpu(), mask.cpu()
    assert m.dtype == torch.bool
    assert torch.allclose(o[m], torch.full_like(o[m], 1 / 0.75)) and (o[~m] == 0).all()
    assert abs(m.double().mean().item() - 0.75) < 0.02
    y = torch.nn.functional.dropout(x, 0.5, training=True).cpu()
    assert set(y.unique().tolist()) <= {0.0, 2.0}
    assert torch.equal(torch.nn.functional.dropout(x, 0.5, training=False).cpu(), x.cpu())
    xr = torch.ones(8, device="tpu", requires_grad=True)
    out = torch.nn.functional.dropout(xr, 0.5)
    (g,) = torch.autograd.grad(out.sum(), xr)
    assert torch.equal(g.cpu(), out.detach().cpu())


# ----------------------------------------------------------------------------------- linalg
def test_products_match_cpu():
    a, ta = pair(3, 4)
    b, tb = pair(4, 5)
    ba, tba = pair(2, 3, 4)
    bb, tbb = pair(2, 4, 5)
    v, tv = pair(4)
    c, tc = pair(3, 5)
    assert_same(ta @ tb, a @ b)
    assert_same(torch.bmm(tba, tbb), torch.bmm(ba, bb))
    assert_same(torch.addmm(tc, ta, tb, beta=0.5, alpha=2), torch.addmm(c, a, b, beta=0.5, alpha=2))
    assert_same(torch.mv(ta, tv), torch.mv(a, v))
    assert_same(torch.dot(tv, tv), torch.dot(v, v))
    assert_same(torch.baddbmm(tc, tba, tbb), torch.baddbmm(c, ba, bb))
    assert_same(torch.addbmm(tc, tba, tbb, alpha=0.5), torch.addbmm(c, ba, bb, alpha=0.5))
    assert_same(torch.addr(ta, ta[:, 0], tv), torch.addr(a, a[:, 0], v))
    nan = torch.full((3, 5), float("nan"))
    assert_same(torch.addmm(tpu(nan), ta, tb, beta=0), torch.addmm(nan, a, b, beta=0))
    assert_same(tba.half() @ tbb.half(), ba.half() @ bb.half(), rtol=1e-2, atol=1e-2)


def test_matmul_precision_setting_is_honoured():
    a, ta = pair(64, 64)
    old = torch.get_float32_matmul_precision()
    try:
        for p in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(p)
            assert_same(ta @ ta, a @ a, rtol=1e-2, atol=1e-2)
    finally:
        torch.set_float32_matmul_precision(old)


def test_factorizations_match_cpu():
    a = torch.randn(4, 4)
    spd = a @ a.T + 4 * torch.eye(4)
    b = torch.randn(4, 2)
    ta, tspd, tb = tpu(a), tpu(spd), tpu(b)
    assert_same(torch.linalg.cholesky(tspd), torch.linalg.cholesky(spd))
    chol, tchol = torch.linalg.cholesky(spd), torch.linalg.cholesky(tspd)
    assert_same(torch.cholesky_solve(tb, tchol), torch.cholesky_solve(b, chol))
    assert_same(torch.cholesky_inverse(torch.linalg.cholesky(tspd)), torch.cholesky_inverse(torch.linalg.cholesky(spd)))
    assert_same(torch.linalg.inv(ta), torch.linalg.inv(a))
    assert_same(torch.linalg.det(ta), torch.linalg.det(a))
    for x, y in zip(torch.linalg.slogdet(ta), torch.linalg.slogdet(a)):
        assert_same(x, y)
    assert_same(torch.linalg.solve(ta, tb), torch.linalg.solve(a, b))
    assert_same(torch.linalg.solve(ta, tb.T, left=False), torch.linalg.solve(a, b.T, left=False))
    for x, y in zip(torch.linalg.lu_factor(ta), torch.linalg.lu_factor(a)):
        assert_same(x, y)
    for x, y in zip(torch.linalg.lu(ta), torch.linalg.lu(a)):
        assert_same(x, y, atol=1e-4, rtol=1e-3)
    lu, piv = torch.linalg.lu_factor(a)
    expect = torch.linalg.lu_solve(lu, piv, b, adjoint=True)
    assert_same(torch.linalg.lu_solve(tpu(lu), tpu(piv), tb, adjoint=True), expect)
    u = a.triu()
    assert_same(torch.linalg.solve_triangular(tpu(u), tb, upper=True), torch.linalg.solve_triangular(u, b, upper=True))
    assert_same(torch.linalg.eigvalsh(tspd), torch.linalg.eigvalsh(spd))
    assert_same(torch.linalg.svdvals(ta), torch.linalg.svdvals(a))
    q, r = torch.linalg.qr(ta)
    assert_same(q @ r, a, atol=1e-4, rtol=1e-3)
    w, v = torch.linalg.eigh(tspd)  # vectors are defined up to sign: check the decomposition
    assert_same(v @ torch.diag(w) @ v.T, spd, atol=1e-3, rtol=1e-3)


def test_linalg_errors_like_cpu():
    bad = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    with pytest.raises(torch.linalg.LinAlgError, match="order 2"):
        torch.linalg.cholesky(tpu(bad))
    L, info = torch.linalg.cholesky_ex(tpu(bad))
    assert info.item() == 2
    with pytest.raises(torch.linalg.LinAlgError, match="singular"):
        torch.linalg.inv(torch.zeros(3, 3, device="tpu"))
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.solve(torch.zeros(2, 2, device="tpu"), torch.ones(2, device="tpu"))


def test_linalg_gradients_match_cpu():
    a = torch.randn(4, 4)
    for f in [torch.linalg.det, lambda x: torch.linalg.inv(x).sum(), lambda x: (x @ x.T).trace()]:
        x = a.clone().requires_grad_()
        (gc,) = torch.autograd.grad(f(x), x)
        y = tpu(a).requires_grad_()
        (gt,) = torch.autograd.grad(f(y), y)
        assert_same(gt, gc, rtol=1e-3, atol=1e-3)
