"""Reductions, scans, softmax, sorting and selection.

Low-precision (bfloat16/float16) inputs accumulate in float32 and integer sums in int64, as CPU
does; the dispatcher casts the result to torch's dtype. A reduction over ``dim=[]`` (or None)
covers every dimension, except for ``all``/``any`` where an empty list reduces nothing.
"""

from __future__ import annotations

import builtins
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops import tie_order
from torch_tpu.ops._registry import aten, kernel, lower
from torch_tpu.ops.elementwise import complex_logaddexp
from torch_tpu.ops.factories import _linspace_values
from torch_tpu.ops.nn import run_jax
from torch_tpu.tensor.storage import new_tensor

_LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_I64 = np.dtype(jnp.int64)
_F32 = np.dtype(jnp.float32)


def _dims_limit(ndim: int) -> None:
    """CPU's reduction kernels index dimensions with a 64-bit mask: reducing a tensor of more
    than 64 dimensions along given dims is an error there (all of them, ``dim=None``, is not)."""
    if ndim > 64:
        raise RuntimeError(f"only tensors with up to 64 dims are supported, but got a tensor of {ndim} dims")


def _axes(dim, ndim: int) -> tuple[int, ...] | None:
    """Normalised reduction axes; None means all."""
    if dim is None:
        return None
    _dims_limit(ndim)
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


def _nansum_meta(self, dim=None, keepdim=False, *, dtype=None, **out):
    """torch's meta kernel reads ``dim=[]`` as "reduce nothing"; CPU's nansum, like sum, reduces
    every dimension then."""
    return aten.nansum(self, None if dim is not None and len(dim) == 0 else dim, keepdim, dtype=dtype, **out)


@lower(aten.nansum.default, meta=_nansum_meta)
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


def _dof_check(name: str):
    """The check of var/std: CPU warns (each call) when the correction leaves no degrees of
    freedom, then returns inf or NaN."""

    def check(self, dim=None, correction=None, keepdim=False, **out):
        axes = range(self.dim()) if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0) else (
            [dim] if isinstance(dim, int) else dim)
        n = math.prod(self.shape[d] for d in axes) if self.dim() else 1
        if self.numel() and n - (1 if correction is None else correction) <= 0:
            warnings.warn(f"{name}(): degrees of freedom is <= 0. Correction should be strictly less than the "
                          "reduction factor (input numel divided by output numel).", UserWarning, stacklevel=3)

    return check


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


@lower(aten.var.correction, check=_dof_check("var"))
def var(self, dim=None, correction=None, keepdim=False):
    return _var(self, dim, correction, keepdim)[0]


@lower(aten.std.correction, check=_dof_check("std"))
def std(self, dim=None, correction=None, keepdim=False):
    return jnp.sqrt(_var(self, dim, correction, keepdim)[0])


@lower(aten.var_mean.correction, check=_dof_check("var_mean"))
def var_mean(self, dim=None, correction=None, keepdim=False):
    return _var(self, dim, correction, keepdim)


@lower(aten.std_mean.correction, check=_dof_check("std_mean"))
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
    # complex: shifted by the largest real part (a real number), so the imaginary part is the
    # complex log's, in (-pi, pi], as on CPU
    m = jnp.max(jnp.real(x) if jnp.iscomplexobj(x) else x, axis=axes, keepdims=True)
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


@lower(aten.dist.default, static_scalars=True, graph_only=True)
def dist(self, other, p=2):
    """The p-norm of ``self - other`` (eager mode runs torch's decomposition)."""
    diff = jnp.subtract(*jnp.broadcast_arrays(self, other))
    return _vector_norm(diff, p, None, False, None)


@lower(aten.norm.Scalar, aten.norm.ScalarOpt_dim, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype)
def norm(self, p=2, dim=None, keepdim=False, dtype=None):
    return _vector_norm(self, 2 if p is None else p, dim, keepdim, dtype)


# ------------------------------------------------------------------------------ max, min, all, any
def _no_identity_meta(name: str, op: torch._ops.OpOverload):
    """The meta of a reduction without an identity (max, min): CPU refuses an empty reduced
    dimension with an IndexError naming it, and a full reduction of an empty tensor with a
    RuntimeError, where torch's meta kernel says something else (or nothing)."""

    def meta(self, dim=None, keepdim=False, **out):
        if self.numel() == 0:
            if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
                raise RuntimeError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                                   "Specify the reduction dim with the 'dim' argument.")
            for d in [dim] if isinstance(dim, int) else dim:
                d = d % builtins.max(self.ndim, 1)
                if self.ndim and self.shape[d] == 0:
                    raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
        return op(self, dim, keepdim, **out) if dim is not None else op(self, **out)

    return meta


@lower(aten.amax.default, meta=_no_identity_meta("amax", aten.amax))
def amax(self, dim=(), keepdim=False):
    return jnp.max(self, axis=_axes(dim, self.ndim), keepdims=keepdim)


@lower(aten.amin.default, meta=_no_identity_meta("amin", aten.amin))
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


@lower(aten.max.dim, meta=_no_identity_meta("max", aten.max))
def max_dim(self, dim, keepdim=False):
    return _value_index(self, dim, keepdim, jnp.max, jnp.argmax)


@lower(aten.min.dim, meta=_no_identity_meta("min", aten.min))
def min_dim(self, dim, keepdim=False):
    return _value_index(self, dim, keepdim, jnp.min, jnp.argmin)


def _arg_meta(name: str, op):
    """argmax/argmin of an empty tensor: CPU's IndexError, for a full reduction as for an empty
    reduced dim (torch's meta kernel raises a RuntimeError for the first)."""

    def meta(self, dim=None, keepdim=False, **out):
        if self.numel() == 0:
            if dim is None:
                raise IndexError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0.")
            d = dim % builtins.max(self.ndim, 1)
            if self.ndim and self.shape[d] == 0:
                raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
        return op(self, dim, keepdim, **out)

    return meta


def _arg(x, dim, keepdim, fn):
    if dim is None:
        out = fn(x.reshape(-1)).astype(_I64)
        return out.reshape((1,) * x.ndim) if keepdim else out
    _dims_limit(x.ndim)
    y, d = _as_1d(x, dim)
    return _restore(fn(y, axis=d, keepdims=keepdim).astype(_I64), x)


@lower(aten.argmax.default, meta=_arg_meta("argmax", aten.argmax))
def argmax(self, dim=None, keepdim=False):
    return _arg(self, dim, keepdim, jnp.argmax)


@lower(aten.argmin.default, meta=_arg_meta("argmin", aten.argmin))
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
    if jnp.iscomplexobj(y):
        # CPU accumulates complex values one by one with logaddexp's complex formula, whose
        # imaginary parts are not reduced to (-pi, pi]: the same sequential scan
        def step(acc, v):
            acc = complex_logaddexp(acc, v)
            return acc, acc

        moved = jnp.moveaxis(y, d, 0)
        _, out = lax.scan(step, moved[0], moved[1:])
        return _restore(jnp.moveaxis(jnp.concatenate([moved[:1], out]), 0, d), x)
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
    """From a full stable sort (NaN counts as the largest value, as on CPU), with CPU's choice
    among equal elements where there are any (``tie_order``). ``sorted=False`` gives the same
    elements as CPU, in sorted order."""
    y, d = _as_1d(self, dim)
    y = jnp.moveaxis(y, d, -1)
    v, i = _sort_last(y, largest)
    n = y.shape[-1]
    rows = v.reshape(-1, n)
    picked = tie_order.topk_indices(rows, i.reshape(-1, n), k).astype(_I64)
    i = picked.reshape(y.shape[:-1] + (k,))
    v = jnp.take_along_axis(y, i, axis=-1)
    v, i = jnp.moveaxis(v, -1, d), jnp.moveaxis(i, -1, d)
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


def _empty_dim_meta(name: str, op, dim_at: int):
    """The meta of a selection along one dim (median, kthvalue): an empty reduced dim is CPU's
    IndexError, checked before anything else (kthvalue's k, for one)."""

    def meta(self, *args, **kwargs):
        dim = kwargs.get("dim", args[dim_at] if len(args) > dim_at else -1)
        d = dim % builtins.max(self.ndim, 1)
        if self.ndim and self.shape[d] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
        return op(self, *args, **kwargs)

    return meta


@lower(aten.kthvalue.default, meta=_empty_dim_meta("kthvalue", aten.kthvalue, 1))
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


@lower(aten.median.dim, meta=_empty_dim_meta("median", aten.median, 0))
def median_dim(self, dim, keepdim=False):
    return _pick(self, dim, keepdim, _median_pos)


@lower(aten.nanmedian.dim, meta=_empty_dim_meta("median", aten.nanmedian, 0))
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


# ----------------------------------------------------------------------------- histograms
# Hand-written kernels: torch has no meta kernels for the histogram ops, and the data-dependent
# range checks CPU makes need a host read of the range (CPU reads it too).
def _hist_dtype_check(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.float64):
        name = torch.empty(0, dtype=x.dtype).type().removeprefix("torch.").removesuffix("Tensor")
        raise NotImplementedError(f'"histogramdd" not implemented for \'{name}\'')


def _hist_checks(x: torch.Tensor, bins, weight: torch.Tensor | None, range_=None) -> None:
    """CPU's checks for an (N, D) input and D bin counts (ints) or edge tensors."""
    _hist_dtype_check(x)
    if x.dim() < 2:
        raise RuntimeError("torch.histogramdd: input tensor should have at least 2 dimensions")
    d = x.shape[-1]
    if len(bins) != d:
        raise RuntimeError("histogramdd: The size of bins must be equal to the innermost dimension of the input.")
    for i, b in enumerate(bins):
        if isinstance(b, torch.Tensor):
            if b.dim() != 1:
                raise RuntimeError(f"torch.histogramdd: bins tensor should have one dimension, but got {b.dim()} "
                                   f"dimensions in the bins tensor for dimension {i}")
            if b.numel() < 2:
                raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {b.numel() - 1} for dimension {i}")
        elif b <= 0:
            raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {b} for dimension {i}")
    if weight is not None:
        if weight.shape != x.shape[:-1]:
            raise RuntimeError(
                "torch.histogramdd: if weight tensor is provided it should have the same shape as the input tensor "
                f"excluding its innermost dimension, but got input with shape {list(x.shape)} and weight with shape "
                f"{list(weight.shape)}")
        if weight.dtype != x.dtype:
            raise RuntimeError(
                "torch.histogramdd: if weight tensor is provided, input tensor and weight tensor should have the same "
                f"dtype, but got input({_c_name(x.dtype)}), and weight({_c_name(weight.dtype)})")
    if range_ is not None:
        if len(range_) != 2 * d:
            raise RuntimeError(f"torch.histogramdd: for a {d}-dimensional histogram range should have {2 * d} "
                               f"elements, but got {len(range_)}")
        for i in builtins.range(d):
            _hist_range_check(i, range_[2 * i], range_[2 * i + 1])


def _c_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float", torch.float64: "double"}.get(dtype, str(dtype).removeprefix("torch."))


def _fmt(v: float) -> str:
    return f"{v:g}" if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))


def _hist_range_check(dim: int, lo: float, hi: float) -> None:
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise RuntimeError(f"torch.histogramdd: dimension {dim}'s range [{_fmt(lo)}, {_fmt(hi)}] is not finite")
    if lo > hi:
        raise RuntimeError(f"torch.histogramdd: min should not exceed max, but got min {_fmt(lo)} max {_fmt(hi)} "
                           f"for dimension {dim}")


def _hist_edges(x, bins, range_):
    """CPU's bin edges: linspace over the range (the data's min and max by default, widened by
    0.5 each way when they are equal), in the input's dtype."""
    edges = []
    for d, b in enumerate(bins):
        if range_ is not None:
            lo, hi = jnp.float64(range_[2 * d]), jnp.float64(range_[2 * d + 1])
        elif x.shape[0] == 0:
            lo, hi = jnp.float64(0), jnp.float64(1)
        else:
            lo, hi = jnp.min(x[:, d]).astype(jnp.float64), jnp.max(x[:, d]).astype(jnp.float64)
        same = lo == hi
        lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
        edges.append(_linspace_values(lo, hi, b + 1).astype(x.dtype))
    return edges


def _hist_counts(x, edges, weight, density: bool):
    """Counts (or weights) per bin: an element belongs to bin i when edges[i] <= x < edges[i+1]
    (the last bin includes its right edge); elements outside the edges, NaNs too, are dropped."""
    n = x.shape[0]
    shape = tuple(e.shape[0] - 1 for e in edges)
    flat = jnp.zeros((n,), jnp.int64)
    valid = jnp.ones((n,), bool)
    for d, e in enumerate(edges):
        xd = x[:, d]
        valid &= (xd >= e[0]) & (xd <= e[-1])
        pos = jnp.searchsorted(e, xd, side="right") - 1
        pos = jnp.clip(pos, 0, shape[d] - 1)
        flat = flat * shape[d] + pos
    w = jnp.ones((n,), x.dtype) if weight is None else weight.reshape(n)
    size = math.prod(shape)
    hist = jnp.zeros((size,), x.dtype).at[jnp.where(valid, flat, size)].add(w, mode="drop").reshape(shape)
    if density:
        hist = hist / jnp.sum(hist)
        for d, e in enumerate(edges):
            widths = jnp.diff(e)
            hist = hist / widths.reshape((1,) * d + (-1,) + (1,) * (len(edges) - d - 1))
    return hist


def _hist_bin_ct(x, weight=None, *, bins, range_, density, edges_only=False, hist_only=False):
    x = x.reshape(-1, x.shape[-1])
    edges = _hist_edges(x, bins, range_)
    if edges_only:
        return tuple(edges)
    hist = _hist_counts(x, edges, weight, density)
    return hist if hist_only else (hist, *edges)


def _hist_bin_tensors(x, weight=None, *, density, **edges):
    """``edges`` come as e0, e1, ... (one runtime input each)."""
    ordered = [edges[f"e{d}"] for d in builtins.range(len(edges))]
    return _hist_counts(x.reshape(-1, x.shape[-1]), ordered, weight, density)


def _hist_run(fn, static: dict, dynamic: dict, dtypes: list) -> list[torch.Tensor]:
    outs = run_jax("aten.histogramdd", fn, static, dynamic, dtypes)
    return [new_tensor(tuple(o.shape), d, o) for o, d in zip(outs, dtypes)]


def _hist_finite(edges: list[torch.Tensor]) -> None:
    """CPU raises when the data's own range is not finite (a host read of the outer edges)."""
    ends = torch.stack([torch.stack([e[0], e[-1]]) for e in edges]).cpu().double()
    for d, (lo, hi) in enumerate(ends.tolist()):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            _hist_range_check(d, lo, hi)


def _histdd_bin_ct(x, bins, range_, weight, density, *, hist_only: bool, edges_only: bool):
    bins = [int(b) for b in bins]
    _hist_checks(x, bins, weight, range_)
    rng = None if range_ is None else tuple(float(r) for r in range_)
    dyn = {"x": x} if weight is None else {"x": x, "weight": weight}
    static = {"bins": tuple(bins), "range_": rng, "density": bool(density), "edges_only": edges_only,
              "hist_only": hist_only}
    if rng is None and x.numel() and not edges_only:  # check the range first, as CPU does
        _hist_finite(_hist_run(_hist_bin_ct, {**static, "edges_only": True, "hist_only": False}, {"x": x},
                               [x.dtype] * len(bins)))
    if edges_only:
        out = _hist_run(_hist_bin_ct, static, dyn, [x.dtype] * len(bins))
        if rng is None and x.numel():
            _hist_finite(out)
        return out
    return _hist_run(_hist_bin_ct, static, dyn, [x.dtype] * (1 if hist_only else 1 + len(bins)))


@kernel(aten.histogram.bin_ct)
def _histogram_bin_ct(self, bins=100, *, range=None, weight=None, density=False):
    x = self.reshape(-1, 1)
    w = None if weight is None else weight.reshape(-1)
    if weight is not None and weight.shape != self.shape:
        _hist_checks(x, [bins], weight)
    hist, edges = _histdd_bin_ct(x, [bins], range, w, density, hist_only=False, edges_only=False)
    return hist, edges


@kernel(aten.histogram.bins_tensor)
def _histogram_bins_tensor(self, bins, *, weight=None, density=False):
    x = self.reshape(-1, 1)
    if weight is not None and weight.shape != self.shape:
        _hist_checks(x, [bins], weight)
    w = None if weight is None else weight.reshape(-1)
    return _histdd_from_tensors(x, [bins], w, density), bins.clone()


def _histdd_from_tensors(x, bins, weight, density):
    _hist_checks(x, bins, weight)
    dyn = {"x": x, **{f"e{d}": b for d, b in enumerate(bins)}}
    if weight is not None:
        dyn["weight"] = weight
    return _hist_run(_hist_bin_tensors, {"density": bool(density)}, dyn, [x.dtype])[0]


@kernel(aten._histogramdd_bin_edges.default)
def _histogramdd_bin_edges(self, bins, *, range=None, weight=None, density=False):
    return _histdd_bin_ct(self, bins, range, weight, density, hist_only=False, edges_only=True)


@kernel(aten._histogramdd_from_bin_cts.default)
def _histogramdd_from_bin_cts(self, bins, *, range=None, weight=None, density=False):
    return _histdd_bin_ct(self, bins, range, weight, density, hist_only=True, edges_only=False)[0]


@kernel(aten._histogramdd_from_bin_tensors.default)
def _histogramdd_from_bin_tensors(self, bins, *, weight=None, density=False):
    return _histdd_from_tensors(self, list(bins), weight, density)


# ------------------------------------------------------------------------- segment reduce
def _segments(data, lengths, offsets, axis: int):
    """(data with the segment axis first and batch dims flattened: (B, L, rest...), segment ids
    (B, L), number of segments S, and a function putting (B, S, rest...) back in place).
    Elements past the last segment get id S (dropped by the segment ops)."""
    if offsets is None:
        offsets = jnp.concatenate([jnp.zeros(lengths.shape[:-1] + (1,), lengths.dtype),
                                   jnp.cumsum(lengths, axis=-1)], axis=-1)
    nb = offsets.ndim - 1  # leading batch dims, shared by data
    s = offsets.shape[-1] - 1
    batch = data.shape[:nb]
    x = jnp.moveaxis(data, axis, nb)
    rest = x.shape[nb + 1:]
    x = x.reshape((-1,) + x.shape[nb:])
    offs = offsets.reshape(-1, s + 1)
    pos = jnp.arange(x.shape[1])
    ids = jax.vmap(lambda o: jnp.searchsorted(o[1:], pos, side="right"))(offs)
    ids = jnp.where(pos[None, :] < offs[:, -1:], ids, s)

    def restore(y):
        return jnp.moveaxis(y.reshape(batch + (s,) + rest), nb, axis)

    return x, ids, s, restore


def _seg_apply(fn, x, ids, s):
    return jax.vmap(lambda xb, ib: fn(xb, ib, num_segments=s))(x, ids)


def _seg_count(x, ids, s):
    ones = jnp.ones(x.shape[:2], jnp.int64)
    c = _seg_apply(jax.ops.segment_sum, ones, ids, s)
    return c.reshape(c.shape + (1,) * (x.ndim - 2))


def _segment_reduce_check(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                          initial=None):
    """CPU's checks on the lengths' values (a host read, as on CPU)."""
    if lengths is None or unsafe or lengths.dtype not in (torch.int32, torch.int64):
        return
    lens = lengths.cpu()
    if bool((lens < 0).any()):
        raise RuntimeError("lengths contains negative value!")
    size = data.shape[lengths.dim() - 1] if data.dim() >= lengths.dim() else -1
    if lens.numel() and not bool((lens.sum(-1) == size).all()):
        raise RuntimeError("segment_reduce(): Expected all rows of lengths along axis to sum to "
                           "data.size(lengths.dim()-1) when !unsafe.")


@lower(aten.segment_reduce, check=_segment_reduce_check)
def segment_reduce(data, reduce, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    """CPU's semantics: ``initial`` joins every segment (mean divides by the segment's length
    only); empty segments give ``initial``, or 0 (sum), 1 (prod), -inf (max), inf (min), nan (mean)."""
    x, ids, s, restore = _segments(_acc(data) if data.dtype in _LOW else data, lengths, offsets, axis)
    init = None if initial is None else jnp.asarray(initial).astype(x.dtype)
    cnt = _seg_count(x, ids, s)
    if reduce in ("sum", "mean"):
        out = _seg_apply(jax.ops.segment_sum, x, ids, s)
        if init is not None:
            out = out + init
        if reduce == "mean":
            mean = out / cnt.astype(x.dtype)
            out = jnp.where(cnt == 0, jnp.nan if init is None else init, mean)
    elif reduce == "prod":
        out = _seg_apply(jax.ops.segment_prod, x, ids, s)
        out = out if init is None else out * init
    else:
        fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
        out = _seg_apply(fn, x, ids, s)
        inf = jnp.asarray(-jnp.inf if reduce == "max" else jnp.inf, x.dtype)
        out = jnp.where(cnt == 0, inf, out)
        if init is not None:
            out = jnp.maximum(out, init) if reduce == "max" else jnp.minimum(out, init)
    return restore(out)


@lower(aten._segment_reduce_backward)
def _segment_reduce_backward(grad, output, data, reduce, lengths=None, offsets=None, axis=0, initial=None):
    """CPU's gradients: max/min give the gradient to the elements equal to the result (split
    among ties when it is positive, as CPU's kernel does); prod divides the result by the element
    (the product of the others where the element is zero)."""
    dt = _acc(data).dtype
    x, ids, s, _ = _segments(data.astype(dt), lengths, offsets, axis)
    g, _, _, _ = _segments(grad.astype(dt), _seg_lengths_like(lengths, offsets), None, axis)
    out, _, _, _ = _segments(output.astype(dt), _seg_lengths_like(lengths, offsets), None, axis)

    def per_elem(y):  # (B, S, rest...) -> (B, L, rest...), zero for unsegmented elements
        take = jax.vmap(lambda yb, ib: jnp.take(yb, jnp.minimum(ib, s - 1), axis=0))(y, ids)
        inside = (ids < s).reshape(ids.shape + (1,) * (y.ndim - 2))
        return jnp.where(inside, take, 0)

    ge, oe = per_elem(g), per_elem(out)
    if reduce == "sum":
        res = ge
    elif reduce == "mean":
        res = ge / jnp.maximum(per_elem(_seg_count(x, ids, s)), 1).astype(dt)
    elif reduce in ("max", "min"):
        hit = (x == oe) | jnp.isnan(x)
        ties = per_elem(_seg_apply(jax.ops.segment_sum, hit.astype(dt), ids, s))
        res = jnp.where(hit, ge, 0)
        res = jnp.where(res > 0, res / jnp.where(ties == 0, 1, ties), res)  # CPU splits positive ones only
    else:  # prod
        zero = x == 0
        nz_prod = _seg_apply(jax.ops.segment_prod, jnp.where(zero, 1, x), ids, s)
        if initial is not None:
            nz_prod = nz_prod * jnp.asarray(initial).astype(dt)
        zeros = _seg_apply(jax.ops.segment_sum, zero.astype(jnp.int64), ids, s)
        others = jnp.where(per_elem(zeros) == 1, per_elem(nz_prod), 0)
        res = ge * jnp.where(zero, others, oe / jnp.where(zero, 1, x))
    nb = (lengths if lengths is not None else offsets).ndim - 1
    res = res.reshape(data.shape[:nb] + res.shape[1:])
    return jnp.moveaxis(res, nb, axis)


def _seg_lengths_like(lengths, offsets):
    """Lengths giving one element per segment: to put a (.., S, ..) tensor in the (B, L) layout."""
    ref = lengths if lengths is not None else offsets[..., 1:]
    return jnp.ones(ref.shape, jnp.int64)


# ---------------------------------------------------------------------------- hash_tensor
@lower(aten.hash_tensor)
def hash_tensor(self, dim=(), keepdim=False, mode=0):
    """mode 0, CPU's only one: the xor of the elements' bits, each element widened to float64
    (floats) or int64 (integers, bools) first, as uint64."""
    wide = jnp.float64 if jnp.issubdtype(self.dtype, jnp.floating) else jnp.int64
    bits = lax.bitcast_convert_type(self.astype(wide), jnp.uint64)
    axes = _axes(list(dim), self.ndim)
    axes = tuple(range(self.ndim)) if axes is None else axes
    out = lax.reduce(bits, np.uint64(0), lax.bitwise_xor, axes)
    if keepdim:
        out = jnp.expand_dims(out, axes)
    return out


# Histograms in a graph: the same bin math as the eager kernels, without their host checks of a
# non-finite data range (a graph cannot raise on a value it computes).
@lower(aten.histogram.bin_ct, graph_only=True)
def histogram_bin_ct(self, bins=100, range=None, weight=None, density=False):  # noqa: A002
    rng = None if range is None else tuple(float(r) for r in range)
    w = None if weight is None else weight.reshape(-1)
    return _hist_bin_ct(self.reshape(-1, 1), w, bins=(bins,), range_=rng, density=density)


@lower(aten.histogram.bins_tensor, graph_only=True)
def histogram_bins_tensor(self, bins, weight=None, density=False):
    w = None if weight is None else weight.reshape(-1)
    return _hist_bin_tensors(self.reshape(-1, 1), w, density=density, e0=bins), bins


@lower(aten._histogramdd_bin_edges.default, graph_only=True)
def histogramdd_bin_edges(self, bins, range=None, weight=None, density=False):  # noqa: A002
    rng = None if range is None else tuple(float(r) for r in range)
    return list(_hist_bin_ct(self, bins=tuple(bins), range_=rng, density=density, edges_only=True))


@lower(aten._histogramdd_from_bin_cts.default, graph_only=True)
def histogramdd_from_bin_cts(self, bins, range=None, weight=None, density=False):  # noqa: A002
    rng = None if range is None else tuple(float(r) for r in range)
    return _hist_bin_ct(self, weight, bins=tuple(bins), range_=rng, density=density, hist_only=True)


@lower(aten._histogramdd_from_bin_tensors.default, graph_only=True)
def histogramdd_from_bin_tensors(self, bins, weight=None, density=False):
    return _hist_bin_tensors(self, weight, density=density, **{f"e{d}": b for d, b in enumerate(bins)})
