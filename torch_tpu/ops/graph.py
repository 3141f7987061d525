"""Lowerings that only ``torch.compile`` graphs need.

In eager mode, views are torch's own kernels (they share storage) and factories are ``empty`` plus
``fill_`` or hand-written kernels. A functional ATen graph names them as ops, so here they are as
pure functions.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import LOWERINGS, Lowering, aten, lower


def _norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


@lower(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default,
       graph_only=True)
def view(self, size, stride=None):
    return jnp.reshape(self, size)


@lower(aten.permute.default, graph_only=True)
def permute(self, dims):
    return jnp.transpose(self, [_norm_dim(d, self.ndim) for d in dims])


@lower(aten.t.default, graph_only=True)
def t(self):
    return self.T


@lower(aten.transpose.int, graph_only=True)
def transpose(self, dim0, dim1):
    return jnp.swapaxes(self, dim0, dim1)


@lower(aten.expand.default, graph_only=True)
def expand(self, size, implicit=False):
    lead = len(size) - self.ndim
    shape = [self.shape[i - lead] if s == -1 else s for i, s in enumerate(size)]
    return jnp.broadcast_to(self, shape)


@lower(aten.unsqueeze.default, graph_only=True)
def unsqueeze(self, dim):
    return jnp.expand_dims(self, _norm_dim(dim, self.ndim + 1))


@lower(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, graph_only=True)
def squeeze(self, dim=None):
    if dim is None:
        return jnp.squeeze(self)
    dims = [_norm_dim(d, max(self.ndim, 1)) for d in (dim if isinstance(dim, list) else [dim])]
    return jnp.squeeze(self, tuple(d for d in dims if self.ndim and self.shape[d] == 1))


@lower(aten.slice.Tensor, graph_only=True)
def slice_(self, dim=0, start=None, end=None, step=1):
    dim = _norm_dim(dim, self.ndim)
    n = self.shape[dim]
    s, e, _ = slice(start, end, 1).indices(n)
    e = max(e, s)
    return lax.slice_in_dim(self, s, e, step, axis=dim)


@lower(aten.select.int, graph_only=True)
def select(self, dim, index):
    dim = _norm_dim(dim, self.ndim)
    return lax.index_in_dim(self, index % self.shape[dim], axis=dim, keepdims=False)


@lower(aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, graph_only=True)
def alias(self):
    return self


@lower(aten.diagonal.default, graph_only=True)
def diagonal(self, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(self, offset, _norm_dim(dim1, self.ndim), _norm_dim(dim2, self.ndim))


@lower(aten.split_with_sizes.default, graph_only=True)
def split_with_sizes(self, split_sizes, dim=0):
    cuts = np.cumsum(split_sizes)[:-1].tolist()
    return tuple(jnp.split(self, cuts, axis=_norm_dim(dim, self.ndim)))


@lower(aten.split.Tensor, graph_only=True)
def split(self, split_size, dim=0):
    dim = _norm_dim(dim, self.ndim)
    n = self.shape[dim]
    return split_with_sizes(self, [min(split_size, n - i) for i in range(0, n, split_size)] or [0], dim)


@lower(aten.unbind.int, graph_only=True)
def unbind(self, dim=0):
    dim = _norm_dim(dim, self.ndim)
    return tuple(jnp.moveaxis(self, dim, 0))


@lower(aten.as_strided.default, graph_only=True)
def as_strided(self, size, stride, storage_offset=None):
    flat = self.reshape(-1)
    idx = np.full(size, storage_offset or 0, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n) * s).reshape(shape)
    return flat[idx]


@lower(aten._to_copy.default, graph_only=True)
def to_copy(self, dtype=None, non_blocking=False):
    return self if dtype is None else self.astype(_dtypes.to_jax(dtype))


@lower(aten.view.dtype, graph_only=True)
def view_dtype(self, dtype):
    """A bit reinterpretation (eager mode's kernel copies the same way: a typed array is no view)."""
    a, b = self.dtype, _dtypes.to_jax(dtype)
    if a == b:
        return self
    if a.itemsize == b.itemsize:
        return lax.bitcast_convert_type(self, b)
    if a.itemsize > b.itemsize:  # each element becomes several: the last dimension grows
        out = lax.bitcast_convert_type(self, b)
        return out.reshape(*self.shape[:-1], self.shape[-1] * (a.itemsize // b.itemsize))
    k = b.itemsize // a.itemsize
    return lax.bitcast_convert_type(self.reshape(*self.shape[:-1], self.shape[-1] // k, k), b)


@lower(aten.copy.default, graph_only=True)
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(self.dtype), self.shape)


@lower(aten.empty.memory_format, aten.zeros.default, graph_only=True)
def zeros(size, dtype=None):
    return jnp.zeros(size, _dtypes.to_jax(dtype) if dtype else jnp.float32)


@lower(aten.empty_strided.default, graph_only=True)
def empty_strided(size, stride, dtype=None):
    return zeros(size, dtype)


@lower(aten.ones.default, graph_only=True)
def ones(size, dtype=None):
    return jnp.ones(size, _dtypes.to_jax(dtype) if dtype else jnp.float32)


@lower(aten.full.default, graph_only=True)
def full(size, fill_value, dtype=None):
    return jnp.full(size, fill_value)


@lower(aten.scalar_tensor.default, graph_only=True)
def scalar_tensor(s, dtype=None):
    return jnp.asarray(s)


@lower(aten.arange.start_step, aten.arange.default, aten.arange.start, static_scalars=True, graph_only=True)
def arange(start, end=None, step=1, dtype=None):
    if end is None:
        start, end = 0, start
    n = max(0, math.ceil((end - start) / step))
    return start + jnp.arange(n) * step


# The _foreach_* ops (the optimizers' multi-tensor path) apply one op to each element of lists.
# Each is mapped here onto the lowering of its single-tensor op. In eager mode that makes one
# program per list, where torch's per-tensor composite would dispatch one op per tensor (an AdamW
# step on 29 parameters: 8 programs instead of 232); graphs name them too.
_FOREACH_OVERLOAD = {
    "List": ("Tensor", "Tensor_Tensor", "default"),
    "Scalar": ("Scalar", "Tensor_Scalar", "default"),
    "ScalarList": ("Scalar", "Tensor_Scalar", "default"),
    "Tensor": ("Tensor", "default"),
    "ScalarAndTensor": ("Scalar",),
    "default": ("default",),
}
_FOREACH_BASE = {"norm": ("linalg_vector_norm", ("default",)), "maximum": ("maximum", ("default",)),
                 "minimum": ("minimum", ("default",)), "clamp_min": ("clamp_min", None),
                 "clamp_max": ("clamp_max", None)}


def foreach_lowering(op):
    """A lowering for ``aten._foreach_<x>.<overload>`` built from ``aten.<x>``'s, or None."""
    name = op._schema.name.split("::")[1]
    if not name.startswith("_foreach_") or name.endswith("_"):
        return None
    base = name[len("_foreach_"):]
    base, overloads = _FOREACH_BASE.get(base, (base, None))
    packet = getattr(aten, base, None)
    if packet is None:
        return None
    single = None
    for ov in overloads or _FOREACH_OVERLOAD.get(op._overloadname, ()):
        cand = getattr(packet, ov, None)
        if cand is not None and cand in LOWERINGS:
            single = LOWERINGS[cand]
            break
    if single is None or single.random:
        return None
    listed = [
        isinstance(a.type, torch.ListType) and str(a.type.getElementType()) != "int" for a in op._schema.arguments
    ]

    def fn(*args, **kwargs):
        n = len(next(a for a, is_list in zip(args, listed) if is_list))
        out = []
        for i in range(n):
            per = [a[i] if is_list and isinstance(a, (list, tuple)) else a for a, is_list in zip(args, listed)]
            out.append(single.fn(*per, **kwargs))
        return out

    return Lowering(fn, static_scalars=single.static_scalars, check=single.check, graph_only=True)


# Overloads whose Tensor argument holds one scalar per list element (a 1-D CPU tensor), which the
# single-tensor lowering would take whole: torch's composite serves them in eager mode.
# _foreach_copy_ may copy from another device, which the hand-written copy_ kernel handles.
_PER_ELEMENT_TENSOR = {("addcdiv", "Tensor"), ("addcmul", "Tensor"), ("copy", "default")}


def register_foreach() -> int:
    """Adds the functional ``_foreach_*`` overloads to the eager table (the dispatcher derives their
    in-place twins). Called once every single-tensor lowering is in the table. Ops whose single
    lowering checks values on the host keep torch's per-tensor composite."""
    import dataclasses


    n = 0
    names = sorted({s.name for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::_foreach_")})
    for qualified in names:
        base = qualified.split("::")[1]
        if base.endswith("_"):
            continue
        packet = getattr(aten, base)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op in LOWERINGS or (base[len("_foreach_"):], overload) in _PER_ELEMENT_TENSOR:
                continue
            lowering = foreach_lowering(op)
            if lowering is None or lowering.check is not None:
                continue
            LOWERINGS[op] = dataclasses.replace(lowering, graph_only=False)
            n += 1
    return n


def _dtype_or(self, dtype):
    return _dtypes.to_jax(dtype) if dtype is not None else self.dtype


@lower(aten.full_like.default, graph_only=True)
def full_like(self, fill_value, dtype=None):
    return jnp.full(self.shape, fill_value, _dtype_or(self, dtype))


@lower(aten.zeros_like.default, aten.empty_like.default, graph_only=True)
def zeros_like(self, dtype=None):
    return jnp.zeros(self.shape, _dtype_or(self, dtype))


@lower(aten.ones_like.default, graph_only=True)
def ones_like(self, dtype=None):
    return jnp.ones(self.shape, _dtype_or(self, dtype))


@lower(aten.new_zeros.default, aten.new_empty.default, graph_only=True)
def new_zeros(self, size, dtype=None):
    return jnp.zeros(size, _dtype_or(self, dtype))


@lower(aten.new_empty_strided.default, graph_only=True)
def new_empty_strided(self, size, stride, dtype=None):
    return jnp.zeros(size, _dtype_or(self, dtype))


@lower(aten.new_ones.default, graph_only=True)
def new_ones(self, size, dtype=None):
    return jnp.ones(size, _dtype_or(self, dtype))


@lower(aten.new_full.default, graph_only=True)
def new_full(self, size, fill_value, dtype=None):
    return jnp.full(size, fill_value, _dtype_or(self, dtype))


# Copying twins of views (``view_copy``, ``permute_copy``, ...): functional graphs name them where
# eager mode has torch's view kernels; each is its view's lowering.
lower(aten.view_copy.default, graph_only=True)(view)
lower(aten.permute_copy.default, graph_only=True)(permute)
lower(aten.as_strided_copy.default, graph_only=True)(as_strided)
lower(aten.unbind_copy.int, graph_only=True)(unbind)


@lower(aten.narrow_copy.default, graph_only=True)
def narrow_copy(self, dim, start, length):
    dim = _norm_dim(dim, self.ndim)
    start = start % self.shape[dim] if start < 0 else start
    return slice_(self, dim, start, start + length)


@lower(aten.unfold.default, aten.unfold_copy.default, graph_only=True)
def unfold(self, dimension, size, step):
    """Windows of ``size`` every ``step`` along ``dimension``, as a new last axis (a gather)."""
    if self.ndim == 0:
        return jnp.reshape(self, (1,))
    dim = _norm_dim(dimension, self.ndim)
    n = (self.shape[dim] - size) // step + 1
    idx = np.arange(n)[:, None] * step + np.arange(size)[None, :]
    windows = jnp.take(self, idx.reshape(-1), axis=dim).reshape(self.shape[:dim] + (n, size) + self.shape[dim + 1:])
    return jnp.moveaxis(windows, dim + 1, -1)


@lower(aten.empty_permuted.default, graph_only=True)
def empty_permuted(size, physical_layout, dtype=None):
    return zeros(size, dtype)
