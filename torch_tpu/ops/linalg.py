"""Lowerings: matrix products and dense linear algebra.

Matrix products honour ``torch.get_float32_matmul_precision()`` for float32 ('highest' ->
HIGHEST, 'high' -> HIGH, 'medium' -> DEFAULT), so results match CPU by default. The setting is
read per call and each setting has its own compiled programs. Half-precision inputs accumulate in
float32, as CPU does.

Factorizations go through ``jax.lax.linalg``/``jnp.linalg``. Pivots follow LAPACK (1-based int32),
``info`` follows LAPACK too, and ``_linalg_check_errors`` raises CPU's messages from it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torch_tpu._dispatch import REGISTERED, _OpKernel, _twins, kernel, register_kernel
from torch_tpu._storage import to_cpu
from torch_tpu.ops._registry import LOWERINGS, Lowering, aten, lower

_PRECISION = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "medium": lax.Precision.DEFAULT,
}


def _dot(a, b, precision, subscripts: str | None = None):
    """``a @ b`` (or an einsum) with float32 accumulation for half-precision inputs."""
    low = a.dtype in (jnp.bfloat16, jnp.float16)
    pet = jnp.float32 if low else None
    if subscripts is None:
        return jnp.matmul(a, b, precision=precision, preferred_element_type=pet)
    return jnp.einsum(subscripts, a, b, precision=precision, preferred_element_type=pet)


def _scaled_sum(self, prod, beta, alpha):
    """beta * self + alpha * prod, where beta == 0 ignores ``self`` (its NaNs too), as on CPU."""
    dt = prod.dtype
    scaled = prod if alpha is None else prod * jnp.asarray(alpha).astype(dt)
    if beta is None:
        return scaled + self.astype(dt)
    b = jnp.asarray(beta)
    return scaled + jnp.where(b == 0, jnp.zeros((), dt), self.astype(dt) * b.astype(dt))


def lower_variants(*ops: torch._ops.OpOverload, variants: dict, choose):
    """Like ``lower``, for a lowering with static keyword variants picked per call from the torch
    arguments by ``choose``: one kernel per variant (each with its own compiled programs), for the
    op and its in-place and ``out=`` twins."""

    def deco(fn):
        for op in ops:
            LOWERINGS[op] = Lowering(functools.partial(fn, **next(iter(variants.values()))))
            for target, kind in [(op, "functional"), *_twins(op)]:
                if str(target) in REGISTERED:
                    continue
                by_variant = {
                    k: _OpKernel(target, Lowering(functools.partial(fn, **kw)), kind) for k, kw in variants.items()
                }

                def run(*args, _k=by_variant, **kwargs):
                    return _k[choose(*args, **kwargs)](*args, **kwargs)

                register_kernel(target, run, f"lowering ({kind})")
        return fn

    return deco


def matmul_lowering(*ops: torch._ops.OpOverload):
    """A lowering taking ``precision``, chosen from ``torch.get_float32_matmul_precision()``."""
    variants = {name: {"precision": p} for name, p in _PRECISION.items()}
    return lower_variants(*ops, variants=variants, choose=lambda *a, **k: torch.get_float32_matmul_precision())


def factor_transposed(*ops: torch._ops.OpOverload):
    """A lowering taking ``transposed``: CPU factors A^T instead of A when A is contiguous and
    real (it saves a copy there), and its backward formulas rely on which one the LU holds."""
    variants = {"T": {"transposed": True}, "N": {"transposed": False}}
    return lower_variants(
        *ops, variants=variants, choose=lambda A, *a, **k: "T" if A.is_contiguous() and not A.is_complex() else "N"
    )


# -------------------------------------------------------------------------------- products
@matmul_lowering(aten.mm.default, aten.bmm.default)
def mm(self, mat2, precision):
    return _dot(self, mat2, precision)


@matmul_lowering(aten.mv.default)
def mv(self, vec, precision):
    return _dot(self, vec, precision)


@matmul_lowering(aten.dot.default)
def dot(self, tensor, precision):
    return _dot(self, tensor, precision)


@matmul_lowering(aten.vdot.default)
def vdot(self, other, precision):
    return _dot(jnp.conj(self), other, precision)


@matmul_lowering(aten.addmm.default, aten.addmv.default, aten.baddbmm.default)
def addmm(self, mat1, mat2, beta=None, alpha=None, precision=None):
    return _scaled_sum(self, _dot(mat1, mat2, precision), beta, alpha)


@matmul_lowering(aten.addbmm.default)
def addbmm(self, batch1, batch2, beta=None, alpha=None, precision=None):
    return _scaled_sum(self, _dot(batch1, batch2, precision, "bij,bjk->ik"), beta, alpha)


@matmul_lowering(aten.addr.default)
def addr(self, vec1, vec2, beta=None, alpha=None, precision=None):
    prod = jnp.outer(vec1, vec2)
    if prod.dtype == jnp.bool_:  # CPU: (beta and self) or (alpha and outer)
        b = True if beta is None else jnp.asarray(beta).astype(bool)
        a = True if alpha is None else jnp.asarray(alpha).astype(bool)
        return (self & b) | (prod & a)
    return _scaled_sum(self, prod, beta, alpha)


# ----------------------------------------------------------------------------- helpers
def _mT(x):
    return jnp.swapaxes(x, -1, -2)


def _mH(x):
    return jnp.conj(_mT(x))


def _batch_broadcast(a, b, b_vector: bool = False):
    """Broadcasts the batch dims of matrices ``a`` (.., m, n) and ``b`` (.., n, k)."""
    core_b = 1 if b_vector else 2
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-core_b])
    return jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-core_b:])


def _lu(a):
    """(LU, LAPACK pivots 1-based int32, permutation, info) of a batch of matrices."""
    k = min(a.shape[-2], a.shape[-1])
    if k == 0:
        batch = a.shape[:-2]
        perm = jnp.broadcast_to(jnp.arange(a.shape[-2]), batch + a.shape[-2:-1])
        return a, jnp.zeros(batch + (0,), jnp.int32), perm, jnp.zeros(batch, jnp.int32)
    lu, piv, perm = lax.linalg.lu(a)
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)[..., :k]
    zero = diag == 0
    info = jnp.where(jnp.any(zero, axis=-1), jnp.argmax(zero, axis=-1) + 1, 0).astype(jnp.int32)
    return lu, (piv + 1).astype(jnp.int32), perm, info


def _lu_solve(lu, perm, b, adjoint: bool = False):
    """Solves A X = B (or A^H X = B) from A[perm] = L U, for matrices B (.., n, k)."""
    if not adjoint:
        pb = jnp.take_along_axis(b, perm[..., :, None], axis=-2)
        y = lax.linalg.triangular_solve(lu, pb, left_side=True, lower=True, unit_diagonal=True)
        return lax.linalg.triangular_solve(lu, y, left_side=True, lower=False)
    y = lax.linalg.triangular_solve(lu, b, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
    z = lax.linalg.triangular_solve(lu, y, left_side=True, lower=True, unit_diagonal=True, transpose_a=True,
                                    conjugate_a=True)
    inv = jnp.argsort(perm, axis=-1)
    return jnp.take_along_axis(z, inv[..., :, None], axis=-2)


def _perm_from_pivots(pivots, m: int):
    """The row permutation described by LAPACK's sequence of 1-based row swaps."""
    k = pivots.shape[-1]
    if k == 0 or pivots.size == 0:
        return jnp.broadcast_to(jnp.arange(m), pivots.shape[:-1] + (m,))
    flat = pivots.reshape(-1, k) - 1

    def one(piv):
        def swap(i, perm):
            j = piv[i]
            pi, pj = perm[i], perm[j]
            return perm.at[i].set(pj).at[j].set(pi)

        return lax.fori_loop(0, k, swap, jnp.arange(m))

    return jax.vmap(one)(flat).reshape(pivots.shape[:-1] + (m,))


def _eye_like(a):
    return jnp.broadcast_to(jnp.eye(a.shape[-2], a.shape[-1], dtype=a.dtype), a.shape)


# ------------------------------------------------------------------------------- cholesky
def _cholesky_info(a, ok):
    """LAPACK's info for failed factorizations: the order of the first leading minor that is not
    positive-definite (found by bisection; runs only when some matrix failed)."""
    n = a.shape[-1]
    idx = jnp.arange(n)

    def minor_ok(k):  # k: batch of orders
        keep = (idx[:, None] < k[..., None, None]) & (idx[None, :] < k[..., None, None])
        ak = jnp.where(keep, a, _eye_like(a))
        return jnp.all(jnp.isfinite(lax.linalg.cholesky(ak, symmetrize_input=False)), axis=(-2, -1))

    def search(_):
        lo = jnp.ones(ok.shape, jnp.int32)
        hi = jnp.full(ok.shape, n, jnp.int32)

        def step(_, lh):
            lo, hi = lh
            mid = (lo + hi) // 2
            good = minor_ok(mid)
            return jnp.where(good, mid + 1, lo), jnp.where(good, hi, mid)

        lo, _ = lax.fori_loop(0, max(n, 1).bit_length() + 1, step, (lo, hi))
        return jnp.where(ok, 0, lo).astype(jnp.int32)

    return lax.cond(jnp.all(ok), lambda _: jnp.zeros(ok.shape, jnp.int32), search, None)


@lower(aten.linalg_cholesky_ex)
def linalg_cholesky_ex(self, upper=False, check_errors=False):
    low = lax.linalg.cholesky(self, symmetrize_input=False)
    ok = jnp.all(jnp.isfinite(low), axis=(-2, -1))
    info = _cholesky_info(self, ok) if self.shape[-1] else jnp.zeros(ok.shape, jnp.int32)
    return (_mH(low) if upper else low), info


@kernel(aten.cholesky.default)
def _cholesky(self: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """Raises on failure like CPU (a sync on ``info``)."""
    out, info = aten.linalg_cholesky_ex.default(self, upper=upper)
    aten._linalg_check_errors.default(info, "cholesky", is_matrix=self.dim() == 2)
    return out


@lower(aten.cholesky_solve, aten._cholesky_solve_helper)
def cholesky_solve(self, input2, upper=False):
    b, factor = self, input2
    factor, b = _batch_broadcast(factor, b)
    if upper:
        y = lax.linalg.triangular_solve(factor, b, left_side=True, lower=False, transpose_a=True, conjugate_a=True)
        return lax.linalg.triangular_solve(factor, y, left_side=True, lower=False)
    y = lax.linalg.triangular_solve(factor, b, left_side=True, lower=True)
    return lax.linalg.triangular_solve(factor, y, left_side=True, lower=True, transpose_a=True, conjugate_a=True)


@lower(aten.cholesky_inverse)
def cholesky_inverse(self, upper=False):
    return cholesky_solve(_eye_like(self), self, upper)


# ------------------------------------------------------------------------------------- LU
@lower(aten.linalg_lu_factor_ex)
def linalg_lu_factor_ex(A, pivot=True, check_errors=False):
    lu, piv, _, info = _lu(A)
    return lu, piv, info


@lower(aten.linalg_lu)
def linalg_lu(A, pivot=True):
    lu, _, perm, _ = _lu(A)
    m, n = A.shape[-2:]
    k = min(m, n)
    lower_ = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    upper_ = jnp.triu(lu[..., :k, :])
    p = _mT(jax.nn.one_hot(perm, m, dtype=A.dtype))  # A = P L U
    return p, lower_, upper_


@lower(aten.lu_unpack)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True):
    m, n = LU_data.shape[-2:]
    k = min(m, n)
    if unpack_data:
        lower_ = jnp.tril(LU_data[..., :, :k], -1) + jnp.eye(m, k, dtype=LU_data.dtype)
        upper_ = jnp.triu(LU_data[..., :k, :])
    else:
        lower_ = upper_ = jnp.zeros((0,), LU_data.dtype)
    if unpack_pivots:
        perm = _perm_from_pivots(LU_pivots, m)
        p = _mT(jax.nn.one_hot(perm, m, dtype=LU_data.dtype))
    else:
        p = jnp.zeros((0,), LU_data.dtype)
    return p, lower_, upper_


@lower(aten.linalg_lu_solve)
def linalg_lu_solve(LU, pivots, B, left=True, adjoint=False):
    perm = _perm_from_pivots(pivots, LU.shape[-1])
    if left:
        lu, b = _batch_broadcast(LU, B)
        perm = jnp.broadcast_to(perm, lu.shape[:-1])
        return _lu_solve(lu, perm, b, adjoint)
    # X A = B  <=>  A^H X^H = B^H
    lu, bh = _batch_broadcast(LU, _mH(B))
    perm = jnp.broadcast_to(perm, lu.shape[:-1])
    return _mH(_lu_solve(lu, perm, bh, not adjoint))


def _is_vector_rhs(A, B) -> bool:
    """torch's rule: B is a (batch of) vector(s) when it is 1-d, or has A's batch shape + (n,)."""
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and B.shape == A.shape[:-1])


@lower(aten._linalg_solve_ex)
def _linalg_solve_ex(A, B, left=True, check_errors=False):
    """Factors A itself (unlike det, CPU's solve keeps A's LU, which its backward reuses)."""
    lu, piv, perm, info = _lu(A)
    vector = _is_vector_rhs(A, B)
    b = B[..., None] if vector else B
    if left:  # A X = B
        luB, bB = _batch_broadcast(lu, b)
        x = _lu_solve(luB, jnp.broadcast_to(perm, luB.shape[:-1]), bB)
    else:  # X A = B  <=>  A^H X^H = B^H
        luB, bB = _batch_broadcast(lu, _mH(b))
        x = _mH(_lu_solve(luB, jnp.broadcast_to(perm, luB.shape[:-1]), bB, adjoint=True))
    if vector:
        x = x[..., 0]
    return x, lu, piv, info


@lower(aten.linalg_inv_ex)
def linalg_inv_ex(A, check_errors=False):
    lu, _, perm, info = _lu(A)
    return _lu_solve(lu, perm, _eye_like(A)), info


@factor_transposed(aten._linalg_det.default)
def _linalg_det(A, transposed=False):
    lu, piv, _, _ = _lu(_mT(A) if transposed else A)
    n = A.shape[-1]
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(piv != jnp.arange(1, n + 1, dtype=jnp.int32), axis=-1)
    sign = jnp.where(swaps % 2 == 0, 1, -1).astype(A.dtype)
    return sign * jnp.prod(diag, axis=-1), lu, piv


@factor_transposed(aten._linalg_slogdet.default)
def _linalg_slogdet(A, transposed=False):
    lu, piv, _, _ = _lu(_mT(A) if transposed else A)
    n = A.shape[-1]
    diag = jnp.diagonal(lu, axis1=-2, axis2=-1)
    swaps = jnp.sum(piv != jnp.arange(1, n + 1, dtype=jnp.int32), axis=-1)
    parity = jnp.where(swaps % 2 == 0, 1, -1).astype(A.dtype)
    if jnp.iscomplexobj(A):
        sign = parity * jnp.prod(diag / jnp.abs(diag), axis=-1)
    else:
        sign = parity * jnp.prod(jnp.sign(diag), axis=-1)
    logabs = jnp.sum(jnp.log(jnp.abs(diag)), axis=-1)
    return sign, logabs, lu, piv


# -------------------------------------------------------------------------- triangular
@lower(aten.triangular_solve)
def triangular_solve(self, A, upper=True, transpose=False, unitriangular=False):
    a, b = _batch_broadcast(A, self)
    x = lax.linalg.triangular_solve(a, b, left_side=True, lower=not upper, transpose_a=transpose,
                                    unit_diagonal=unitriangular)
    return x, a


@lower(aten.linalg_solve_triangular)
def linalg_solve_triangular(self, B, upper, left=True, unitriangular=False):
    a, b = _batch_broadcast(self, B)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper, unit_diagonal=unitriangular)


# ------------------------------------------------------------------ spectral, QR, SVD
@lower(aten._linalg_eigh)
def _linalg_eigh(A, UPLO="L", compute_v=True):
    w, v = jnp.linalg.eigh(A, UPLO=UPLO, symmetrize_input=False)
    return w, (v if compute_v else jnp.zeros((0,), A.dtype))


@lower(aten._linalg_svd)
def _linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        s = jnp.linalg.svd(A, compute_uv=False)
        empty = jnp.zeros((0,), A.dtype)
        return empty, s, empty
    u, s, vh = jnp.linalg.svd(A, full_matrices=full_matrices)
    return u, s, vh


@lower(aten.linalg_qr)
def linalg_qr(A, mode="reduced"):
    if mode == "r":
        return jnp.zeros((0,), A.dtype), jnp.linalg.qr(A, mode="r")
    q, r = jnp.linalg.qr(A, mode=mode)
    return q, r


# ---------------------------------------------------------------------------- errors
@kernel(aten._linalg_check_errors.default)
def _linalg_check_errors(info: torch.Tensor, api_name: str, *, is_matrix: bool) -> None:
    """Reads ``info`` (a sync) and raises CPU's error for a failed factorization."""
    torch.ops.aten._linalg_check_errors(to_cpu(info), api_name, is_matrix=is_matrix)
