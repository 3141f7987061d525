"""Lowerings: matrix products and dense linear algebra.

Matrix products honour ``torch.get_float32_matmul_precision()`` for float32 ('highest' ->
HIGHEST, 'high' -> HIGH, 'medium' -> DEFAULT), so results match CPU by default. The setting is
read per call and each setting has its own compiled programs. Half-precision inputs accumulate in
float32, as CPU does.

Factorizations go through ``jax.lax.linalg``/``jnp.linalg``. Pivots follow LAPACK (1-based int32),
``info`` follows LAPACK too, and ``_linalg_check_errors`` raises CPU's messages from it.

Where CPU's own algorithm decides the result beyond rounding, it is reproduced step by step: the
matrix exponential (its Taylor degrees and the rounding of its small matrix products, because
ill-conditioned results amplify any other rounding past the comparison tolerance) and the
Bunch-Kaufman LDL factorization (its pivots). Ops without a meta kernel in torch (geqrf, lstsq)
are hand-written kernels.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_tpu.core.compat import aten_overload
from torch_tpu.ops._registry import aten, kernel, lower
from torch_tpu.ops.nn import run_jax
from torch_tpu.tensor.storage import new_tensor, to_cpu

_PRECISION = {
    "highest": lax.Precision.HIGHEST,
    "high": lax.Precision.HIGH,
    "medium": lax.Precision.DEFAULT,
}


_WIDE_INTS = (np.dtype(np.int64), np.dtype(np.uint64))
_INTERMEDIATE = 1 << 22  # elements of one chunk's products in the 64-bit integer product


def _wide_int_matmul(a, b):
    """``a @ b`` (matmul's shapes) of 64-bit integers without a 64-bit dot, which XLA:TPU cannot
    compile ("dot s64"): the products summed over the inner dimension, in chunks of it so that no
    intermediate holds more than ``_INTERMEDIATE`` elements. Exact, wrapping as CPU's int64 does
    (a sum of wrapped products is the same in any order), so every platform runs this one."""
    vec_a, vec_b = a.ndim == 1, b.ndim == 1
    a = a[None, :] if vec_a else a
    b = b[:, None] if vec_b else b
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    (m, k), n = a.shape[-2:], b.shape[-1]
    a, b = jnp.broadcast_to(a, (*batch, m, k)), jnp.broadcast_to(b, (*batch, k, n))
    chunk = max(1, min(k, _INTERMEDIATE // max(1, math.prod(batch) * m * n)))
    steps = -(-k // chunk)
    if steps * chunk != k:  # zeros add nothing
        a = jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, steps * chunk - k)])
        b = jnp.pad(b, [(0, 0)] * (b.ndim - 2) + [(0, steps * chunk - k), (0, 0)])

    def add_chunk(i, acc):
        ai = lax.dynamic_slice_in_dim(a, i * chunk, chunk, axis=a.ndim - 1)
        bi = lax.dynamic_slice_in_dim(b, i * chunk, chunk, axis=b.ndim - 2)
        return acc + jnp.sum(ai[..., :, :, None] * bi[..., None, :, :], axis=-2)

    out = jnp.zeros((*batch, m, n), jnp.result_type(a, b))
    if k > 0:  # an empty inner dimension sums nothing: zeros, as on CPU
        out = add_chunk(0, out) if steps == 1 else lax.fori_loop(0, steps, add_chunk, out)
    out = out[..., 0, :] if vec_a else out
    return out[..., 0] if vec_b else out


def _dot(a, b, precision, subscripts: str | None = None):
    """``a @ b`` (or an einsum) with float32 accumulation for half-precision inputs."""
    if a.dtype in _WIDE_INTS or b.dtype in _WIDE_INTS:
        if subscripts is None:
            return _wide_int_matmul(a, b)
        if subscripts == "bij,bjk->ik":  # addbmm
            return _wide_int_matmul(a, b).sum(0)
        raise NotImplementedError(f"tpu: a 64-bit integer einsum {subscripts!r} has no lowering")
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


def _float32_precision(*_args: Any, **_kwargs: Any) -> str:
    return torch.get_float32_matmul_precision()


_float32_precision.settings_only = True  # the arguments play no part: graphs choose it at tracing too


def matmul_lowering(*ops: torch._ops.OpOverload, **options: Any):
    """A lowering taking ``precision``, chosen from ``torch.get_float32_matmul_precision()``
    (``options``: :func:`lower`'s others)."""
    variants = {name: {"precision": p} for name, p in _PRECISION.items()}
    return lower(*ops, variants=variants, choose=_float32_precision, **options)


def factor_transposed(*ops: torch._ops.OpOverload):
    """A lowering taking ``transposed``: CPU factors A^T instead of A when A is contiguous and
    real (it saves a copy there), and its backward formulas rely on which one the LU holds."""
    variants = {"T": {"transposed": True}, "N": {"transposed": False}}
    return lower(
        *ops, variants=variants, choose=lambda A, *a, **k: "T" if A.is_contiguous() and not A.is_complex() else "N"
    )


# -------------------------------------------------------------------------------- products
@matmul_lowering(aten.mm.default, aten.bmm.default)
def mm(self, mat2, precision):
    return _dot(self, mat2, precision)


def _int_mm_check(self, mat2):
    """CPU's refusals in CPU's words: torch's meta kernel words some differently from CPU's kernel
    (and torch versions differ in both), so where the meta refuses, CPU's kernel is asked, on
    uninitialised tensors of the same shapes and dtypes (it refuses before it computes)."""
    try:
        aten._int_mm.default(*[torch.empty(t.shape, dtype=t.dtype, device="meta") for t in (self, mat2)])
        return
    except (RuntimeError, IndexError) as e:
        refused = e
    aten._int_mm.default(*[torch.empty(t.shape, dtype=t.dtype) for t in (self, mat2)])
    raise refused


@lower(aten._int_mm.default, check=_int_mm_check)
def int_mm(self, mat2):
    """int8 (or uint8) times int8 with int32 accumulation and result, as quantised linears use it
    (torchao): exact, so CPU's values bit for bit."""
    return lax.dot(self.astype(jnp.int32), mat2.astype(jnp.int32), preferred_element_type=jnp.int32)


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


@kernel(aten_overload("cholesky.default"))  # removed in torch 2.14
def _cholesky(self: torch.Tensor, upper: bool = False) -> torch.Tensor:
    """Raises on failure like CPU (a sync on ``info``)."""
    out, info = aten.linalg_cholesky_ex.default(self, upper=upper)
    aten._linalg_check_errors.default(info, "cholesky", is_matrix=self.dim() == 2)
    return out


@lower(aten_overload("cholesky.default"), graph_only=True)
def cholesky(self, upper=False):
    """In a graph: the factor alone (a graph cannot raise on ``info``; a failed factor has NaNs)."""
    return linalg_cholesky_ex(self, upper)[0]


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


@lower(aten.linalg_pinv.atol_rtol_tensor, graph_only=True)
def linalg_pinv(self, atol=None, rtol=None, hermitian=False):
    """The pseudo-inverse from the SVD (the eigendecomposition when ``hermitian``), singular values
    at most max(atol, rtol * largest) dropped; rtol defaults to eps * max(m, n) unless atol > 0."""
    m, n = self.shape[-2:]
    real = jnp.finfo(self.dtype).dtype
    if hermitian:
        w, v = jnp.linalg.eigh(self, symmetrize_input=False)
        s, u, vh = jnp.abs(w), v, _mH(v * jnp.sign(w)[..., None, :].astype(self.dtype))
    elif self.dtype in (jnp.float32, jnp.complex64):
        u, s, vh = _svd_32_bit(self, False)
    else:
        u, s, vh = jnp.linalg.svd(self, full_matrices=False)
    top = jnp.max(s, axis=-1, initial=0.0)[..., None]
    atol_ = jnp.zeros((), real) if atol is None else jnp.asarray(atol, real)[..., None]
    if rtol is None:
        default = jnp.asarray(jnp.finfo(real).eps * max(m, n), real)
        rtol_ = default if atol is None else jnp.where(atol_ > 0, 0.0, default)
    else:
        rtol_ = jnp.asarray(rtol, real)[..., None]
    tol = jnp.maximum(atol_, rtol_ * top)
    keep = s > tol
    s_inv = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(self.dtype)
    return _mH(vh) @ (s_inv[..., :, None] * _mH(u))


_SVD_32: dict = {}


def _svd_platforms() -> tuple[str, ...]:
    local = jax.default_backend()
    local = "cuda" if local == "gpu" else local
    return tuple(dict.fromkeys((local, "tpu")))


def _svd_32_bit(A, full_matrices: bool, compute_uv: bool = True):
    """A 32-bit SVD, traced with JAX's 64-bit types off, and embedded in the calling program.

    Why: with them on (torch_tpu's int64 and float64 need them), JAX's TPU algorithm (QDWH, a
    polar decomposition) makes 64-bit loop values and indices, and XLA:TPU cannot rewrite its
    loop body to 32 bits ("While rewriting computation to not contain X64 element types, XLA
    encountered an HLO for which this rewriting is not implemented: dot"): the program did not
    compile for a TPU. A context that turns them off inside a trace does not reach the ops traced
    there, so the SVD is exported on its own (``jax.export``, for the local platform and the TPU,
    once per shape and dtype) with them off, and called as a function of the program."""
    key = (tuple(A.shape), np.dtype(A.dtype), full_matrices, compute_uv)
    exported = _SVD_32.get(key)
    if exported is None:
        fn = jax.jit(lambda a: jnp.linalg.svd(a, full_matrices=full_matrices, compute_uv=compute_uv))
        with jax.enable_x64(False):
            exported = jax.export.export(fn, platforms=_svd_platforms())(jax.ShapeDtypeStruct(A.shape, A.dtype))
        _SVD_32[key] = exported
    return exported.call(A)


@lower(aten._linalg_svd)
def _linalg_svd(A, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        s = (_svd_32_bit(A, False, compute_uv=False) if A.dtype in (jnp.float32, jnp.complex64)
             else jnp.linalg.svd(A, compute_uv=False))
        empty = jnp.zeros((0,), A.dtype)
        return empty, s, empty
    if A.dtype in (jnp.float32, jnp.complex64):
        return _svd_32_bit(A, full_matrices)
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


# ----------------------------------------------------------------------------- dtype checks
def _dtype_name(dtype: torch.dtype) -> str:
    """The name CPU's dispatch errors give a dtype ('Float', 'Half', 'Long')."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


_LAPACK_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _dtype_check(kernel_name: str, dtypes=_LAPACK_DTYPES):
    """A ``check`` raising CPU's dispatch error for dtypes its kernel lacks (half precision):
    torch's meta kernels accept them."""

    def check(first, *args, **kwargs):
        if first.dtype not in dtypes and (first.dtype.is_floating_point or first.dtype.is_complex):
            raise NotImplementedError(f'"{kernel_name}" not implemented for \'{_dtype_name(first.dtype)}\'')

    return check


# ----------------------------------------------------------------------------- distances
def _cdist_pairs(x1, x2):
    """x1 (.., P, M) and x2 (.., R, M) with broadcast batch dims, and their differences (.., P, R, M)."""
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    x1 = jnp.broadcast_to(x1, batch + x1.shape[-2:])
    x2 = jnp.broadcast_to(x2, batch + x2.shape[-2:])
    return x1, x2, x1[..., :, None, :] - x2[..., None, :, :]


def _cdist_uses_mm(p: float, compute_mode, r1: int, r2: int) -> bool:
    """CPU's rule for the Euclidean distance through a matrix product (faster, less exact)."""
    return p == 2 and (compute_mode == 1 or (compute_mode in (None, 0) and (r1 > 25 or r2 > 25)))


@lower(aten._cdist_forward, static_scalars=True, check=_dtype_check("cdist", (torch.float32, torch.float64)))
def _cdist_forward(x1, x2, p, compute_mode=None):
    """``p`` is static: each norm order has its own formula, as on CPU."""
    p = float(p)
    if _cdist_uses_mm(p, compute_mode, x1.shape[-2], x2.shape[-2]):
        hp = lax.Precision.HIGHEST
        n1 = jnp.sum(x1 * x1, axis=-1)[..., :, None]
        n2 = jnp.sum(x2 * x2, axis=-1)[..., None, :]
        sq = n1 + n2 - 2 * jnp.matmul(x1, _mT(x2), precision=hp)
        return jnp.sqrt(jnp.maximum(sq, 1e-30))
    _, _, diff = _cdist_pairs(x1, x2)
    ad = jnp.abs(diff)
    if p == 0:
        return jnp.sum(ad != 0, axis=-1).astype(x1.dtype)
    if p == 1:
        return jnp.sum(ad, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(ad * ad, axis=-1))
    if p == float("inf"):
        return jnp.max(ad, axis=-1, initial=0)
    return jnp.sum(ad**p, axis=-1) ** (1 / p)


@lower(aten._cdist_backward, static_scalars=True)
def _cdist_backward(grad, x1, x2, p, cdist):
    """CPU's closed form (zero where the distance is zero), summed over x2's rows."""
    p = float(p)
    _, _, diff = _cdist_pairs(x1, x2)
    g = grad[..., None]
    d = cdist[..., None]
    zero = jnp.zeros((), diff.dtype)
    if p == 0 or diff.size == 0:
        return jnp.zeros(diff.shape[:-2] + diff.shape[-1:], diff.dtype)
    if p == 1:
        term = g * jnp.sign(diff)
    elif p == 2:
        term = jnp.where(d == 0, zero, g * diff / jnp.where(d == 0, 1, d))
    elif p == float("inf"):
        term = g * jnp.sign(diff) * (jnp.abs(diff) == d)
    elif p < 2:
        safe = jnp.where(d == 0, 1, d)
        val = jnp.sign(diff) * jnp.abs(diff) ** (p - 1) * g / safe ** (p - 1)
        term = jnp.where((d == 0) | ((diff == 0) & (p < 1)), zero, val)
    else:
        safe = jnp.where(d == 0, 1, d)
        term = jnp.where(d == 0, zero, diff * jnp.abs(diff) ** (p - 2) * g / safe ** (p - 1))
    return jnp.sum(term, axis=-2)


# ----------------------------------------------------------------------------- matrix functions
# CPU's matrix exponential: the optimized Taylor polynomials of degree 1, 2, 4, 8, 12 and 18 of
# Bader, Blanes and Casas, "Computing the Matrix Exponential with an Optimized Taylor Polynomial
# Approximation" (Mathematics 2019, 7, 1174), the degree picked from the 1-norm, with scaling and
# squaring above the last bound. Pade approximants give other roundings, which in float32
# exceed the comparison tolerance for ill-conditioned results; the same polynomials match CPU.
_MEXP_THETAS = {
    # float32 / complex64
    False: (1.192092800768788e-07, 5.978858893805233e-04, 5.116619363445086e-02, 5.800524627688768e-01,
            1.461661507209034e+00, 3.010066362817634e+00),
    # float64 / complex128
    True: (2.220446049250313e-16, 2.580956802971767e-08, 3.397168839976962e-04, 4.991228871115323e-02,
           2.996158913811580e-01, 1.090863719290036e+00),
}
# degree 12: rows combine (I, A, A^2, A^3) into B0..B3; exp ~ B0 + (B1 + A6) A6, A6 = B2 + B3 B3
_MEXP_B12 = (
    (9.0198e-16, 0.46932117595418237389, -0.20099424927047284052, -0.04623946134063071740),
    (5.31597895759871264183, 1.19926790417132231573, 0.01179296240992997031, 0.01108844528519167989),
    (0.18188869982170434744, 0.05502798439925399070, 0.09351590770535414968, 0.00610700528898058230),
    (-2.0861320e-13, -0.13181061013830184015, -0.02027855540589259079, -0.00675951846863086359),
)
# degree 18: rows combine (I, A, A^2, A^3, A^6) into B0..B4;
# A9 = B0 B4 + B3, exp ~ B1 + (B2 + A9) A9
_MEXP_B18 = (
    (0.0, -1.00365581030144618291e-01, -8.02924648241156932449e-03, -8.92138498045729985177e-04, 0.0),
    (0.0, 3.97849749499645077844e-01, 1.36783778460411720168e+00, 4.98289622525382669416e-01,
     -6.37898194594723280150e-04),
    (-1.09676396052962061844e+01, 1.68015813878906206114e+00, 5.71779846478865511061e-02,
     -6.98210122488052056106e-03, 3.34975017086070470649e-05),
    (-9.04316832390810593223e-02, -6.76404519071381882256e-02, 6.75961301770459654925e-02,
     2.95552570429315521194e-02, -1.39180257516060693404e-05),
    (0.0, 0.0, -9.23364619367118555360e-02, -1.69364939002081722752e-02, -1.40086798182036094347e-05),
)


def _sum_in_order(terms):
    """terms[0] + terms[1] + ... rounded after every step, as CPU's loops do: a scan over the
    stacked terms, so that XLA cannot fuse the products that made them into FMAs."""
    stacked = jnp.stack(terms)
    return lax.scan(lambda acc, t: (acc + t, None), jnp.zeros_like(stacked[0]), stacked)[0]


def _combine(coeffs, mats, dtype):
    """sum_j coeffs[j] * mats[j], accumulated in order as CPU does."""
    real = jnp.finfo(dtype).dtype
    return _sum_in_order([m * jnp.asarray(c, real).astype(dtype) for c, m in zip(coeffs, mats)])


def _bmm_cpu(a, b):
    """A batched matrix product rounded as CPU's ``bmm``: below 400 multiply-adds per matrix CPU
    runs a plain loop, one rounding per product and per sum (no fused multiply-add), which the
    scan over precomputed products reproduces (XLA would fuse them into FMAs otherwise); larger
    products go to the BLAS, whose sequential FMAs XLA's dot rounds the same way."""
    m, k = a.shape[-2:]
    if m * k * b.shape[-1] >= 400:
        return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)
    prods = a[..., :, :, None] * b[..., None, :, :]  # (.., m, k, n)
    return _sum_in_order([prods[..., :, i, :] for i in range(k)])


def _mexp_polys(a):
    """The six Taylor approximants of exp(a), for matrices a (.., n, n)."""
    dt = a.dtype
    mm_ = _bmm_cpu
    eye = _eye_like(a)
    a2 = mm_(a, a)
    a3 = mm_(a, a2)
    a6 = mm_(a3, a3)
    t1 = eye + a
    t2 = eye + a + a2 / 2
    t4 = _combine((1.0, 1.0, 0.0), (eye, a, a2), dt) + mm_(a2, _combine((1 / 2, 1 / 6, 1 / 24), (eye, a, a2), dt))
    s177 = 0.1330413469565007072504e+2
    x3 = 2.0 / 3.0
    x1, x2 = x3 * ((1 + s177) / 88), x3 * ((1 + s177) / 352)
    x4, x5 = (-271 + 29 * s177) / (315 * x3), (-11 + 11 * s177) / (1260 * x3)
    x6, x7 = (-99 + 11 * s177) / (5040 * x3), (89 - s177) / (5040 * x3)
    y2 = (857 - 58 * s177) / 630
    a4 = mm_(a2, _combine((x1, x2), (a, a2), dt))
    a8 = mm_(_combine((x3, 1.0), (a2, a4), dt), _combine((x4, x5, x6, x7), (eye, a, a2, a4), dt))
    t8 = _combine((1.0, 1.0, y2, 0.0, 1.0), (eye, a, a2, a4, a8), dt)
    b = [_combine(row, (eye, a, a2, a3), dt) for row in _MEXP_B12]
    a6_ = b[2] + mm_(b[3], b[3])
    t12 = b[0] + mm_(b[1] + a6_, a6_)
    return t1, t2, t4, t8, t12, a6


def _mexp_t18(a, a2, a3, a6):
    b = [_combine(row, (_eye_like(a), a, a2, a3, a6), a.dtype) for row in _MEXP_B18]
    a9 = b[3] + _bmm_cpu(b[0], b[4])
    return b[1] + _bmm_cpu(b[2] + a9, a9)


def _mexp_scaled(a, norm, theta):
    """Degree 18 on a / 2^s, squared s times (s per matrix)."""
    s = jnp.maximum(0.0, jnp.ceil(jnp.log2(norm / theta)))
    s = jnp.where(jnp.isfinite(s), s, 0).astype(jnp.int32)
    scaled = a / jnp.exp2(s.astype(norm.dtype))[..., None, None].astype(a.dtype)
    a2 = _bmm_cpu(scaled, scaled)
    a3 = _bmm_cpu(scaled, a2)
    e = _mexp_t18(scaled, a2, a3, _bmm_cpu(a3, a3))

    def body(c):
        i, m = c
        sq = _bmm_cpu(m, m)
        return i + 1, jnp.where((i < s)[..., None, None], sq, m)

    return lax.while_loop(lambda c: c[0] < jnp.max(s, initial=0), body, (jnp.int32(0), e))[1]


@lower(aten.linalg_matrix_exp)
def linalg_matrix_exp(self):
    """CPU's algorithm (see above). Its backward is torch's own formula, an exp of a block matrix,
    so it lands here too."""
    if self.size == 0:
        return self
    if self.shape[-1] == 1:
        return jnp.exp(self)
    thetas = _MEXP_THETAS[self.dtype not in (jnp.float32, jnp.complex64)]  # CPU: float's for 32 bits only
    norm = jnp.max(jnp.sum(jnp.abs(self), axis=-2), axis=-1)
    polys = _mexp_polys(self)
    out = _mexp_scaled(self, norm, thetas[5])  # norm >= thetas[4]
    lowb = -1.0
    for t, theta in zip(polys[:5], thetas[:5]):
        pick = (norm > lowb) & (norm <= theta) & (norm < thetas[4])
        out = jnp.where(pick[..., None, None], t, out)
        lowb = theta
    return out


# ------------------------------------------------------------------------ Householder
def geqrf(self):
    """LAPACK's compact QR (reflectors below the diagonal, R on and above it, and the taus)."""
    m, n = self.shape[-2:]
    if min(m, n) == 0:
        return self, jnp.zeros(self.shape[:-2] + (0,), self.dtype)
    h, tau = jnp.linalg.qr(self, mode="raw")  # LAPACK's geqrf, its matrix transposed
    return _mT(h), tau


def _geqrf_meta(self: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch has no meta kernel for geqrf: CPU's checks and result shapes."""
    if self.dim() < 2:
        raise RuntimeError("torch.geqrf: input must have at least 2 dimensions.")
    if self.dtype not in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        raise NotImplementedError(f'"geqrf_cpu" not implemented for \'{_dtype_name(self.dtype)}\'')
    m, n = self.shape[-2:]
    return torch.empty_like(self), self.new_empty(self.shape[:-2] + (min(m, n),))



lower(aten.geqrf.default, by_name=True, meta=_geqrf_meta)(geqrf)
lower(aten.geqrf.default, graph_only=True)(geqrf)


def _householder_q(A, tau):
    """Q = H_1 ... H_k (the first n columns, LAPACK's orgqr) from reflectors A (.., m, n)."""
    m, n = A.shape[-2:]
    k = tau.shape[-1]
    if m == 0 or n == 0:
        return jnp.zeros(A.shape, A.dtype)
    if k < n:  # zero taus are identity reflectors
        tau = jnp.concatenate([tau, jnp.zeros(tau.shape[:-1] + (n - k,), tau.dtype)], axis=-1)
    batch = jnp.broadcast_shapes(A.shape[:-2], tau.shape[:-1])
    return lax.linalg.householder_product(jnp.broadcast_to(A, batch + (m, n)), jnp.broadcast_to(tau, batch + (n,)))


@lower(aten.linalg_householder_product)
def linalg_householder_product(input, tau):
    return _householder_q(input, tau)


@lower(aten.ormqr)
def ormqr(self, input2, input3, left=True, transpose=False):
    """op(Q) C or C op(Q), applying the reflectors in ``self`` one by one (LAPACK's ormqr)."""
    batch = jnp.broadcast_shapes(self.shape[:-2], input2.shape[:-1], input3.shape[:-2])
    a = jnp.broadcast_to(self, batch + self.shape[-2:])
    tau = jnp.broadcast_to(input2, batch + input2.shape[-1:])
    c = jnp.broadcast_to(input3, batch + input3.shape[-2:])
    if c.size == 0 or tau.shape[-1] == 0:
        return c
    return lax.linalg.ormqr(a, tau, c, left=left, transpose=transpose)


# ------------------------------------------------------------------------ least squares
_LSTSQ_DRIVERS = ("gels", "gelsy", "gelsd", "gelss")


def _lstsq_checks(A: torch.Tensor, B: torch.Tensor, driver: str | None) -> None:
    """CPU's argument checks (torch has no meta kernel for lstsq)."""
    where = "torch.linalg.lstsq:"
    if A.dim() < 2:
        raise RuntimeError(f"{where} input must have at least 2 dimensions.")
    if B.dim() < 1:
        raise RuntimeError(f"{where} other must have at least 1 dimension.")
    if not (A.dim() >= B.dim() and A.dim() - B.dim() <= 1):
        raise RuntimeError(
            f"{where} input.dim() must be greater or equal to other.dim() and (input.dim() - other.dim()) <= 1"
        )
    if A.dtype != B.dtype:
        raise RuntimeError(
            f"{where} Expected input and other to have the same dtype, but got input's dtype "
            f"{_dtype_name(A.dtype)} and other's dtype {_dtype_name(B.dtype)}"
        )
    if not (A.dtype.is_floating_point or A.dtype.is_complex) or A.dtype in (torch.float16, torch.bfloat16):
        raise RuntimeError("This function doesn't handle types other than float and double")
    vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
    dim = -1 if vector else -2
    if A.shape[-2] != B.shape[dim]:
        raise RuntimeError(f"{where} input.size(-2) should match other.size({dim})")
    if driver is not None and driver not in _LSTSQ_DRIVERS:
        raise RuntimeError(f"{where} parameter `driver` should be one of (gels, gelsy, gelsd, gelss)")


def _lstsq(a, b, *, driver: str, rcond: float | None, vector: bool):
    """(solution, residuals, rank, singular values) through the SVD: the least-squares solution
    of minimum norm, with singular values below ``rcond * s_max`` dropped (all kept for 'gels',
    which assumes full rank). For well-posed problems that is LAPACK's solution for every driver."""
    if vector:
        b = b[..., None]
    m, n = a.shape[-2:]
    k = b.shape[-1]
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a_batch = a.shape[:-2]  # rank and singular values keep A's own batch shape, as on CPU
    b = jnp.broadcast_to(b, batch + (m, k))
    real = jnp.finfo(a.dtype).dtype
    if min(m, n) == 0:
        x = jnp.zeros(batch + (n, k), a.dtype)
        rank = jnp.zeros(a_batch, jnp.int64)
        sv = jnp.zeros(a_batch + (0,), real)
    else:
        # a 32-bit SVD traced with 64-bit types off: XLA:TPU cannot compile JAX's otherwise
        u, sv, vh = (_svd_32_bit(a, False) if a.dtype in (jnp.float32, jnp.complex64)
                     else jnp.linalg.svd(a, full_matrices=False))
        cut = (jnp.finfo(real).eps * max(m, n)) if rcond is None else rcond
        keep = sv > cut * sv[..., :1]
        rank = jnp.sum(keep, axis=-1).astype(jnp.int64)
        if driver != "gels":
            inv = jnp.where(keep, 1 / jnp.where(keep, sv, 1), 0)
        else:
            inv = 1 / sv
        hp = lax.Precision.HIGHEST
        coef = jnp.matmul(_mH(u), b, precision=hp) * inv[..., :, None].astype(a.dtype)
        x = jnp.broadcast_to(jnp.matmul(_mH(vh), coef, precision=hp), batch + (n, k))
    r = jnp.matmul(a, x, precision=lax.Precision.HIGHEST) - b if n else -b
    resid = jnp.sum(jnp.abs(r) ** 2, axis=-2).astype(real)
    if driver == "gels" and n == 0:
        resid = jnp.zeros_like(resid)  # as LAPACK's gels leaves it
    return (x[..., 0] if vector else x), resid, rank, sv


@kernel(aten.linalg_lstsq.default)
def _linalg_lstsq(self: torch.Tensor, b: torch.Tensor, rcond: float | None = None, *, driver: str | None = None):
    """A kernel, not a lowering: torch has no meta kernel, and which results CPU returns depends
    on the driver and, for 'gelsd'/'gelss', on whether every matrix has full rank (a sync)."""
    _lstsq_checks(self, b, driver)
    driver = driver or "gelsy"
    vector = b.dim() == 1 or (b.dim() == self.dim() - 1 and b.shape == self.shape[:-1])
    real = self.dtype.to_real()
    static = {"driver": driver, "rcond": rcond, "vector": vector}
    x, resid, rank, sv = run_jax(
        "aten.linalg_lstsq", _lstsq, static, {"a": self, "b": b}, [self.dtype, real, torch.int64, real]
    )
    x, resid, rank, sv = (new_tensor(tuple(v.shape), d, v) for v, d in
                          zip((x, resid, rank, sv), (self.dtype, real, torch.int64, real)))
    m, n = self.shape[-2:]
    empty_real = torch.empty(0, dtype=real, device=self.device)
    if not (m > n and driver != "gelsy"):
        resid = empty_real
    elif driver in ("gelsd", "gelss") and not bool(torch.all(rank.cpu() == n)):
        resid = empty_real
    if driver == "gels":
        rank = torch.empty(0, dtype=torch.int64, device=self.device)
    if driver not in ("gelsd", "gelss"):
        sv = empty_real
    return x, resid, rank, sv


# ---------------------------------------------------------------------- non-symmetric eig
def _eig(A, vectors: bool):
    """LAPACK's geev through ``lax.linalg.eig`` (what ``jnp.linalg.eig`` uses): eigenvalues as
    CPU's; eigenvectors normalised to unit 2-norm with their largest component real, as CPU's, but
    a real input's vectors may differ from CPU's in sign (jaxlib's LAPACK is not CPU's MKL).
    PyTorch's OpInfo compares their absolute values, and eig's backward needs phase-invariant
    losses anyway. XLA implements eig on CPU only (not on TPU or GPU): where the platform or the
    TPU target is a TPU, eager calls run on the host instead (``host_on_tpu``)."""
    ct = jnp.result_type(A.dtype, jnp.complex64)
    if A.size == 0:
        return jnp.zeros(A.shape[:-1], ct), jnp.zeros(A.shape, ct)
    if not vectors:
        return lax.linalg.eig(A, compute_left_eigenvectors=False, compute_right_eigenvectors=False)[0].astype(ct), None
    w, v = lax.linalg.eig(A, compute_left_eigenvectors=False, compute_right_eigenvectors=True)
    return w.astype(ct), v.astype(ct)


@lower(aten.linalg_eig, check=_dtype_check("linalg_eig_out_cpu"), host_on_tpu=True)
def linalg_eig(self):
    return _eig(self, True)


@lower(aten._linalg_eigvals, check=_dtype_check("linalg_eig_out_cpu"), host_on_tpu=True)
def _linalg_eigvals(self):
    return _eig(self, False)[0]


# ---------------------------------------------------------------------------- LDL (Bunch-Kaufman)
_BK_ALPHA = (1 + 17**0.5) / 8


def _sym_from_lower(a, hermitian: bool):
    """The full symmetric (Hermitian) matrix whose lower triangle is ``a``'s."""
    low = jnp.tril(a, -1)
    up = _mH(low) if hermitian else _mT(low)
    d = jnp.diagonal(a)
    if hermitian:
        d = d.real.astype(a.dtype)
    return low + up + jnp.diag(d)


def _bk_abs(x):
    """LAPACK's pivot magnitude: |re| + |im| for complex (cabs1), |x| for real."""
    if jnp.iscomplexobj(x):
        return jnp.abs(x.real) + jnp.abs(x.imag)
    return jnp.abs(x)


def _sytf2_lower(a, hermitian: bool):
    """LAPACK's unblocked Bunch-Kaufman factorization (sytf2/hetf2, lower) of one matrix, step by
    step with the same pivot choices: (LD, 1-based pivots with negative pairs for 2x2 blocks,
    info). The trailing block is kept as a full symmetric matrix built from its lower triangle."""
    n = a.shape[-1]
    real_t = jnp.finfo(a.dtype).dtype
    idx = jnp.arange(n)
    herm = hermitian and jnp.iscomplexobj(a)

    def diag_abs(m, i):
        return jnp.abs(m[i, i].real) if herm else _bk_abs(m[i, i])

    def step(state):
        k, m, piv, info = state
        col = jnp.where(idx > k, _bk_abs(m[:, k]), -1).astype(real_t)
        imax = jnp.argmax(col)
        colmax = jnp.where(k < n - 1, col[imax], 0).astype(real_t)
        absakk = diag_abs(m, k)
        singular = (jnp.maximum(absakk, colmax) == 0) | jnp.isnan(absakk)
        rowv = jnp.where((idx >= k) & (idx != imax), _bk_abs(m[imax, :]), -1).astype(real_t)
        rowmax = jnp.max(rowv)
        c1 = absakk >= _BK_ALPHA * colmax
        c2 = absakk >= _BK_ALPHA * colmax * (colmax / rowmax)
        c3 = diag_abs(m, imax) >= _BK_ALPHA * rowmax
        kp = jnp.where(singular | c1 | c2, k, imax)
        two = ~singular & ~c1 & ~c2 & ~c3
        kstep = jnp.where(two, 2, 1)
        kk = k + kstep - 1
        # interchange rows and columns kk and kp of the trailing block
        perm = jnp.where(idx == kk, kp, jnp.where(idx == kp, kk, idx))
        swapped = m[perm][:, perm]
        trailing = (idx[:, None] >= k) & (idx[None, :] >= k)
        m = jnp.where(trailing, swapped, m)
        below = idx > k + kstep - 1  # rows and columns of the update
        upd = below[:, None] & below[None, :]
        # 1x1 pivot
        x = jnp.where(idx > k, m[:, k], 0)
        d11 = 1 / (m[k, k].real.astype(a.dtype) if herm else m[k, k])
        xc = jnp.conj(x) if herm else x
        one = m + jnp.where(upd, x[:, None] * (-d11 * xc)[None, :], 0)
        one = one.at[:, k].set(jnp.where(idx > k, x * d11, one[:, k]))
        # 2x2 pivot
        a21 = m[k + 1, k] if n > 1 else m[k, k]
        if herm:
            dd = jnp.abs(a21).astype(a.dtype)
            e11 = m[(k + 1) % n, (k + 1) % n].real.astype(a.dtype) / dd
            e22 = m[k, k].real.astype(a.dtype) / dd
            tt = 1 / (e11 * e22 - 1)
            e21 = a21 / dd
            dd = tt / dd
            ck, ck1 = m[:, k], m[:, (k + 1) % n]
            wk = dd * (e11 * ck - e21 * ck1)
            wkp1 = dd * (e22 * ck1 - jnp.conj(e21) * ck)
            delta = ck[:, None] * jnp.conj(wk)[None, :] + ck1[:, None] * jnp.conj(wkp1)[None, :]
        else:
            e21 = a21
            e11 = m[(k + 1) % n, (k + 1) % n] / e21
            e22 = m[k, k] / e21
            t = 1 / (e11 * e22 - 1)
            e21 = t / e21
            ck, ck1 = m[:, k], m[:, (k + 1) % n]
            wk = e21 * (e11 * ck - ck1)
            wkp1 = e21 * (e22 * ck1 - ck)
            delta = ck[:, None] * wk[None, :] + ck1[:, None] * wkp1[None, :]
        blk = m - jnp.where(upd, delta, 0)
        blk = blk.at[:, k].set(jnp.where(below, wk, blk[:, k]))
        blk = blk.at[:, (k + 1) % n].set(jnp.where(below, wkp1, blk[:, (k + 1) % n]))
        new = jnp.where(singular, m, jnp.where(two, blk, one))
        lowmask = idx[:, None] >= idx[None, :]
        new = jnp.where(trailing, _sym_from_lower(jnp.where(lowmask, new, 0), herm), new)
        p1 = (kp + 1).astype(jnp.int32)
        piv = jnp.where(two, piv.at[k].set(-p1).at[(k + 1) % n].set(-p1), piv.at[k].set(p1))
        info = jnp.where((info == 0) & singular, k + 1, info).astype(jnp.int32)
        return k + kstep, new, piv, info

    m0 = _sym_from_lower(a, herm)
    _, m, piv, info = lax.while_loop(lambda s: s[0] < n, step, (jnp.int32(0), m0, jnp.zeros(n, jnp.int32),
                                                                 jnp.int32(0)))
    return jnp.tril(m), piv, info


@lower(aten.linalg_ldl_factor_ex, check=_dtype_check("ldl_factor_kernel_cpu"))
def linalg_ldl_factor_ex(self, hermitian=False, check_errors=False):
    """CPU's LAPACK sytrf/hetrf (lower), reproduced step by step so that the pivots agree. (LAPACK
    blocks the updates of larger matrices: other roundings, but the same pivots in our checks up
    to 130 columns.) A sequential loop over the columns: meant for small matrices."""
    n = self.shape[-1]
    batch = self.shape[:-2]
    if self.size == 0:
        return self, jnp.zeros(batch + (n,), jnp.int32), jnp.zeros(batch, jnp.int32)
    flat = self.reshape((-1, n, n))
    ld, piv, info = jax.vmap(lambda m: _sytf2_lower(m, hermitian))(flat)
    return ld.reshape(self.shape), piv.reshape(batch + (n,)), info.reshape(batch)


def _sytrs_lower(ld, piv, b, hermitian: bool):
    """LAPACK's sytrs/hetrs (lower) for one factorization and right-hand sides ``b`` (n, k):
    the row interchanges and 1x1/2x2 block solves in LAPACK's order."""
    n = ld.shape[-1]
    idx = jnp.arange(n)
    herm = hermitian and jnp.iscomplexobj(ld)
    cj = jnp.conj if herm else (lambda v: v)

    def swap(x, i, j):
        perm = jnp.where(idx == i, j, jnp.where(idx == j, i, idx))
        return x[perm]

    def fwd(state):  # L D Y = B
        k, x = state
        p = piv[k]
        two = p < 0
        kp = jnp.where(two, -p, p) - 1
        x = jnp.where(two, swap(x, (k + 1) % n, kp), swap(x, k, kp))
        # 1x1
        below = (idx > k)[:, None]
        one = x - jnp.where(below, ld[:, k][:, None] * x[k][None, :], 0)
        dkk = ld[k, k].real.astype(ld.dtype) if herm else ld[k, k]
        one = one.at[k].set(one[k] * (1 / dkk))
        # 2x2
        k1 = (k + 1) % n
        below2 = (idx > k + 1)[:, None]
        blk = x - jnp.where(below2, ld[:, k][:, None] * x[k][None, :], 0)
        blk = blk - jnp.where(below2, ld[:, k1][:, None] * x[k1][None, :], 0)
        akm1k = ld[k1, k]
        akm1 = ld[k, k] / cj(akm1k)
        ak = ld[k1, k1] / akm1k
        denom = akm1 * ak - 1
        bkm1 = blk[k] / cj(akm1k)
        bk = blk[k1] / akm1k
        blk = blk.at[k].set((ak * bkm1 - bk) / denom).at[k1].set((akm1 * bk - bkm1) / denom)
        return k + jnp.where(two, 2, 1), jnp.where(two, blk, one)

    def bwd(state):  # L^T X = Y (L^H when Hermitian)
        k, x = state
        p = piv[k]
        two = p < 0
        below = (idx > k)[:, None]
        x = x.at[k].add(-jnp.sum(jnp.where(below, cj(ld[:, k])[:, None] * x, 0), axis=0))
        km1 = jnp.maximum(k - 1, 0)
        x2 = x.at[km1].add(-jnp.sum(jnp.where(below, cj(ld[:, km1])[:, None] * x, 0), axis=0))
        x = jnp.where(two, x2, x)
        kp = jnp.where(two, -p, p) - 1
        return k - jnp.where(two, 2, 1), swap(x, k, kp)

    _, y = lax.while_loop(lambda s: s[0] < n, fwd, (jnp.int32(0), b))
    _, x = lax.while_loop(lambda s: s[0] >= 0, bwd, (jnp.int32(n - 1), y))
    return x


@lower(aten.linalg_ldl_solve, check=_dtype_check("ldl_solve_kernel_cpu"))
def linalg_ldl_solve(LD, pivots, B, hermitian=False):
    n = LD.shape[-1]
    batch = jnp.broadcast_shapes(LD.shape[:-2], pivots.shape[:-1], B.shape[:-2])
    if n == 0 or B.size == 0:
        return jnp.broadcast_to(B, batch + B.shape[-2:])
    dt = jnp.result_type(LD.dtype, B.dtype)
    ld = jnp.broadcast_to(LD, batch + (n, n)).reshape((-1, n, n)).astype(dt)
    piv = jnp.broadcast_to(pivots, batch + (n,)).reshape((-1, n)).astype(jnp.int32)
    b = jnp.broadcast_to(B, batch + B.shape[-2:]).reshape((-1,) + B.shape[-2:]).astype(dt)
    x = jax.vmap(lambda m, p, r: _sytrs_lower(m, p, r, hermitian))(ld, piv, b)
    return x.reshape(batch + B.shape[-2:])
