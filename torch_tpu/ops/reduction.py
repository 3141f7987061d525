"""Reductions, scans, softmax, sorting and selection.

Low-precision (bfloat16/float16) inputs accumulate in float32 and integer sums in int64, as CPU
does; the dispatcher casts the result to torch's dtype. A reduction over ``dim=[]`` (or None)
covers every dimension, except for ``all``/``any`` where an empty list reduces nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from torch_tpu import _dtypes
from torch_tpu.ops._registry import aten, lower

_LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_I64 = np.dtype(jnp.int64)
_F32 = np.dtype(jnp.float32)


def _axes(dim, ndim: int) -> tuple[int, ...] | None:
    """Normalised reduction axes; None means all."""
    if dim is None:
        return None
    if isinstance(dim, int):
        dim = [dim]
    if len(dim) == 0:
        return None
    if ndim == 0:
        return ()
    return tuple(sorted({d % ndim for d in dim}))


def _is_int(x) -> bool:
    return x.dtype == np.bool_ or jnp.issubdtype(x.dtype, jnp.integer)


def _acc(x, dtype=None, floating: bool = False):
    """The accumulation dtype: ``dtype`` first if given, then float32 for low precision and
    int64 for integers (float32 when ``floating``)."""
    if dtype is not None:
        x = x.astype(_dtypes.to_jax(dtype))
    if x.dtype in _LOW:
        return x.astype(_F32)
    if _is_int(x):
        return x.astype(_F32 if floating else _I64)
    return x


def _count(shape, axes) -> int:
    if axes is None:
        return int(np.prod(shape, dtype=np.int64))
    return int(np.prod([shape[a] for a in axes], dtype=np.int64))


def _as_1d(x, dim: int):
    """A 0-dim array as 1-d (torch allows dim 0 / -1 on scalars), with the axis to use."""
    if x.ndim == 0:
        return x.reshape(1), 0
    return x, dim % x.ndim


def _restore(y, x):
    return y.reshape(()) if x.ndim == 0 else y


# -------------------------------------------------------------------------------- sums and means
@lower(aten.sum.dim_IntList, aten.sum.default)
def sum_(self, dim=None, keepdim=False, dtype=None):
    return jnp.sum(_acc(self, dtype), axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.nansum.default)
def nansum(self, dim=None, keepdim=False, dtype=None):
    x = _acc(self, dtype)
    if not _is_int(x):
        x = jnp.where(jnp.isnan(x), jnp.zeros_like(x), x)
    return jnp.sum(x, axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.mean.dim, aten.mean.default)
def mean(self, dim=None, keepdim=False, dtype=None):
    return jnp.mean(_acc(self, dtype, floating=True), axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.prod.dim_int, aten.prod.default)
def prod(self, dim=None, keepdim=False, dtype=None):
    return jnp.prod(_acc(self, dtype), axis=_axes(dim, self.ndim), keepdims=keepdim)


def _var(x, dim, correction, keepdim):
    x = _acc(x, floating=True)
    axes = _axes(dim, x.ndim)
    n = _count(x.shape, axes)
    mu = jnp.mean(x, axis=axes, keepdims=True)
    d = x - mu
    sq = (d * jnp.conj(d)).real if jnp.iscomplexobj(d) else d * d
    c = 1 if correction is None else correction
    var = jnp.sum(sq, axis=axes, keepdims=keepdim) / jnp.maximum(n - c, 0)
    return var, (mu if keepdim else jnp.squeeze(mu, axes))


@lower(aten.var.correction)
def var(self, dim=None, correction=None, keepdim=False):
    return _var(self, dim, correction, keepdim)[0]


@lower(aten.std.correction)
def std(self, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_var(self, dim, correction, keepdim)[0])


@lower(aten.var_mean.correction)
def var_mean(self, dim=None, correction=None, keepdim=False):
    return _var(self, dim, correction, keepdim)


@lower(aten.std_mean.correction)
def std_mean(self, dim=None, correction=None, keepdim=False):
    v, m = _var(self, dim, correction, keepdim)
    return jnp.sqrt(v), m


@lower(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    """max-shifted, with an infinite max replaced by 0 as CPU does (so all -inf gives -inf)."""
    x = _acc(self, floating=True)
    axes = _axes(dim, x.ndim)
    if x.size == 0:
        return jnp.log(jnp.sum(jnp.exp(x), axis=axes, keepdims=keepdim))
    m = jnp.max(x, axis=axes, keepdims=True)
    m = jnp.where(jnp.isinf(m), jnp.zeros_like(m), m)
    out = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    return out if keepdim else jnp.squeeze(out, axes)


# ----------------------------------------------------------------------------------------- norms
def _vector_norm(x, ord, dim, keepdim, dtype=None):  # noqa: A002
    """The p-norm. ``ord`` is usually a traced runtime number, so every special case (inf, -inf, 0,
    1, 2) is computed and the right one selected."""
    if dtype is not None:
        x = x.astype(_dtypes.to_jax(dtype))
    a = _acc(jnp.abs(x), floating=True)
    axes = _axes(dim, x.ndim)

    def red(fn, v, **kw):
        return fn(v, axis=axes, keepdims=keepdim, **kw)

    if isinstance(ord, (int, float)):
        p = float(ord)
        if p == float("inf"):
            return red(jnp.max, a, initial=0.0)
        if p == float("-inf"):
            return red(jnp.min, a, initial=jnp.inf)
        if p == 0:
            return red(jnp.sum, (a != 0).astype(a.dtype))
        if p == 1:
            return red(jnp.sum, a)
        if p == 2:
            return jnp.sqrt(red(jnp.sum, a * a))
        return red(jnp.sum, a**p) ** (1 / p)
    p = jnp.asarray(ord, a.dtype)
    safe_p = jnp.where((p == 0) | jnp.isinf(p), 1.0, p).astype(a.dtype)
    general = red(jnp.sum, a**safe_p) ** (1 / safe_p)
    return jnp.select(
        [p == jnp.inf, p == -jnp.inf, p == 0, p == 1, p == 2],
        [red(jnp.max, a, initial=0.0), red(jnp.min, a, initial=jnp.inf), red(jnp.sum, (a != 0).astype(a.dtype)),
         red(jnp.sum, a), jnp.sqrt(red(jnp.sum, a * a))],
        general,
    )


@lower(aten.linalg_vector_norm.default)
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, dtype=None):  # noqa: A002
    return _vector_norm(self, ord, dim, keepdim, dtype)


@lower(aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype)
def norm(self, p=2, dim=None, keepdim=False, dtype=None):
    return _vector_norm(self, 2 if p is None else p, dim, keepdim, dtype)


# ------------------------------------------------------------------------------ max, min, all, any
@lower(aten.amax.default)
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.amin.default)
def amin(self, dim=(), keepdim=False):
    return jnp.min(self, axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.max.default)
def max_(self):
    return jnp.max(self)


@lower(aten.min.default)
def min_(self):
    return jnp.min(self)


def _value_index(x, dim, keepdim, val_fn, arg_fn):
    """(values, indices) along ``dim``; NaN wins, with the index of the first NaN, as on CPU."""
    y, d = _as_1d(x, dim)
    v = val_fn(y, axis=d, keepdims=keepdim)
    i = arg_fn(y, axis=d, keepdims=keepdim).astype(_I64)
    return _restore(v, x), _restore(i, x)


@lower(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _value_index(self, dim, keepdim, jnp.max, jnp.argmax)


@lower(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _value_index(self, dim, keepdim, jnp.min, jnp.argmin)


def _arg(x, dim, keepdim, fn):
    if dim is None:
        out = fn(x.reshape(-1)).astype(_I64)
        return out.reshape((1,) * x.ndim) if keepdim else out
    y, d = _as_1d(x, dim)
    return _restore(fn(y, axis=d, keepdims=keepdim).astype(_I64), x)


@lower(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _arg(self, dim, keepdim, jnp.argmax)


@lower(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _arg(self, dim, keepdim, jnp.argmin)


@lower(aten.aminmax.default)
def aminmax(self, dim=None, keepdim=False):
    if dim is None:
        lo, hi = jnp.min(self), jnp.max(self)
        if keepdim:
            lo, hi = lo.reshape((1,) * self.ndim), hi.reshape((1,) * self.ndim)
        return lo, hi
    y, d = _as_1d(self, dim)
    return (_restore(jnp.min(y, axis=d, keepdims=keepdim), self),
            _restore(jnp.max(y, axis=d, keepdims=keepdim), self))


def _truth(x):
    return x if x.dtype == np.bool_ else x != 0


def _all_any(fn, x, dim, keepdim):
    if isinstance(dim, (list, tuple)) and len(dim) == 0:
        return _truth(x)  # an empty dim list reduces nothing
    return fn(_truth(x), axis=_axes(dim, x.ndim), keepdims=keepdim)


@lower(aten.all.default, aten.all.dim, aten.all.dims)
def all_(self, dim=None, keepdim=False):
    return _all_any(jnp.all, self, dim, keepdim)


@lower(aten.any.default, aten.any.dim, aten.any.dims)
def any_(self, dim=None, keepdim=False):
    return _all_any(jnp.any, self, dim, keepdim)


@lower(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self, dim=None):
    return jnp.sum(_truth(self), axis=_axes(dim, self.ndim), dtype=_I64)


# ----------------------------------------------------------------------------------------- scans
@lower(aten.cumsum.default)
def cumsum(self, dim, dtype=None):
    x = _acc(self, dtype)
    y, d = _as_1d(x, dim)
    return _restore(jnp.cumsum(y, axis=d), x)


@lower(aten.cumprod.default)
def cumprod(self, dim, dtype=None):
    x = _acc(self, dtype)
    y, d = _as_1d(x, dim)
    return _restore(jnp.cumprod(y, axis=d), x)


def _cum_extreme(x, dim, better):
    """Running max/min with its index: a later equal value, or any NaN, takes over (CPU's rule).
    The combine is a max over the total order (is NaN, value, index), hence associative."""
    y, d = _as_1d(x, dim)
    idx = lax.broadcasted_iota(_I64, y.shape, d)

    def combine(left, right):
        lv, li = left
        rv, ri = right
        take = jnp.isnan(rv) | (~jnp.isnan(lv) & better(rv, lv)) if not _is_int(y) else better(rv, lv)
        return jnp.where(take, rv, lv), jnp.where(take, ri, li)

    v, i = lax.associative_scan(combine, (y, idx), axis=d)
    return _restore(v, x), _restore(i, x)


@lower(aten.cummax.default)
def cummax(self, dim):
    return _cum_extreme(self, dim, jnp.greater_equal)


@lower(aten.cummin.default)
def cummin(self, dim):
    return _cum_extreme(self, dim, jnp.less_equal)


@lower(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    x = _acc(self, floating=True)
    y, d = _as_1d(x, dim)
    if y.shape[d] == 0:
        return x
    return _restore(lax.cumlogsumexp(y, axis=d), x)


# --------------------------------------------------------------------------------------- softmax
def _float_up(x):
    return x.astype(_F32) if x.dtype in _LOW else x


@lower(aten._softmax.default)
def softmax(self, dim, half_to_float):
    x = _float_up(self)
    y, d = _as_1d(x, dim)
    m = jnp.max(y, axis=d, keepdims=True, initial=-jnp.inf)
    e = jnp.exp(y - m)
    return _restore(e / jnp.sum(e, axis=d, keepdims=True), x)


@lower(aten._log_softmax.default)
def log_softmax(self, dim, half_to_float):
    x = _float_up(self)
    y, d = _as_1d(x, dim)
    m = jnp.max(y, axis=d, keepdims=True, initial=-jnp.inf)
    shifted = y - m
    return _restore(shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=d, keepdims=True)), x)


@lower(aten._softmax_backward_data.default)
def softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _float_up(grad_output), _float_up(output)
    g1, d = _as_1d(g, dim)
    y1, _ = _as_1d(y, dim)
    gy = g1 * y1
    return _restore(gy - y1 * jnp.sum(gy, axis=d, keepdims=True), g)


@lower(aten._log_softmax_backward_data.default)
def log_softmax_backward_data(grad_output, output, dim, input_dtype):
    g, y = _float_up(grad_output), _float_up(output)
    g1, d = _as_1d(g, dim)
    y1, _ = _as_1d(y, dim)
    return _restore(g1 - jnp.exp(y1) * jnp.sum(g1, axis=d, keepdims=True), g)


# ------------------------------------------------------------------------------ sort and select
def _sort_key(x):
    """A key whose order is torch's: -0.0 equals 0.0, and every NaN is one NaN, greater than +inf."""
    if x.dtype == np.bool_:
        return x.astype(jnp.uint8)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.where(jnp.isnan(x), jnp.nan, x + 0).astype(x.dtype)
    return x


def _sort_last(x, descending: bool):
    """A stable sort along the last axis: (values, int64 indices). Descending is the reverse of a
    stable ascending sort of the reversed array, which keeps equal elements in index order."""
    n = x.shape[-1]
    idx = lax.broadcasted_iota(_I64, x.shape, x.ndim - 1)
    if descending:
        x, idx = jnp.flip(x, -1), (n - 1) - idx
    _, v, i = lax.sort((_sort_key(x), x, idx), dimension=x.ndim - 1, num_keys=1, is_stable=True)
    if descending:
        v, i = jnp.flip(v, -1), jnp.flip(i, -1)
    return v, i


def _sort(x, dim, descending):
    y, d = _as_1d(x, dim)
    v, i = _sort_last(jnp.moveaxis(y, d, -1), descending)
    return _restore(jnp.moveaxis(v, -1, d), x), _restore(jnp.moveaxis(i, -1, d), x)


@lower(aten.sort.default)
def sort(self, dim=-1, descending=False):
    return _sort(self, dim, descending)


@lower(aten.sort.stable)
def sort_stable(self, stable=None, dim=-1, descending=False):
    return _sort(self, dim, descending)


@lower(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    """From a full stable sort: NaN counts as the largest value, as on CPU."""
    y, d = _as_1d(self, dim)
    v, i = _sort_last(jnp.moveaxis(y, d, -1), largest)
    v, i = jnp.moveaxis(v[..., :k], -1, d), jnp.moveaxis(i[..., :k], -1, d)
    return _restore(v, self), _restore(i, self)


def _pick(x, dim, keepdim, position_fn):
    """Sorts along ``dim`` (NaN last) and takes, per row, the element at ``position_fn(sorted)``."""
    y, d = _as_1d(x, dim)
    v, i = _sort_last(jnp.moveaxis(y, d, -1), False)
    pos = position_fn(v)[..., None]
    val = jnp.take_along_axis(v, pos, axis=-1)
    ind = jnp.take_along_axis(i, pos, axis=-1)
    if keepdim:
        val, ind = jnp.moveaxis(val, -1, d), jnp.moveaxis(ind, -1, d)
    else:
        val, ind = val[..., 0], ind[..., 0]
    return _restore(val, x), _restore(ind, x)


def _nan_count(v):
    if jnp.issubdtype(v.dtype, jnp.floating):
        return jnp.sum(jnp.isnan(v), axis=-1)
    return jnp.zeros(v.shape[:-1], _I64)


@lower(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    return _pick(self, dim, keepdim, lambda v: jnp.full(v.shape[:-1], k - 1, _I64))


def _median_pos(v):
    """The lower median, or the first NaN when there is one (CPU's median propagates NaN)."""
    n = v.shape[-1]
    nans = _nan_count(v)
    return jnp.where(nans > 0, n - nans, (n - 1) // 2).astype(_I64)


def _nanmedian_pos(v):
    """The lower median of the non-NaN values (the first NaN when there are none)."""
    n = v.shape[-1] - _nan_count(v)
    return jnp.maximum((n - 1) // 2, 0).astype(_I64)


@lower(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    return _pick(self, dim, keepdim, _median_pos)


@lower(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    return _pick(self, dim, keepdim, _nanmedian_pos)


@lower(aten.median.default)
def median(self):
    if self.size == 0:
        return jnp.full((), jnp.nan, self.dtype) if not _is_int(self) else jnp.zeros((), self.dtype)
    return _pick(self.reshape(-1), 0, False, _median_pos)[0]


@lower(aten.nanmedian.default)
def nanmedian(self):
    if self.size == 0:
        return jnp.full((), jnp.nan, self.dtype) if not _is_int(self) else jnp.zeros((), self.dtype)
    return _pick(self.reshape(-1), 0, False, _nanmedian_pos)[0]


@lower(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """The most frequent value (the smallest on ties) and the index of its last occurrence in the
    sorted order, as CPU's run scan gives."""
    y, d = _as_1d(self, dim)
    v, i = _sort_last(jnp.moveaxis(y, d, -1), False)
    n = v.shape[-1]
    pos = lax.broadcasted_iota(_I64, v.shape, v.ndim - 1)
    new_run = jnp.concatenate([jnp.ones(v.shape[:-1] + (1,), bool), v[..., 1:] != v[..., :-1]], axis=-1)
    run_end = jnp.concatenate([v[..., 1:] != v[..., :-1], jnp.ones(v.shape[:-1] + (1,), bool)], axis=-1)
    start = lax.cummax(jnp.where(new_run, pos, 0), axis=v.ndim - 1)
    freq = jnp.where(run_end, pos - start + 1, 0)
    best = jnp.argmax(freq, axis=-1)[..., None] if n else jnp.zeros(v.shape[:-1] + (1,), _I64)
    val = jnp.take_along_axis(v, best, axis=-1)
    ind = jnp.take_along_axis(i, best, axis=-1)
    if keepdim:
        val, ind = jnp.moveaxis(val, -1, d), jnp.moveaxis(ind, -1, d)
    else:
        val, ind = val[..., 0], ind[..., 0]
    return _restore(val, self), _restore(ind, self)
