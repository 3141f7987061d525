"""Lowerings: indexing ops (advanced indexing, gather/scatter, index_* and masked ops).

XLA clamps out-of-range gather indices and drops out-of-range scatter updates, which would be a
silent wrong answer. So every op that takes index *values* has a ``check`` that reads their range
(a host sync, accepted) and raises the exception type CPU raises, with a message naming the op.

Boolean masks give data-dependent shapes; the hand kernels here turn them into integer indices on
the host (one sync) and then run the ordinary lowering.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch._prims_common import alert_not_deterministic

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import Lowering, aten, kernel, kernel_from_lowerings, lower
from torch_tpu.runtime import fused
from torch_tpu.runtime.executor import Program, execute
from torch_tpu.tensor import value_checks as checks
from torch_tpu.tensor.meta import device_mismatch
from torch_tpu.tensor.storage import TPU_DEVICE, host_values, is_tpu, new_tensor, read, to_numpy
from torch_tpu.tensor.transfer import host_to_device

# ------------------------------------------------------------------------------------ checks


def index_range(t: torch.Tensor) -> tuple[int, int] | None:
    """(min, max) of an index tensor as Python ints (a sync), or None when it is empty."""
    if t.numel() == 0:
        return None
    if is_tpu(t):
        v = host_values(t)
        return int(v.min()), int(v.max())
    return int(t.min()), int(t.max())


def check_bounds(
    op: str, index: torch.Tensor, size: int, dim: int, exc: type = RuntimeError, negative: bool = False,
    message: str | None = None,
) -> None:
    """Raises ``exc`` unless every value of ``index`` addresses one of ``size`` entries. Its message
    names the op (``op``, unless empty), the index, the dim and the size, in CPU's words; or is
    ``message``.

    ``negative``: indices in [-size, 0) are allowed (they count from the end), as in ``t[idx]``.
    """
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        return  # the meta kernel raises CPU's dtype error
    lo_ok = -size if negative else 0
    prefix = f"{op}: " if op else ""  # CPU's message names some ops, not others (index_fill)
    if message is not None:
        error = lambda v: exc(message)
    elif size == 0:  # CPU's message names no index and no dim then
        error = lambda v: exc(f"{prefix}index is out of bounds for dimension with size 0")
    else:
        error = lambda v: exc(f"{prefix}index {v} is out of bounds for dimension {dim} with size {size}")
    if is_tpu(index):
        checks.check_values(index, checks.outside, (lo_ok, size), error)
        return
    r = index_range(index)
    for v in r or ():
        if v < lo_ok or v >= size:
            raise error(v)


def _dim(dim: int, ndim: int) -> int:
    n = max(ndim, 1)
    return dim + n if dim < 0 else dim


# ------------------------------------------------------------------------------ helpers (jax)
def _as_1d(x):
    return x.reshape(1) if x.ndim == 0 else x


def _along(dim: int, index) -> tuple:
    """The ``.at[]`` / getitem key selecting ``index`` along ``dim``."""
    return (slice(None),) * dim + (index,)


def _scatter_key(index, dim: int) -> tuple:
    """Coordinates of every element of ``index`` in a scatter/gather along ``dim``."""
    return tuple(
        index if d == dim else lax.broadcasted_iota(index.dtype, index.shape, d) for d in range(index.ndim)
    )


def _fit(src, shape):
    """``src`` cut to ``shape`` (torch lets src/self be larger than index in every dim)."""
    return src[tuple(slice(0, n) for n in shape)]


def _identity(reduce: str, dtype):
    if reduce in ("sum", "mean", "add"):
        return jnp.zeros((), dtype)
    if reduce in ("prod", "multiply"):
        return jnp.ones((), dtype)
    if dtype == jnp.bool_:
        return jnp.asarray(reduce != "amax", dtype)
    big = jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).max
    small = -jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min
    return jnp.asarray(small if reduce == "amax" else big, dtype)


def _add_at(ref, src):
    """``ref.add(src)`` (``ref`` an ``x.at[key]``), where adding bools is a logical or, as CPU's
    accumulation into a bool tensor saturates at True (XLA refuses to add bools)."""
    return ref.max(src) if src.dtype == jnp.bool_ else ref.add(src)


def _reduce_into(self, key: tuple, src, reduce: str, include_self: bool):
    """``self`` with ``src`` reduced into positions ``key`` (scatter_reduce / index_reduce)."""
    src = src.astype(self.dtype)
    base = self if include_self else self.at[key].set(_identity(reduce, self.dtype))
    ref = base.at[key]
    if reduce in ("sum", "add", "mean"):
        out = _add_at(ref, src)
    elif reduce in ("prod", "multiply"):
        out = ref.min(src) if src.dtype == jnp.bool_ else ref.multiply(src)  # a bool product is an and
    elif reduce == "amax":
        out = ref.max(src)
    elif reduce == "amin":
        out = ref.min(src)
    else:
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, got {reduce}")
    if reduce != "mean":
        return out
    count = jnp.zeros(self.shape, jnp.int32).at[key].add(jnp.ones(src.shape, jnp.int32))
    count = count + (1 if include_self else 0)
    safe = jnp.maximum(count, 1).astype(self.dtype)
    mean = out / safe if jnp.issubdtype(self.dtype, jnp.inexact) else jnp.floor_divide(out, safe)
    return jnp.where(count > 0, mean, self)


# ------------------------------------------------------------------------- advanced indexing
def _key(indices: list) -> tuple:
    return tuple(slice(None) if i is None else i for i in indices)


def _index(self, indices):
    return self[_key(indices)]


def _index_put(self, indices, values, accumulate=False, unsafe=False):
    key = _key(indices)
    target = tuple(jax.eval_shape(lambda s, ix: s[_key(ix)], self, list(indices)).shape)
    vshape = tuple(values.shape)  # (a[i] = v drops v's leading 1s before it calls index_put)
    if len(vshape) > len(target) or any(v not in (1, t) for v, t in zip(reversed(vshape), reversed(target))):
        raise RuntimeError(
            f"shape mismatch: value tensor of shape {list(values.shape)} cannot be broadcast to indexing "
            f"result of shape {list(target)}"
        )
    ref = self.at[key]
    values = values.astype(self.dtype)
    if not accumulate:
        return ref.set(values)
    return ref.max(values) if self.dtype == jnp.bool_ else ref.add(values)  # a bool sum is an or


def _mask_put(self, indices, values, accumulate=False, unsafe=False):
    """``self[mask] = v`` for one leading bool mask and a one-element ``v``: a select, no sync."""
    mask = indices[0].astype(bool)
    mask = mask.reshape(mask.shape + (1,) * (self.ndim - mask.ndim))
    v = values.reshape(()).astype(self.dtype)
    return jnp.where(mask, self + v if accumulate else v, self)


def _check_index_args(self: torch.Tensor, indices: list, op: str) -> None:
    """Bounds of integer indices (negative ones count from the end, as on CPU), and CPU's
    IndexError for index tensors that don't broadcast (torch's meta kernel raises a RuntimeError)."""
    shapes = [ind.shape for ind in indices if ind is not None]
    if len(shapes) > 1:
        try:
            torch.broadcast_shapes(*shapes)
        except RuntimeError:
            text = ", ".join(str(list(s)) for s in shapes)
            raise IndexError(
                f"shape mismatch: indexing tensors could not be broadcast together with shapes {text}"
            ) from None
    dim = 0
    for ind in indices:
        if ind is None:
            dim += 1
            continue
        if ind.dtype in (torch.bool, torch.uint8):
            dim += ind.dim()
            continue
        if ind.dtype.is_floating_point or ind.dtype.is_complex:  # meta kernel: a RuntimeError
            raise IndexError("tensors used as indices must be long, int, byte or bool tensors")
        if dim < self.dim():
            check_bounds(op, ind, self.shape[dim], dim, IndexError, negative=True)
        dim += 1


def _expand_masks(self: torch.Tensor, indices: list) -> tuple[torch.Tensor, list]:
    """Bool/uint8 masks become integer index tensors (reads the mask: a sync).

    A 0-dim mask indexes a new size-1 dim, as torch does by unsqueezing ``self``.
    """
    out: list = []
    dim = 0
    for ind in indices:
        if ind is not None and not is_tpu(ind):
            ind = ind.to("tpu")
        if ind is None or ind.dtype not in (torch.bool, torch.uint8):
            out.append(ind)
            dim += 1
            continue
        if ind.dim() == 0:
            self = self.unsqueeze(dim)
            ind = ind.reshape(1)
        for j, n in enumerate(ind.shape):
            if dim + j >= self.dim() or self.shape[dim + j] != n:
                raise IndexError(
                    f"The shape of the mask {list(ind.shape)} at index {j} does not match the shape of the "
                    f"indexed tensor {list(self.shape)} at index {dim + j}"
                )
        for a in np.nonzero(to_numpy(ind)):
            a = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
            out.append(new_tensor(tuple(a.shape), torch.int64, host_to_device(a)))
        dim += ind.dim()
    return self, out


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _refuse_a_byte_mask_fill(self: torch.Tensor, indices: list, args: tuple, kwargs: dict) -> None:
    """CPU writes one value through one mask (``x[m] = 1.0``) with ``masked_fill_``, which refuses a
    uint8 mask; the deprecated uint8 mask works only with more values or ``accumulate``. So does
    tpu (torch's C++ takes that path only for a value on CPU; a tpu value is the same call here)."""
    values = args[0] if args else kwargs.get("values")
    accumulate = args[1] if len(args) > 1 else kwargs.get("accumulate", False)
    given = [i for i in indices if i is not None]
    if accumulate or values is None or values.numel() != 1 or len(given) != 1 or given[0].dtype != torch.uint8:
        return
    mask, start = given[0], next(k for k, i in enumerate(indices) if i is not None)
    if start + mask.dim() <= self.dim() and tuple(mask.shape) == tuple(self.shape[start:start + mask.dim()]):
        raise RuntimeError("masked_fill_ only supports boolean masks, but got mask with dtype unsigned char")


def _mask_kernel(op: torch._ops.OpOverload, kind: str, fn, put: bool) -> None:
    """Registers a hand kernel for ``op``: masks become indices, then ``fn``'s lowering runs."""
    name = str(op).removeprefix("aten.")

    def check(self, indices, *args, **kwargs):
        _check_index_args(self, indices, name)

    def build(adapt):
        inner = adapt(op, Lowering(fn, check=check), kind)
        where = adapt(op, Lowering(_mask_put), kind) if put else None

        def run(self, indices, *args, **kwargs):
            if not is_tpu(self):  # a CPU tensor indexed by tpu indices: CPU's words for it, as on CUDA
                raise RuntimeError(f"aten.{name}: indices should be either on cpu or on the same device as the "
                                   f"indexed tensor ({self.device})")
            indices = list(indices)
            if put:
                _refuse_a_byte_mask_fill(self, indices, args, kwargs)
            for i in indices:
                if i is not None and i.dtype == torch.uint8:  # CPU's deprecation, once per mask
                    site = fused.user_site() or ("<unknown>", 0)  # the user's line, however deep the wrappers
                    warnings.warn_explicit("indexing with dtype torch.uint8 is now deprecated, please use a dtype "
                                           "torch.bool instead.", UserWarning, site[0], site[1])
            if where is not None and len(indices) == 1 and _is_mask(indices[0]):
                values = args[0] if args else kwargs["values"]
                mask = indices[0]
                if (
                    values.numel() == 1
                    and 0 < mask.dim() <= self.dim()
                    and tuple(mask.shape) == tuple(self.shape[: mask.dim()])
                    and values.dim() <= 1 + self.dim() - mask.dim()
                ):
                    # A host mask is uploaded rather than read: as indices its True count would
                    # shape the program, so every new mask compiled a new one.
                    if not is_tpu(mask):
                        indices = [mask.to(TPU_DEVICE)]
                    return where(self, indices, *args, **kwargs)
            if any(_is_mask(i) for i in indices) or any(i is not None and not is_tpu(i) for i in indices):
                target, indices = _expand_masks(self, indices)
            else:
                target = self
            res = inner(target, indices, *args, **kwargs)
            return self if kind == "inplace" else res

        run.counts_itself = True  # one of the two lowering kernels counts each call
        return run

    # only masks read the host (and sync there); integer indices record
    kernel_from_lowerings(op, build, "kernel")


_mask_kernel(aten.index.Tensor, "functional", _index, put=False)
_mask_kernel(aten.index.Tensor_out, "out", _index, put=False)
_mask_kernel(aten.index_put.default, "functional", _index_put, put=True)
_mask_kernel(aten.index_put_.default, "inplace", _index_put, put=True)
_mask_kernel(aten.index_put.out, "out", _index_put, put=True)
_mask_kernel(aten._index_put_impl.default, "functional", _index_put, put=True)
_mask_kernel(aten._index_put_impl_.default, "inplace", _index_put, put=True)
_mask_kernel(aten._index_put_impl.out, "out", _index_put, put=True)


def _graph_index_check(name: str):
    def check(self, indices, *args, **kwargs):
        _check_index_args(self, indices, name)

    return check


# The bounds checks of advanced indexing for a compiled graph's nodes, whose lowering is the plain
# one (the kernels above check in eager mode): compile/backend.py computes them with the graph
INDEX_CHECKS = {op: _graph_index_check(str(op).removeprefix("aten."))
                for op in (aten.index.Tensor, aten.index_put.default, aten._index_put_impl.default)}


@lower(aten._unsafe_index.Tensor)
def _unsafe_index(self, indices):
    """The caller promises in-range indices (upsampling decompositions): no check, no sync."""
    return _index(self, indices)


@lower(aten._unsafe_index_put)
def _unsafe_index_put(self, indices, values, accumulate=False):
    return _index_put(self, indices, values, accumulate)


@lower(aten._unsafe_masked_index)
def _unsafe_masked_index(self, mask, indices, fill):
    """Where ``mask`` is False the index may be anything: XLA's clamping makes that harmless."""
    return jnp.where(mask, _index(self, indices), jnp.asarray(fill).astype(self.dtype))


@lower(aten._unsafe_masked_index_put_accumulate)
def _unsafe_masked_index_put_accumulate(self, mask, indices, values):
    key = _key([None if i is None else jnp.where(mask, i, 0) for i in indices])
    return _add_at(self.at[key], jnp.where(mask, values, 0).astype(self.dtype))


# ------------------------------------------------------------------------- index_select & co
def _check_index_select(self, dim, index):
    """CPU's errors after the op's name, which depend on the dim: CPU's kernel for ``dim == 1`` of a
    tensor of two or more dims raises a RuntimeError in Caffe2's words, every other an IndexError."""
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        return  # the meta kernel raises CPU's dtype error
    d = _dim(dim, self.dim())
    size = self.shape[d] if self.dim() else 1
    if size == 0 and index.numel():
        raise RuntimeError("index_select(): self indexing axis dim should be positive")
    if self.dim() > 1 and d == 1:
        error = lambda v: RuntimeError(f"index_select(): INDICES element is out of DATA bounds, id={v} axis_dim={size}")
    else:
        error = lambda v: IndexError("index_select(): index out of range in self")
    if is_tpu(index):
        checks.check_values(index, checks.outside, (0, size), error)
        return
    for v in index_range(index) or ():
        if v < 0 or v >= size:
            raise error(v)


@lower(aten.index_select, check=_check_index_select)
def index_select(self, dim, index):
    if self.ndim == 0:
        return self
    return jnp.take(self, index.reshape(-1), axis=_dim(dim, self.ndim))


def _check_gather(self, dim, index, *, sparse_grad=False):
    d = _dim(dim, self.dim())
    check_bounds("gather()", index, self.shape[d] if self.dim() else 1, d)


@lower(aten.gather, check=_check_gather)
def gather(self, dim, index, sparse_grad=False):
    if index.size == 0:
        return jnp.zeros(index.shape, self.dtype)
    if self.ndim == 0:
        return self.reshape(index.shape)
    d = _dim(dim, self.ndim)
    shape = index.shape  # a 0-dim index gathers one element (CPU treats it as 1-d), result 0-dim
    index = _as_1d(index)
    cut = tuple(slice(None) if k == d else slice(0, n) for k, n in enumerate(index.shape))
    return jnp.take_along_axis(self[cut], index, axis=d).reshape(shape)


def _check_scatter(self, dim, index, *args, **kwargs):
    d = _dim(dim, self.dim())
    check_bounds("scatter()", index, self.shape[d] if self.dim() else 1, d)


def _scatter_with(self, dim, index, src, reduce: str | None, include_self: bool = True):
    """Shared body of the scatter family, with 0-dim tensors seen as one element."""
    shape = self.shape
    if index.size == 0:
        return self
    x, index = _as_1d(self), _as_1d(index)
    d = _dim(dim, x.ndim)
    key = _scatter_key(index, d)
    src = _fit(_as_1d(src), index.shape) if jnp.ndim(src) else jnp.broadcast_to(src, index.shape)
    if reduce is None:
        out = x.at[key].set(src.astype(x.dtype))
    else:  # bool sums are logical ors (_reduce_into), as on CPU
        out = _reduce_into(x, key, src, reduce, include_self)
    return out.reshape(shape)


@lower(aten.scatter.src, aten.scatter.value, check=_check_scatter)
def scatter(self, dim, index, src=None, value=None):
    return _scatter_with(self, dim, index, src if value is None else jnp.asarray(value), None)


@lower(aten.scatter.reduce, aten.scatter.value_reduce, check=_check_scatter)
def scatter_with_reduce(self, dim, index, src=None, value=None, reduce="add"):
    if reduce not in ("add", "multiply"):
        raise RuntimeError(f"reduce argument must be either add or multiply, got {reduce}")
    return _scatter_with(self, dim, index, src if value is None else jnp.asarray(value), reduce)


@lower(aten.scatter_add, check=_check_scatter)
def scatter_add(self, dim, index, src):
    return _scatter_with(self, dim, index, src, "add")


@lower(aten.scatter_reduce.two, check=_check_scatter)
def scatter_reduce(self, dim, index, src, reduce, include_self=True):
    return _scatter_with(self, dim, index, src, reduce, include_self)


def _index_dim_check(op: str, exc: type = RuntimeError, negative: bool = False, message: str | None = None):
    """The bounds check of an ``index_*`` op along a dim: ``op`` names it in the message (CPU's own
    name where CPU's message has one), ``message`` is a fixed one."""
    def check(self, dim, index, *args, **kwargs):
        d = _dim(dim, self.dim())
        check_bounds(op, index, self.shape[d] if self.dim() else 1, d, exc, negative, message)

    return check


def _along_dim(self, dim, index, update):
    """``(x, key, update)`` for an update of ``self`` along ``dim`` at 1-d ``index``; a 0-dim
    ``self`` is seen as one element."""
    x = _as_1d(self)
    d = _dim(dim, x.ndim)
    index = index.reshape(-1)
    update = jnp.asarray(update).astype(x.dtype)
    if update.ndim not in (0, x.ndim):
        update = update.reshape(x.shape[:d] + (index.shape[0],) + x.shape[d + 1 :])
    return x, _along(d, index), update


@lower(aten.index_add, check=_index_dim_check("index_add()"))
def index_add(self, dim, index, source, alpha=None):
    x, key, src = _along_dim(self, dim, index, source if alpha is None else source * alpha)
    return _add_at(x.at[key], src.astype(x.dtype)).reshape(self.shape)


@lower(aten.index_copy, check=_index_dim_check("index_copy_()", IndexError))
def index_copy(self, dim, index, source):
    x, key, src = _along_dim(self, dim, index, source)
    return x.at[key].set(src).reshape(self.shape)


_index_fill_bounds = _index_dim_check("", IndexError, True)


def _check_index_fill(self, dim, index, value):
    """CPU's refusals of ``index_fill``, in its order and words: a value tensor that is not 0-dim,
    an index that is not int64 (IndexError; JAX would take int32 and refuse floats with a
    TypeError) or not a vector, a complex value for a real tensor (which the program would cast,
    dropping the imaginary part), then the index's bounds."""
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise RuntimeError("index_fill_ only supports a 0-dimensional value tensor, but got tensor with "
                           f"{value.dim()} dimension(s).")
    if index.dtype != torch.int64:
        raise IndexError("index_fill_(): Expected dtype int64 for index.")
    if index.dim() > 1:
        raise RuntimeError("Index has to be a vector/scalar")
    complex_value = value.dtype.is_complex if isinstance(value, torch.Tensor) else isinstance(value, complex)
    if complex_value and not self.dtype.is_complex:
        raise RuntimeError("index_fill_(): Converting complex Scalar to non-complex type is not supported")
    _index_fill_bounds(self, dim, index)


@lower(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor, check=_check_index_fill)
def index_fill(self, dim, index, value):
    x, key, _ = _along_dim(self, dim, index, 0)
    return x.at[key].set(jnp.asarray(value).astype(x.dtype)).reshape(self.shape)


@lower(aten.index_reduce,
       check=_index_dim_check("index_reduce()", IndexError, message="index_reduce(): index out of range in self"))
def index_reduce(self, dim, index, source, reduce, include_self=True):
    x, key, src = _along_dim(self, dim, index, source)
    return _reduce_into(x, key, src, reduce, include_self).reshape(self.shape)


# ------------------------------------------------------------------------------- flat access
def _check_take(self, index, *args, **kwargs):
    n = self.numel()
    name = "take()" if not args else "put()"
    if args and not (args[1] if len(args) > 1 else kwargs.get("accumulate", False)):
        # which of two values for one position lands is unspecified, on XLA as on CPU: CPU's alert
        alert_not_deterministic("put_")
    error = lambda v: IndexError(f"{name}: out of range: tried to access index {v} on a tensor of {n} elements.")
    if is_tpu(index):
        checks.check_values(index, checks.outside, (-n, n), error)
        return
    for v in index_range(index) or ():
        if v < -n or v >= n:
            raise error(v)


@lower(aten.take, check=_check_take)
def take(self, index):
    return self.reshape(-1)[index]


@lower(aten.put, check=_check_take)
def put(self, index, source, accumulate=False):
    ref = self.reshape(-1).at[index.reshape(-1)]
    src = source.reshape(-1).astype(self.dtype)
    return (_add_at(ref, src) if accumulate else ref.set(src)).reshape(self.shape)


# ------------------------------------------------------------------------------ masked ops
_COUNT = Program("mask count", lambda m: jnp.count_nonzero(m))


def _check_masked_scatter(self, mask, source):
    if self.dtype != source.dtype or mask.dtype != torch.bool or not is_tpu(mask) or mask.numel() == 0:
        return  # the meta kernel raises CPU's errors for these
    shape = torch.broadcast_shapes(self.shape, mask.shape)
    count = int(execute(_COUNT, read(mask))) * (math.prod(shape) // mask.numel())
    if source.numel() < count:
        raise RuntimeError("masked_scatter: Number of elements of source < number of ones in mask")


def _masked_scatter_meta(self, mask, source, **out):
    """CPU refuses a mask that is not bool (uint8 after its deprecation warning), where torch's
    meta kernel of the in-place form lets it through: CPU says it, on empty stand-ins."""
    if mask.dtype != torch.bool:
        torch.empty(0, dtype=self.dtype).masked_scatter_(torch.empty(0, dtype=mask.dtype),
                                                         torch.empty(0, dtype=source.dtype))
    return aten.masked_scatter(self, mask, source, **out)


@lower(aten.masked_scatter, check=_check_masked_scatter, meta=_masked_scatter_meta)
def masked_scatter(self, mask, source):
    shape = jnp.broadcast_shapes(self.shape, mask.shape)
    x = jnp.broadcast_to(self, shape)
    m = jnp.broadcast_to(mask.astype(bool), shape).reshape(-1)
    pos = jnp.cumsum(m.astype(jnp.int32)) - 1
    src = source.reshape(-1)
    if src.size == 0:
        return x
    picked = src[jnp.clip(pos, 0, src.size - 1)].astype(x.dtype)
    return jnp.where(m, picked, x.reshape(-1)).reshape(shape)


@lower(aten.masked_scatter_backward.default)
def masked_scatter_backward(grad_output, mask, sizes):
    """The source's gradient: the k-th true element's gradient at flat position k, zeros after the
    last one (a scatter by the mask's running count: a static shape, no host read of the mask)."""
    m = jnp.broadcast_to(mask.astype(bool), grad_output.shape).reshape(-1)
    n = math.prod(sizes)
    pos = jnp.where(m, jnp.cumsum(m.astype(jnp.int64)) - 1, n)  # n: out of range, dropped
    out = jnp.zeros((n,), grad_output.dtype).at[pos].set(grad_output.reshape(-1), mode="drop")
    return out.reshape(tuple(sizes))


_TAKE_FLAT = Program("masked_select gather", lambda x, i: x.reshape(-1)[i])


@kernel(aten.masked_select.default)
def _masked_select(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Data-dependent size: the mask is read on the host (a sync)."""
    if mask.dtype != torch.bool:
        raise RuntimeError(f"masked_select: expected BoolTensor for mask, got {mask.dtype}")
    meta_self = torch.empty(self.shape, device="meta")
    shape = torch.broadcast_shapes(meta_self.shape, mask.shape)
    m = np.broadcast_to(to_numpy(mask) if is_tpu(mask) else mask.numpy(), shape)
    flat = torch.from_numpy(np.flatnonzero(m).astype(np.int64))
    x = jnp.broadcast_to(read(self), shape)
    out = execute(_TAKE_FLAT, x, host_to_device(flat))
    return new_tensor((flat.numel(),), self.dtype, out)


@kernel(aten.masked_select.out)
def _masked_select_out(self: torch.Tensor, mask: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    if not is_tpu(out):
        raise device_mismatch("aten.masked_select.out", out.device)
    if out.dtype != self.dtype:  # no cast into out=, as on CPU
        raise RuntimeError("masked_select(): self and result must have the same scalar type")
    res = _masked_select(self, mask)
    out.resize_(res.shape)
    out.copy_(res)
    return out


# ------------------------------------------------------------------------------- nonzero
@kernel(aten.nonzero.default)
def _nonzero(self: torch.Tensor) -> torch.Tensor:
    """Data-dependent size: the tensor is read on the host (a sync)."""
    a = to_numpy(self)
    idx = np.argwhere(a) if a.ndim else np.zeros((int(bool(a)), 0), np.int64)
    t = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
    return new_tensor(tuple(t.shape), torch.int64, host_to_device(t))


@kernel(aten.nonzero.out)
def _nonzero_out(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    if not is_tpu(out):
        raise device_mismatch("aten.nonzero.out", out.device)
    if out.dtype != torch.int64:  # indices are int64, and CPU casts none into out=
        raise RuntimeError(f"nonzero: Expected out tensor to have scalar type Long but got scalar type"
                           f"{_dtypes.SCALAR_NAMES.get(out.dtype, out.dtype)}")
    res = _nonzero(self)
    out.resize_(res.shape)
    out.copy_(res)
    return out


@lower(aten.nonzero_static)
def nonzero_static(self, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.full((size, 0), fill_value, jnp.int64)
    cols = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(cols, axis=1)


# ------------------------------------------------------------------------------ *_scatter
@lower(aten.select_scatter)
def select_scatter(self, src, dim, index):
    return self.at[_along(_dim(dim, self.ndim), index)].set(src.astype(self.dtype))


@lower(aten.slice_scatter)
def slice_scatter(self, src, dim=0, start=None, end=None, step=1):
    return self.at[_along(_dim(dim, self.ndim), slice(start, end, step))].set(src.astype(self.dtype))


@lower(aten.diagonal_scatter)
def diagonal_scatter(self, src, offset=0, dim1=0, dim2=1):
    d1, d2 = _dim(dim1, self.ndim), _dim(dim2, self.ndim)
    x = jnp.moveaxis(self, (d1, d2), (-2, -1))
    n = src.shape[-1]
    i = jnp.arange(n) + max(-offset, 0)
    j = jnp.arange(n) + max(offset, 0)
    x = x.at[..., i, j].set(src.astype(self.dtype))
    return jnp.moveaxis(x, (-2, -1), (d1, d2))


@lower(aten.as_strided_scatter)
def as_strided_scatter(self, src, size, stride, storage_offset=None):
    idx = np.full(tuple(size), storage_offset or 0, np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    flat = self.reshape(-1).at[idx.reshape(-1)].set(src.reshape(-1).astype(self.dtype))
    return flat.reshape(self.shape)


# ------------------------------------------------------------------------------ embedding
def _check_embedding(weight, indices, *args, **kwargs):
    checks.check_values(indices, checks.outside, (0, weight.shape[0]),
                        lambda v: IndexError("embedding_renorm_(): index out of range in self"))


@lower(aten.embedding_renorm, check=_check_embedding)
def embedding_renorm(self, indices, max_norm, norm_type):
    """Rows named by ``indices`` (each once) are scaled down to norm ``max_norm``, as on CPU."""
    used = jnp.zeros(self.shape[0], bool).at[indices.reshape(-1)].set(True)
    x = self.astype(jnp.float32) if self.dtype in (jnp.bfloat16, jnp.float16) else self
    norm = jnp.sum(jnp.abs(x) ** norm_type, axis=1) ** (1.0 / norm_type)
    scale = jnp.where(used & (norm > max_norm), max_norm / (norm + 1e-7), 1.0)
    return (x * scale[:, None].astype(x.dtype)).astype(self.dtype)


# Advanced indexing: eager mode needs hand kernels (bool masks have data-dependent shapes); in a
# graph an index is static: integer indices, or one boolean mask of index_put (a select).
@lower(aten.index.Tensor, graph_only=True)
def index_graph(self, indices):
    return _index(self, indices)


@lower(aten.index_put.default, graph_only=True)
def index_put_graph(self, indices, values, accumulate=False):
    if any(i is not None and i.dtype in (jnp.bool_, jnp.uint8) for i in indices):
        return _graph_mask_put(self, indices, values, accumulate)
    return _index_put(self, indices, values, accumulate)


@lower(aten._index_put_impl.default, graph_only=True)
def index_put_impl(self, indices, values, accumulate=False, unsafe=False):
    return index_put_graph(self, indices, values, accumulate)


def _graph_mask_put(self, indices, values, accumulate):
    """``self[mask] = values`` with one leading mask: a select, its shape static whatever the mask.

    ``values`` either broadcasts to one selected row (it is the same for every true element) or
    has one row per true element, in order: the k-th true element takes row k (a cumulative count
    of the mask indexes them). Either way no host read of the mask is needed; in the second case the
    backend checks the count against CPU's rule after the graph runs (``_mask_rows`` in compile/backend.py).
    """
    mask = indices[0]
    if len(indices) != 1 or mask.dtype not in (jnp.bool_, jnp.uint8):
        raise NotImplementedError(
            "torch.compile(backend='tpu'): aten.index_put with a boolean mask is lowered for one leading mask only"
        )
    mask = mask.astype(bool)
    rest = self.shape[mask.ndim:]
    values = values.astype(self.dtype)
    if values.ndim == len(rest) + 1 and values.shape[0] != 1:  # one row per true element
        rank = jnp.clip(jnp.cumsum(mask.reshape(-1)) - 1, 0, values.shape[0] - 1)
        rows = jnp.take(values, rank, axis=0).reshape(mask.shape + values.shape[1:])
    else:
        rows = jnp.reshape(values, values.shape[1:]) if values.ndim == len(rest) + 1 else values
    rows = jnp.broadcast_to(rows, mask.shape + rest)
    m = mask.reshape(mask.shape + (1,) * len(rest))
    return jnp.where(m, self + rows if accumulate else rows, self)
