"""Lowerings: ops that rearrange data (cat, flip, pad, triangles, diagonals) and the
searching/counting ops (unique, searchsorted, bucketize, histc, bincount).

Ops whose output size depends on the data (unique, bincount, repeat_interleave) are hand kernels:
one static-shape program does the work, then a single scalar sync gives the size and the result
is cut to it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torch_tpu.ops._registry import aten, kernel, lower
from torch_tpu.ops.indexing import index_range
from torch_tpu.runtime.executor import Program, execute
from torch_tpu.tensor.meta import cpu_meta
from torch_tpu.tensor.storage import new_tensor, read


def _dim(dim: int, ndim: int) -> int:
    return dim + max(ndim, 1) if dim < 0 else dim


@functools.lru_cache(maxsize=4096)
def program(name: str, fn: Callable, *static) -> Program:
    """A cached program running ``fn(*arrays, *static)``: static values are compile-time constants."""
    return Program(f"{name}{list(static)}", lambda *a: fn(*a, *static))


# --------------------------------------------------------------------------------- joining
@lower(aten.cat)
def cat(tensors, dim=0):
    """Legacy empty 1-d tensors are skipped, as on CPU; mixed dtypes promote (cast after)."""
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)]
    if not kept:
        return jnp.zeros((0,), jnp.result_type(*tensors))
    dt = jnp.result_type(*kept)
    return jnp.concatenate([t.astype(dt) for t in kept], axis=_dim(dim, kept[0].ndim))


@lower(aten.stack)
def stack(tensors, dim=0):
    dt = jnp.result_type(*tensors)
    return jnp.stack([t.astype(dt) for t in tensors], axis=_dim(dim, tensors[0].ndim + 1))


# ------------------------------------------------------------------------------ reordering
@lower(aten.flip)
def flip(self, dims):
    return jnp.flip(self, [_dim(d, self.ndim) for d in dims]) if dims and self.ndim else self


@lower(aten.roll)
def roll(self, shifts, dims=()):
    if self.size == 0:
        return self
    if not dims:
        return jnp.roll(self.reshape(-1), shifts[0]).reshape(self.shape)
    return jnp.roll(self, tuple(shifts), axis=tuple(_dim(d, self.ndim) for d in dims))


@lower(aten.repeat)
def repeat(self, repeats):
    x = self.reshape((1,) * (len(repeats) - self.ndim) + self.shape)
    return jnp.tile(x, tuple(repeats))


@lower(aten._unsafe_view)
def _unsafe_view(self, size):
    return self.reshape(tuple(size))


@lower(aten.constant_pad_nd)
def constant_pad_nd(self, pad, value=0):
    """Negative pads crop, as lax.pad does."""
    cfg = [(0, 0, 0)] * self.ndim
    for i in range(len(pad) // 2):
        cfg[self.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1], 0)
    return lax.pad(self, jnp.asarray(value).astype(self.dtype), cfg)


# --------------------------------------------------------------------- triangles, diagonals
def _below(shape: tuple, diagonal: int):
    """Where column - row <= ``diagonal`` over the last two dims, from 32-bit iotas (jnp.tril's are
    64-bit under x64, which XLA:TPU emulates: a causal mask is such an op in every attention step)."""
    rows, cols = shape[-2:]
    index = jnp.int64 if max(rows, cols) + abs(diagonal) >= 2**31 else jnp.int32
    return lax.broadcasted_iota(index, (rows, cols), 1) - lax.broadcasted_iota(index, (rows, cols), 0) <= diagonal


@lower(aten.tril)
def tril(self, diagonal=0):
    return jnp.where(_below(self.shape, diagonal), self, jnp.zeros((), self.dtype))


@lower(aten.triu)
def triu(self, diagonal=0):
    return jnp.where(_below(self.shape, diagonal - 1), jnp.zeros((), self.dtype), self)


@lower(aten.diag_embed)
def diag_embed(self, offset=0, dim1=-2, dim2=-1):
    nd = self.ndim + 1
    d1, d2 = _dim(dim1, nd), _dim(dim2, nd)
    k = self.shape[-1]
    n = k + abs(offset)
    i = jnp.arange(k) + max(-offset, 0)
    j = jnp.arange(k) + max(offset, 0)
    out = jnp.zeros(self.shape[:-1] + (n, n), self.dtype).at[..., i, j].set(self)
    return jnp.moveaxis(out, (-2, -1), (d1, d2))


# ------------------------------------------------------------------------------ searching
def _side(right: bool, side: str | None) -> str:
    return side if side is not None else ("right" if right else "left")


@lower(aten.searchsorted.Tensor, aten.searchsorted.Scalar, meta=cpu_meta(aten.searchsorted))
def searchsorted(sorted_sequence, self, out_int32=False, right=False, side=None, sorter=None):
    seq = sorted_sequence
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    where = _side(right, side)
    v = jnp.asarray(self)
    if seq.ndim == 1:
        return jnp.searchsorted(seq, v, side=where)
    batch = seq.shape[:-1]
    seq2 = seq.reshape((-1, seq.shape[-1]))
    v2 = v.reshape((seq2.shape[0], -1))
    out = jax.vmap(lambda s, x: jnp.searchsorted(s, x, side=where))(seq2, v2)
    return out.reshape(batch + v.shape[-1:])


@lower(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor, meta=cpu_meta(aten.isin))
def isin(elements, test_elements, assume_unique=False, invert=False):
    """One program, where torch's decomposition runs a comparison, a reduction and (for big test
    sets) a sort as separate ops: ``generate()`` calls it for its stop and EOS checks every token.
    Both sides are compared in their common dtype, as CPU does."""
    e, t = jnp.asarray(elements), jnp.asarray(test_elements)
    common = jnp.result_type(e, t)
    return jnp.isin(e.astype(common), t.astype(common).ravel(), invert=invert)


@lower(aten.bucketize.Tensor, aten.bucketize.Scalar, meta=cpu_meta(aten.bucketize))
def bucketize(self, boundaries, out_int32=False, right=False):
    # torch's right=False means boundaries[i-1] < x <= boundaries[i]: numpy's side='left'
    return jnp.searchsorted(boundaries, jnp.asarray(self), side="right" if right else "left")


def _check_histc(self, bins=100, min=0, max=0):
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    lo, hi = float(min), float(max)
    if lo > hi:
        raise RuntimeError("torch.histc: max must be larger than min")
    if lo == hi and self.numel():  # the data's range: read, as CPU reads it
        lo, hi = float(self.min()), float(self.max())
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise RuntimeError(f"torch.histc: range of [{lo:g}, {hi:g}] is not finite")


@lower(aten.histc, check=_check_histc)
def histc(self, bins=100, min=0, max=0):
    """Bins of equal width over [min, max] (the data's range when min == max); values outside
    are ignored and ``max`` falls in the last bin, as on CPU."""
    x = self.reshape(-1)
    dt = x.dtype
    lo, hi = jnp.asarray(min).astype(dt), jnp.asarray(max).astype(dt)
    if x.size:
        auto = lo == hi
        lo = jnp.where(auto, jnp.min(x), lo)
        hi = jnp.where(auto, jnp.max(x), hi)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    inside = (x >= lo) & (x <= hi)
    b = ((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    b = jnp.clip(b, 0, bins - 1)
    return jnp.zeros(bins, dt).at[b].add(jnp.where(inside, 1, 0).astype(dt))


# --------------------------------------------------------------------------------- cross
@lower(aten.linalg_cross)
def linalg_cross(self, other, dim=-1):
    a, b = jnp.broadcast_arrays(self, other)
    return jnp.cross(a, b, axis=_dim(dim, a.ndim))


# ---------------------------------------------------------------- data-dependent sizes
def _to_device(value, shape, dtype: torch.dtype) -> torch.Tensor:
    return new_tensor(tuple(shape), dtype, value)


def _bincount_body(x, w, n):
    if w is None:
        return jnp.zeros(n, jnp.int64).at[x].add(1)
    return jnp.zeros(n, w.dtype).at[x].add(w)


@kernel(aten.bincount.default)
def _bincount(self: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    """Output length max(self) + 1: one sync for the max."""
    if self.dtype.is_floating_point or self.dtype.is_complex or self.dtype == torch.bool:
        raise NotImplementedError(f'"bincount_cpu" not implemented for \'{str(self.dtype).split(".")[1].title()}\'')
    if minlength < 0:
        raise RuntimeError("minlength should be >= 0")
    if self.dim() != 1:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    if weights is not None and (weights.dim() != 1 or weights.shape[0] != self.shape[0]):
        raise RuntimeError("weights should be 1-d and have the same length as input")
    r = index_range(self)
    if r is not None and r[0] < 0:
        raise RuntimeError("bincount only supports 1-d non-negative integral inputs.")
    n = max(minlength, r[1] + 1 if r is not None else 0)
    if weights is None:
        out_dtype = torch.int64
        out = execute(program("aten.bincount", _bincount_body, n), read(self), None)
    else:
        out_dtype = weights.dtype if weights.dtype in (torch.float32, torch.float64) else torch.float64
        w = read(weights).astype(jnp.float32 if out_dtype == torch.float32 else jnp.float64)
        out = execute(program("aten.bincount", _bincount_body, n), read(self), w)
    return _to_device(out, (n,), out_dtype)


def _repeat_body(repeats, total):
    return jnp.repeat(jnp.arange(repeats.shape[0]), repeats, total_repeat_length=total)


@kernel(aten.repeat_interleave.Tensor)
def _repeat_interleave(repeats: torch.Tensor, *, output_size: int | None = None) -> torch.Tensor:
    if repeats.dim() != 1:
        raise RuntimeError("repeat_interleave only accept 1D vector as repeat")
    if repeats.dtype not in (torch.int32, torch.int64):
        raise RuntimeError("repeats has to be Long or Int tensor")
    r = index_range(repeats)
    if r is not None and r[0] < 0:
        raise RuntimeError("repeats can not be negative")
    if output_size is None:
        output_size = int(execute(program("repeat_interleave total", jnp.sum), read(repeats)))
    out = execute(program("aten.repeat_interleave", _repeat_body, output_size), read(repeats))
    return _to_device(out, (output_size,), repeats.dtype)


def _groups(first):
    """Group id of every (sorted) position from its 'starts a new group' flags, and the count."""
    gid = jnp.cumsum(first.astype(jnp.int64)) - 1
    return gid, gid[-1] + 1


def _unique_flat(x, consecutive):
    """Padded unique of a flat array: (values, inverse, counts, how many)."""
    n = x.shape[0]
    perm = jnp.arange(n) if consecutive else jnp.argsort(x, stable=True)
    s = x[perm]
    first = jnp.concatenate([jnp.ones(1, bool), s[1:] != s[:-1]])
    gid, count = _groups(first)
    inverse = jnp.zeros(n, jnp.int64).at[perm].set(gid)
    values = jnp.zeros(n, x.dtype).at[gid].set(s)
    counts = jnp.zeros(n, jnp.int64).at[gid].add(1)
    return values, inverse, counts, count


def _unique_rows(x, consecutive):
    """Padded unique of the rows of a 2-d array (unique along a dim)."""
    n = x.shape[0]
    if consecutive or x.shape[1] == 0:
        perm = jnp.arange(n)
    else:
        perm = jnp.lexsort(tuple(x[:, j] for j in reversed(range(x.shape[1]))))
    s = x[perm]
    first = jnp.concatenate([jnp.ones(1, bool), jnp.any(s[1:] != s[:-1], axis=1)])
    gid, count = _groups(first)
    inverse = jnp.zeros(n, jnp.int64).at[perm].set(gid)
    values = jnp.zeros_like(s).at[gid].set(s)
    counts = jnp.zeros(n, jnp.int64).at[gid].add(1)
    return values, inverse, counts, count


def _unique(self: torch.Tensor, dim: int | None, consecutive: bool, inverse: bool, counts: bool, always: bool):
    """Shared body of the unique family. ``consecutive``: no sort (unique_consecutive);
    ``always``: inverse and counts are returned even when not asked for (the ``dim`` variants)."""
    x = read(self)
    if dim is None:
        inv_shape = tuple(self.shape)
        if self.numel() == 0:
            v, inv, cnt, k = jnp.zeros((0,), x.dtype), jnp.zeros(inv_shape, jnp.int64), jnp.zeros(0, jnp.int64), 0
        else:
            v, inv, cnt, k = execute(program("aten.unique", _unique_flat, consecutive), x.reshape(-1))
            k = int(k)  # the one sync
            v, inv = v[:k], inv.reshape(inv_shape)
    else:
        d = _dim(dim, self.dim())
        if self.dim() == 0 or not 0 <= d < self.dim():
            raise IndexError(f"Dimension out of range (expected to be in range of [-1, 0], but got {dim})")
        moved = jnp.moveaxis(x, d, 0)
        if moved.shape[0] != 0 and 0 in moved.shape:  # CPU's refusal, in its words
            raise RuntimeError("There are 0 sized dimensions, and they aren't selected, so unique cannot be applied")
        if moved.shape[0] == 0:  # nothing along dim: the input itself, in its own shape
            v, inv, cnt, k = x, jnp.zeros(0, jnp.int64), jnp.zeros(0, jnp.int64), 0
        else:
            rows = moved.reshape(moved.shape[0], -1)
            v, inv, cnt, k = execute(program("aten.unique_dim", _unique_rows, consecutive), rows)
            k = int(k)
            v = jnp.moveaxis(v[:k].reshape((k,) + moved.shape[1:]), 0, d)
    empty = jnp.zeros(0, jnp.int64)
    inv = inv if inverse or always else empty
    cnt = cnt[:k] if counts or always else empty
    return tuple(_to_device(a, a.shape, t) for a, t in ((v, self.dtype), (inv, torch.int64), (cnt, torch.int64)))


@kernel(aten._unique2.default)
def _unique2(self, sorted=True, return_inverse=False, return_counts=False):
    return _unique(self, None, False, return_inverse, return_counts, False)


@kernel(aten._unique.default)
def _unique_(self, sorted=True, return_inverse=False):
    return _unique(self, None, False, return_inverse, False, False)[:2]


@kernel(aten.unique_dim.default)
def _unique_dim(self, dim, sorted=True, return_inverse=False, return_counts=False):
    return _unique(self, dim, False, return_inverse, return_counts, True)


@kernel(aten.unique_consecutive.default)
def _unique_consecutive(self, return_inverse=False, return_counts=False, dim=None):
    return _unique(self, dim, True, return_inverse, return_counts, dim is not None)
