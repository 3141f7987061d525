"""Shape, factory, random and linear-algebra ops against CPU."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same, like_cpu
from torch.utils._pytree import tree_leaves

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
        for p in ("highest", "high"):
            torch.set_float32_matmul_precision(p)
            assert_same(ta @ ta, a @ a, rtol=1e-2, atol=1e-2)
        # 'medium' lets a float32 product round its inputs to bfloat16 where the hardware has a fast
        # bfloat16 product (TPUs; XLA:CPU on a CPU with AMX or AVX512-BF16), and not elsewhere: the
        # result is one of the two, never anything else
        torch.set_float32_matmul_precision("medium")
        got = (ta @ ta).cpu()
        rounded = a.bfloat16().float()
        torch.set_float32_matmul_precision("highest")
        full, bf16 = a @ a, rounded @ rounded
        assert torch.allclose(got, full, rtol=1e-4, atol=1e-4) or torch.allclose(got, bf16, rtol=1e-4, atol=1e-3), (
            (got - full).abs().max(), (got - bf16).abs().max())
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


# ------------------------------------------- distances, matrix functions, QR pieces, lstsq, eig
class _NoFallback:
    """Asserts that the block adds no CPU fallback."""

    def __enter__(self):
        self.before = dict(torch_tpu.metrics()["fallback_counts"])

    def __exit__(self, *exc):
        if exc[0] is None:
            assert dict(torch_tpu.metrics()["fallback_counts"]) == self.before


def _fwd_bwd(f, *inputs, grad_args=None):
    """f on CPU and tpu, outputs and the gradients (uneven cotangent) of the float outputs."""
    grad_args = range(len(inputs)) if grad_args is None else grad_args

    def run(dev):
        xs = [x.to(dev) for x in inputs]
        for i in grad_args:
            xs[i].requires_grad_()
        out = f(*xs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        fl = [o for o in outs if o.requires_grad]
        total = sum((o * (torch.arange(o.numel()) % 5 + 1).reshape(o.shape).to(dev, o.dtype)).sum() for o in fl)
        gs = torch.autograd.grad(total, [xs[i] for i in grad_args]) if fl else ()
        return outs, gs

    return run("cpu"), run("tpu")


def _check(f, *inputs, grad_args=None, rtol=1e-3, atol=1e-4):
    (co, cg), (to, tg) = _fwd_bwd(f, *inputs, grad_args=grad_args)
    for c, t in zip(co, to):
        assert_same(t.detach(), c.detach(), rtol=rtol, atol=atol, equal_nan=True)
    for c, t in zip(cg, tg):
        assert_same(t, c, rtol=rtol, atol=atol, equal_nan=True)


def test_cdist_matches_cpu_without_fallback():
    a, b = torch.randn(2, 6, 4), torch.randn(2, 7, 4)
    b[:, 0] = a[:, 0]  # a zero distance: CPU's gradient is zero there
    with _NoFallback():
        for p in [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, float("inf")]:
            _check(lambda x, y, p=p: torch.cdist(x, y, p=p, compute_mode="donot_use_mm_for_euclid_dist"), a, b)
        _check(lambda x, y: torch.cdist(x, y), torch.randn(30, 3), torch.randn(28, 3))  # the matrix-product path
        _check(lambda x, y: torch.cdist(x, y, p=1.0), torch.randn(1, 4, 3), torch.randn(3, 5, 3))  # broadcast batch


def test_matrix_exp_rounds_like_cpu():
    a = torch.randn(5, 5, 5) * 3  # large norms: scaling and squaring
    with _NoFallback():
        assert_same(torch.linalg.matrix_exp(tpu(a)), torch.linalg.matrix_exp(a), rtol=1e-3, atol=1e-4)
        for scale in [1e-8, 1e-4, 1e-2, 0.3, 1.0, 2.0]:  # every Taylor degree
            _check(torch.linalg.matrix_exp, torch.randn(3, 4, 4) * scale / 4)
        _check(torch.linalg.matrix_exp, torch.randn(2, 1, 1))
        _check(torch.linalg.matrix_exp, torch.randn(12, 12) / 3, rtol=1e-3, atol=1e-3)  # the BLAS-sized path
        _check(torch.linalg.matrix_exp, torch.randn(4, 4, dtype=torch.float64))


def test_householder_geqrf_ormqr_match_cpu():
    a = torch.randn(2, 6, 4)
    with _NoFallback():
        h, tau = torch.geqrf(tpu(a))
        hc, tauc = torch.geqrf(a)
        assert_same(h, hc, rtol=1e-3, atol=1e-4)
        assert_same(tau, tauc, rtol=1e-3, atol=1e-4)
        _check(torch.linalg.householder_product, hc, tauc)
        _check(torch.linalg.householder_product, hc, tauc[..., :2])
        c = torch.randn(2, 6, 3)
        for left, tr in [(True, False), (True, True)]:
            _check(lambda x, t, y, left=left, tr=tr: torch.ormqr(x, t, y, left=left, transpose=tr), hc, tauc, c)
        _check(lambda x, t, y: torch.ormqr(x, t, y, left=False, transpose=True), hc, tauc, torch.randn(2, 3, 6))
    with pytest.raises(RuntimeError):
        torch.geqrf(torch.randn(3, device="tpu"))
    with pytest.raises(NotImplementedError):
        torch.geqrf(torch.randn(3, 3, device="tpu", dtype=torch.float16))


def test_lstsq_drivers_match_cpu():
    deficient = torch.randn(5, 3)
    deficient[:, 2] = deficient[:, 0] + deficient[:, 1]
    cases = [(torch.randn(4, 3), torch.randn(4, 2)), (torch.randn(2, 3), torch.randn(2, 2)),
             (torch.randn(2, 5, 3), torch.randn(2, 5)), (torch.randn(1, 4, 3), torch.randn(2, 4, 2)),
             (deficient, torch.randn(5, 2)), (torch.randn(4, 0), torch.randn(4, 2))]
    with _NoFallback():
        for a, b in cases:
            for driver in [None, "gels", "gelsy", "gelsd", "gelss"]:
                if driver == "gels" and a is deficient:
                    continue
                got = torch.linalg.lstsq(tpu(a), tpu(b), driver=driver)
                want = torch.linalg.lstsq(a, b, driver=driver)
                for g, w in zip(got, want):
                    assert_same(g, w, rtol=1e-3, atol=1e-4)
        _check(lambda x, y: torch.linalg.lstsq(x, y).solution, torch.randn(5, 3), torch.randn(5, 2))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.linalg.lstsq(torch.randn(3, 2, device="tpu"), torch.randn(3, 2, device="tpu", dtype=torch.float64))
    with pytest.raises(RuntimeError, match="driver"):
        torch.linalg.lstsq(torch.randn(3, 2, device="tpu"), torch.randn(3, 2, device="tpu"), driver="foo")


def test_eig_matches_cpu_up_to_vector_sign():
    """Eigenvalues match; real inputs' eigenvectors match up to sign (jaxlib's LAPACK is not
    CPU's MKL), which is what PyTorch's own OpInfo compares (their absolute values)."""
    with _NoFallback():
        for a in [torch.randn(5, 5), torch.randn(3, 4, 4), torch.randn(4, 4, dtype=torch.complex64)]:
            w, v = torch.linalg.eig(tpu(a))
            wc, vc = torch.linalg.eig(a)
            assert_same(w, wc, rtol=1e-3, atol=1e-4)
            assert_same(v.abs(), vc.abs(), rtol=1e-3, atol=1e-4)
            assert_same(torch.linalg.eigvals(tpu(a)), torch.linalg.eigvals(a), rtol=1e-3, atol=1e-4)
        _check(lambda x: [t.abs() for t in torch.linalg.eig(x)], torch.randn(4, 4))


def test_histograms_match_cpu():
    x, w100 = torch.randn(100), torch.rand(100)
    y, w50 = torch.randn(50, 3), torch.rand(50)
    cases = [
        lambda d: torch.histogram(d(x), 10),
        lambda d: torch.histogram(d(x), 10, range=(-1.0, 1.0), density=True),
        lambda d: torch.histogram(d(x), 10, weight=d(w100), density=True),
        lambda d: torch.histogram(d(x), d(torch.tensor([-1.0, 0.0, 0.5, 2.0]))),
        lambda d: torch.histogram(d(torch.ones(5)), 3),
        lambda d: torch.histogram(d(torch.empty(0)), 3),
        lambda d: torch.histogramdd(d(y), [3, 4, 5], weight=d(w50), density=True),
        lambda d: torch.histogramdd(d(y), [3, 4, 5], range=[-1.0, 1.0, -2.0, 2.0, 0.0, 1.0]),
        lambda d: torch.histogramdd(d(y), [d(torch.tensor([-1.0, 0.0, 1.0])), d(torch.tensor([-2.0, 0.0, 2.0])),
                                           d(torch.tensor([0.0, 1.0]))]),
    ]
    with _NoFallback():
        for f in cases:
            got, want = tree_leaves(tuple(f(tpu))), tree_leaves(tuple(f(lambda t: t)))
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert_same(g, w)
    for bad in [lambda d: torch.histogram(d(x), 0), lambda d: torch.histogram(d(x), 3, range=(2.0, 1.0)),
                lambda d: torch.histogram(d(torch.tensor([1.0, float("nan")])), 3),
                lambda d: torch.histogramdd(d(y), [3, 4])]:
        with pytest.raises(RuntimeError):
            bad(tpu)
    with pytest.raises(NotImplementedError):
        torch.histogram(tpu(x.long()), 3)


def test_segment_reduce_matches_cpu():
    d = torch.randn(7, 3)
    lengths = torch.tensor([2, 0, 3, 2])
    offsets = torch.tensor([0, 2, 2, 5, 7])
    with _NoFallback():
        for reduce in ["sum", "mean", "max", "min", "prod"]:
            for initial in [None, 0.5]:
                _check(lambda x, r=reduce, i=initial: torch.segment_reduce(x, r, lengths=tpu_like(x, lengths),
                                                                            initial=i).nan_to_num(0, 0, 0), d)
                _check(lambda x, r=reduce, i=initial: torch.segment_reduce(x, r, offsets=tpu_like(x, offsets),
                                                                            initial=i).nan_to_num(0, 0, 0), d)
        ties = torch.tensor([1.0, 3.0, 3.0, 2.0, 5.0, 5.0, 5.0])
        _check(lambda x: -torch.segment_reduce(x, "max", lengths=tpu_like(x, torch.tensor([3, 4]))), ties)
        zeros = torch.tensor([1.0, 3.0, 0.0, 2.0, 0.0, 5.0, 0.0])
        _check(lambda x: torch.segment_reduce(x, "prod", lengths=tpu_like(x, torch.tensor([3, 4]))), zeros)
    with pytest.raises(RuntimeError, match="negative"):
        torch.segment_reduce(tpu(d), "sum", lengths=tpu(torch.tensor([2, -1, 6])))
    with pytest.raises(RuntimeError, match="sum to"):
        torch.segment_reduce(tpu(d), "sum", lengths=tpu(torch.tensor([3, 3])))


def tpu_like(ref, t):
    return t.to(ref.device)


def test_hash_tensor_matches_cpu():
    cases = [(torch.tensor([1.5, 2.25, -3.0]), {}), (torch.randn(3, 4), {"dim": 1}),
             (torch.randn(3, 4), {"dim": [0], "keepdim": True}), (torch.tensor([-1, 5], dtype=torch.int8), {}),
             (torch.tensor([True, False, True]), {}), (torch.randn(2, 3).half(), {})]
    with _NoFallback():
        for x, kw in cases:
            got, want = torch.hash_tensor(tpu(x), **kw), torch.hash_tensor(x, **kw)
            assert got.dtype == want.dtype == torch.uint64 and got.shape == want.shape
            assert torch.equal(got.cpu().view(torch.int64), want.view(torch.int64))


def test_grid_sampler_3d_matches_cpu():
    x, g = torch.randn(2, 3, 4, 5, 6), torch.rand(2, 3, 4, 2, 3) * 3 - 1.5
    with _NoFallback():
        for mode in ["bilinear", "nearest"]:
            for pad in ["zeros", "border", "reflection"]:
                for ac in [False, True]:
                    _check(lambda a, b, m=mode, p=pad, c=ac: torch.nn.functional.grid_sample(
                        a, b, mode=m, padding_mode=p, align_corners=c), x, g)


def test_antialiased_upsampling_matches_cpu():
    x = torch.randn(2, 3, 10, 20)
    with _NoFallback():
        for mode in ["bilinear", "bicubic"]:
            for kw in [{"size": (3, 3)}, {"size": (25, 7)}, {"size": (10, 5)}, {"scale_factor": (1.7, 0.9)}]:
                for ac in [False, True]:
                    _check(lambda a, m=mode, k=kw, c=ac: torch.nn.functional.interpolate(
                        a, mode=m, antialias=True, align_corners=c, **k), x)


def test_ctc_loss_matches_cpu():
    T, N, C = 12, 4, 6
    lp = torch.randn(T, N, C).log_softmax(-1)
    targets = torch.randint(1, C, (N, 5))
    flat = torch.cat([targets[0, :5], targets[1, :3], targets[3, :4]])
    F = torch.nn.functional
    with _NoFallback():
        for red in ["none", "mean", "sum"]:
            _check(lambda x, r=red: F.ctc_loss(x, tpu_like(x, targets), [12, 10, 8, 12], [5, 3, 0, 4], reduction=r),
                   lp)
        _check(lambda x: F.ctc_loss(x, tpu_like(x, flat), [12, 10, 8, 12], [5, 3, 0, 4], reduction="none"), lp)
        _check(lambda x: F.ctc_loss(x, tpu_like(x, targets - 1), [12, 10, 8, 12], [5, 3, 1, 4], blank=C - 1,
                                    reduction="none"), lp)
        for zi in [False, True]:  # an impossible alignment: inf loss (NaN gradient unless zero_infinity)
            _check(lambda x, z=zi: F.ctc_loss(x, tpu_like(x, targets), [3, 10, 8, 12], [5, 3, 0, 4],
                                              reduction="none", zero_infinity=z), lp)


def test_ldl_factor_and_solve_match_cpu_pivots():
    """Bunch-Kaufman pivots (2x2 blocks too: small diagonals force them) equal LAPACK's."""
    with _NoFallback():
        for dtype in [torch.float32, torch.complex64]:
            for hermitian in [False, True]:
                a = torch.randn(3, 6, 6, dtype=dtype)
                a.diagonal(dim1=-2, dim2=-1).mul_(0.001)
                s = a + (a.mH if hermitian else a.mT)
                ld, piv, info = torch.linalg.ldl_factor_ex(tpu(s), hermitian=hermitian)
                ldc, pivc, infoc = torch.linalg.ldl_factor_ex(s, hermitian=hermitian)
                assert (pivc < 0).any()
                assert torch.equal(piv.cpu(), pivc) and torch.equal(info.cpu(), infoc)
                assert_same(ld, ldc, rtol=1e-3, atol=1e-4)
                b = torch.randn(3, 6, 2, dtype=dtype)
                assert_same(torch.linalg.ldl_solve(ld, piv, tpu(b), hermitian=hermitian),
                            torch.linalg.ldl_solve(ldc, pivc, b, hermitian=hermitian), rtol=1e-3, atol=1e-4)
        singular = torch.zeros(2, 3, 3)
        singular[1, 2, 2] = 1.0
        _, piv, info = torch.linalg.ldl_factor_ex(tpu(singular))
        _, pivc, infoc = torch.linalg.ldl_factor_ex(singular)
        assert torch.equal(piv.cpu(), pivc) and torch.equal(info.cpu(), infoc)


def test_out_overloads_of_kernel_ops_match_cpu_without_fallback():
    # geqrf, lstsq and histogram are hand-written kernels; their out= overloads run the kernel and
    # copy into (resized) out tensors, like CPU, instead of falling back.
    torch.manual_seed(0)
    a, b, x = torch.randn(5, 3), torch.randn(5, 2), torch.randn(100)

    def outs(dev, *dtypes):
        return tuple(torch.empty(0, dtype=d, device=dev) for d in dtypes)

    with _NoFallback():
        for dev in ("cpu", "tpu"):
            got = {
                "geqrf": torch.geqrf(tpu(a) if dev == "tpu" else a, out=outs(dev, torch.float32, torch.float32)),
                "lstsq": torch.linalg.lstsq(
                    tpu(a) if dev == "tpu" else a, tpu(b) if dev == "tpu" else b, driver="gelsd",
                    out=outs(dev, torch.float32, torch.float32, torch.int64, torch.float32),
                ),
                "histogram": torch.histogram(tpu(x) if dev == "tpu" else x, bins=7,
                                             out=outs(dev, torch.float32, torch.float32)),
            }
            if dev == "cpu":
                want = got
        for k in want:
            for w, g in zip(want[k], got[k]):
                assert g.device.type == "tpu"
                torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4, msg=k)
        with pytest.raises(RuntimeError, match="geqrf"):
            torch.geqrf(tpu(a), out=outs("tpu", torch.int64, torch.float32))


def test_gamma_and_dirichlet_sampling_on_device():
    # torch.distributions' Gamma, Beta and Dirichlet draw through these two ops
    torch.manual_seed(0)
    with _NoFallback():
        alpha = torch.rand(20000) * 3 + 0.2
        g = torch._standard_gamma(alpha.to("tpu")).cpu()
        assert (g > 0).all() and abs(g.mean().item() - alpha.mean().item()) < 0.05
        d = torch.distributions.Dirichlet(torch.tensor([1.0, 2.0, 3.0], device="tpu")).sample((5000,))
        assert d.device.type == "tpu"
        d = d.cpu()
        torch.testing.assert_close(d.sum(-1), torch.ones(5000))
        torch.testing.assert_close(d.mean(0), torch.tensor([1.0, 2.0, 3.0]) / 6, atol=0.02, rtol=0)
        b = torch.distributions.Beta(torch.tensor(2.0, device="tpu"), torch.tensor(3.0, device="tpu")).sample((5000,))
        assert abs(b.cpu().mean().item() - 0.4) < 0.02


@pytest.mark.parametrize("invert", [False, True])
def test_isin_is_one_program_like_cpu(invert):
    """``isin`` is lowered (generate() checks its stop tokens with it every token): CPU's values in
    the common dtype of both sides, for Tensor and Scalar operands, and CPU's refusals."""
    before = dict(torch_tpu.metrics()["decomposition_counts"])
    cases = [
        (torch.tensor([1, 2, 3]), torch.tensor([1.5, 2.0])),
        (torch.tensor([[1, 5], [3, 4]]), torch.tensor([[4], [1]])),
        (torch.tensor([1.0, float("nan")]), torch.tensor([float("nan"), 1.0])),
        (torch.empty(0, 3, dtype=torch.long), torch.tensor([1])),
        (torch.tensor([1, 2]), 2),
        (2, torch.tensor([1, 2])),
        (torch.tensor([1j]), torch.tensor([1j])),
        (torch.tensor([True]), torch.tensor([True])),
    ]
    for a, b in cases:
        like_cpu(lambda x, y: torch.isin(x, y, invert=invert), a, b)
    assert torch_tpu.metrics()["decomposition_counts"].get("aten.isin.Tensor_Tensor", 0) == \
        before.get("aten.isin.Tensor_Tensor", 0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint64])
def test_64_bit_integer_products_are_exact_and_wrap_as_on_cpu(dtype):
    """64-bit integer matrix products run without a 64-bit dot (which XLA:TPU cannot compile):
    CPU's values, overflow wrapping included, for every product op, in one chunk or several."""
    if dtype == torch.uint64 and not hasattr(torch.Tensor, "__matmul__"):
        pytest.skip("no uint64 matmul")
    g = torch.Generator().manual_seed(0)
    big = 2**62 if dtype == torch.int64 else 2**63

    def ints(*shape, high=1000):
        return torch.randint(0, high, shape, generator=g).to(dtype)

    cases = [
        (torch.mm, (ints(5, 7), ints(7, 3))),
        (torch.bmm, (ints(2, 4, 6), ints(2, 6, 5))),
        (torch.mv, (ints(4, 6), ints(6))),
        (torch.dot, (ints(9), ints(9))),
        (torch.matmul, (ints(3, 1, 4, 5), ints(2, 5, 2))),  # broadcast batch
        (lambda c, a, b: torch.addmm(c, a, b, beta=2, alpha=3), (ints(3, 2), ints(3, 4), ints(4, 2))),
        (torch.addbmm, (ints(3, 2), ints(5, 3, 4), ints(5, 4, 2))),
        (torch.mm, (torch.full((2, 3), big - 1).to(dtype), torch.full((3, 2), 7).to(dtype))),  # wraps
        (torch.mm, (ints(64, 2100, high=2**40), ints(2100, 64, high=2**40))),  # several chunks, wrapping
        (torch.mm, (ints(2, 0), ints(0, 2))),  # an empty inner dimension: zeros
        (torch.matmul, (ints(3, 2, 0), ints(0, 4))),
        (torch.dot, (ints(0), ints(0))),
    ]
    for op, args in cases:
        try:
            want = op(*args)
        except (RuntimeError, NotImplementedError) as e:  # an op CPU does not have for this dtype
            with pytest.raises(type(e)):
                op(*[a.to("tpu") for a in args])
            continue
        got = op(*[a.to("tpu") for a in args])
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want), op
