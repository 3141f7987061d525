"""Where a tpu tensor's data lives, and how views read and write it.

A tpu tensor is a plain ``torch.Tensor`` made by ``torch._C._acc.create_empty_tensor``. Its jax
array hangs on the tensor's *storage* object (``_jx``), in the contiguous shape of the tensor that
created the storage (``_shape``). Views share the storage, so they share the array; the array dies
with the last tensor that uses it.

Reading a view is a strided read of that array and writing one is the matching scatter, which
replaces the array (jax arrays are immutable). Plans are computed once per (base shape, view
geometry) and each becomes a cached :class:`Program`.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.runtime import checks, executor, fused, host_reads, metrics
from torch_tpu.runtime.executor import Program, execute

DK = torch._C.DispatchKey


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


# The graph capture in progress (a ``torch_tpu.device.graphs._Capture``), else None. It is told
# which storages a captured region reads, writes and creates, and refuses host reads. One test of a
# global per storage access is all capture costs the other modes.
_capture: Any = None


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype, value: Any = None) -> torch.Tensor:
    """A fresh contiguous tpu tensor whose storage holds ``value`` (a jax array, or None: unset)."""
    t = torch._C._acc.create_empty_tensor(shape, dtype)
    st = t.untyped_storage()
    if 0 in shape:
        # create_empty_tensor multiplies raw sizes, giving (5, 1, 0, 2) the strides (0, 0, 2, 1);
        # CPU (and gradcheck's overlap check) counts a size-0 dim as 1: (2, 2, 2, 1).
        torch.ops.aten.set_.source_Storage_storage_offset._op_dk(
            DK.Meta, t, st, 0, list(shape), list(contiguous_strides(tuple(shape))))
    st._shape = tuple(shape)
    st._dtype = dtype
    st._jx = value
    if _capture is not None:
        _capture.made(st)
    return t


# ------------------------------------------------------------------------------ addresses
# A tpu storage's C++ data pointer is null: its bytes live in jax. ``data_ptr()`` is what code
# written for CUDA tells storages apart by (safetensors and transformers' ``save_pretrained`` find
# shared weights by it, tests tell a copy from a view by it), so a storage is given a unique
# address the first time anyone asks for one (``storage_api`` wraps ``Tensor.data_ptr`` and
# ``UntypedStorage.data_ptr``): never on an op's path, which stays as cheap as it is. The address
# is a number, never memory: nothing dereferences a tpu pointer (there is no C++ kernel).
_SET_STORAGE = torch.ops.aten.set_.source_Storage_storage_offset
_cpp_storage_nbytes = torch._C.StorageBase.nbytes
_cpp_storage_data_ptr = torch._C.StorageBase.data_ptr
_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # torch >= 2.13
_ADDRESS_ALIGN = 512  # CUDA's caching allocator's
_next_address = 1 << 44


def logical_nbytes(st: Any) -> int:
    """The bytes a tpu storage holds: its array's (or, for raw bytes from torch.load, theirs)."""
    raw = getattr(st, "_raw", None)
    if raw is not None:
        return int(raw.size)
    shape, dtype = getattr(st, "_shape", None), getattr(st, "_dtype", None)
    if shape is None or dtype is None:
        return 0
    return math.prod(shape) * dtype.itemsize


def has_address(st: Any) -> bool:
    """Whether tpu storage ``st`` has a non-null C++ data pointer. torch's ``data_ptr()`` refuses a
    null pointer with a nonzero byte count ("an invalid python storage"), which every tpu storage
    whose size was synced (``storage_api.sync_nbytes``) and has no address is."""
    try:
        return bool(_cpp_storage_data_ptr(st))
    except RuntimeError:
        return False


def give_address(st: Any, nbytes: int | None = None) -> bool:
    """Gives tpu storage ``st`` a unique address, if it has none and holds bytes (an empty one's
    is 0, as on CPU); with ``nbytes``, a new address of that size, as a reallocation moves. True
    when the address changed.

    The address comes with a ``StorageImpl`` that ``_construct_storage_from_data_pointer`` makes
    and ``_swap_data_ptr_`` moves into ``st`` (torch >= 2.13; older torch keeps the null pointer,
    so ``data_ptr()`` is the offset in bytes there). Such a storage is not resizable, which
    :func:`set_geometry` allows for. Addresses are never reused, so two storages never share one.
    """
    global _next_address
    if not _CAN_SWAP:
        return False
    if nbytes is None:
        if has_address(st):
            return False
        nbytes = max(logical_nbytes(st), _cpp_storage_nbytes(st))
        if nbytes == 0:
            return False
    address = _next_address
    _next_address += max(1, -(-nbytes // _ADDRESS_ALIGN)) * _ADDRESS_ALIGN
    if _cpp_storage_nbytes(st) not in (0, nbytes):  # a swap needs equal sizes, or one of 0
        st._swap_data_ptr_(torch._C._acc.create_empty_tensor((0,), torch.uint8).untyped_storage())
    st._swap_data_ptr_(torch._C._construct_storage_from_data_pointer(address, st.device, nbytes))
    return True


def set_geometry(t: torch.Tensor, st: Any, offset: int, size: list[int], stride: list[int]) -> None:
    """Points ``t`` at storage ``st`` with this geometry, touching no data.

    torch's Meta ``set_`` kernel does it and grows the storage's C++ byte count without allocating
    (a tpu storage's bytes live in jax, and ops never keep that count up to date), but it refuses
    a storage that is not resizable, as one with an address (:func:`give_address`) is. That one's
    byte count is its array's, and CPU's kernel checks the geometry against it without
    allocating; a geometry that needs more bytes first gets a new, larger address."""
    if st.resizable():
        _SET_STORAGE._op_dk(DK.Meta, t, st, offset, size, stride)
        return
    if all(n > 0 for n in size):
        need = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * t.element_size()
        if need > _cpp_storage_nbytes(st):
            give_address(st, need)
    _SET_STORAGE._op_dk(DK.CPU, t, st, offset, size, stride)


def dense_layout(shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...] | None:
    """The storage shape of a dense, non-overlapping strided layout (``channels_last``, a permuted
    ``empty_like``): the sizes from the largest stride to the smallest. None for any other layout
    (overlapping, or with gaps), which a fresh result cannot have."""
    order = sorted(range(len(shape)), key=lambda d: -stride[d])
    if 0 not in shape:
        acc = 1
        for d in reversed(order):
            if shape[d] != 1:
                if stride[d] != acc:
                    return None
                acc *= shape[d]
    return tuple(shape[d] for d in order)


def new_strided(shape: tuple[int, ...], stride: tuple[int, ...], storage_shape: tuple[int, ...],
                dtype: torch.dtype, value: Any) -> torch.Tensor:
    """A fresh tpu tensor of ``shape`` and ``stride`` (a :func:`dense_layout`) whose storage holds
    ``value``, already laid out in ``storage_shape``: not a view, as CPU's ``channels_last``
    results are not."""
    t = new_tensor(storage_shape, dtype, value)
    torch.ops.aten.set_.source_Storage_storage_offset._op_dk(
        DK.Meta, t, t.untyped_storage(), 0, list(shape), list(stride)
    )
    return t


_Lazy = fused.Lazy
_TO_JAX = _dtypes.TORCH_TO_JAX
TPU_DEVICE = torch.device("tpu", 0)  # the one device (see the README): comparing with it is 4x faster than .type


def is_tpu(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device == TPU_DEVICE


# ---------------------------------------------------------------------------------------- plans
def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    acc = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != acc:
            return False
        acc *= n
    return True


@functools.lru_cache(maxsize=65536)
def _plan(base: tuple[int, ...], size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> tuple:
    """How a view (size, stride, offset) sits in a contiguous base array.

    ``("id",)`` the whole base; ``("reshape",)`` the whole base, reshaped; ``("flat", start)`` a
    contiguous run; ``("slice", index, perm, bshape)`` a strided slice of the base dims, permuted and
    broadcast; ``("reshaped", shape, plan)`` one of those on the base reshaped to ``shape`` (the
    transpose of a flattened ``[B, T, D]`` gradient); ``("cut", index, shape, reshaped)`` a
    "reshaped" plan on a run of the base sliced first (attention heads of a fused qkv projection's
    ``q``); ``("gather",)`` anything else (an as_strided
    with overlapping or odd strides). A gather costs far more than a transpose, which XLA folds
    into the matmul reading it.
    """
    plan = _plan_on(base, size, stride, offset)
    if plan[0] == "gather":
        shape = _refined_base(base, size, stride)
        if shape is not None and shape != base:
            inner = _plan_on(shape, size, stride, offset)
            if inner[0] != "gather":
                return _cut_first(base, shape, inner) or ("reshaped", shape, inner)
    return plan


def _split_dims(base: tuple[int, ...], shape: tuple[int, ...]) -> list[list[int]] | None:
    """Per dim of ``base``, the dims of ``shape`` it splits into (none for a dim of size 1); None
    when ``shape`` is not such a split of ``base``."""
    groups, j = [], 0
    for n in base:
        dims, p = [], 1
        while p < n and j < len(shape):
            p *= shape[j]
            dims.append(j)
            j += 1
        if p != n:
            return None
        groups.append(dims)
    return groups if j == len(shape) else None


def _cut_first(base: tuple[int, ...], shape: tuple[int, ...], inner: tuple) -> tuple | None:
    """``("cut", index, cut, ("reshaped", shape', inner'))``: a view of the base reshaped to
    ``shape`` that reads only a run of some base dim (``q`` of a fused ``qkv`` projection, viewed
    as heads), with that run sliced out before the reshape, so the reshape (a relayout copy on a
    TPU, whose minor dim is tiled) moves the view's part and not the whole base. None when no base
    dim narrows so."""
    if inner[0] != "slice":
        return None
    groups = _split_dims(base, shape)
    if groups is None:
        return None
    index = list(inner[1])
    cut_index, cut, new_shape = [], [], []
    for d, dims in enumerate(groups):
        if not dims:  # a base dim of size 1
            cut_index.append((0, 1, 1))
            cut.append(1)
            continue
        first, rest = dims[0], dims[1:]
        whole_rest = all(index[g] == (0, shape[g], 1) for g in rest)
        e = index[first]
        lo, hi = (e, e + 1) if isinstance(e, int) else (e[0], e[1])
        if whole_rest and (lo, hi) != (0, shape[first]):
            row = math.prod(shape[g] for g in rest)
            cut_index.append((lo * row, hi * row, 1))
            cut.append((hi - lo) * row)
            new_shape += [hi - lo] + [shape[g] for g in rest]
            index[first] = e - lo if isinstance(e, int) else (0, hi - lo, e[2])
        else:
            cut_index.append((0, base[d], 1))
            cut.append(base[d])
            new_shape += [shape[g] for g in dims]
    if tuple(cut) == tuple(base):
        return None
    return ("cut", tuple(cut_index), tuple(cut), ("reshaped", tuple(new_shape), ("slice", tuple(index), *inner[2:])))


def _refined_base(base: tuple[int, ...], size: tuple[int, ...], stride: tuple[int, ...]) -> tuple | None:
    """A shape of the base's elements with one dim per stride of the view, when the view's strides
    divide each other: in it, every view dim walks a single base dim."""
    strides = sorted({s for n, s in zip(size, stride) if n != 1 and s != 0}, reverse=True)
    numel = math.prod(base)
    if not strides or numel % strides[0]:
        return None
    shape = [numel // strides[0]]
    for big, small in zip(strides, strides[1:]):
        if big % small:
            return None
        shape.append(big // small)
    if strides[-1] > 1:
        shape.append(strides[-1])
    return tuple(shape)


def _plan_on(base: tuple[int, ...], size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> tuple:
    numel = math.prod(size)
    if numel == 0:
        return ("empty",)
    if _is_contiguous(size, stride):
        if offset == 0 and numel == math.prod(base):
            return ("id",) if size == base else ("reshape",)
        return ("flat", offset)
    bstride = contiguous_strides(base)
    coord = [(offset // bstride[d]) % base[d] if base[d] else 0 for d in range(len(base))]
    if sum(c * s for c, s in zip(coord, bstride)) != offset:
        return ("gather",)
    owner: dict[int, int] = {}  # base dim -> view dim
    steps: dict[int, int] = {}
    for j, (n, s) in enumerate(zip(size, stride)):
        if n == 1 or s == 0:
            continue
        for d in range(len(base)):
            if d in owner or s % bstride[d] or s < bstride[d]:
                continue
            step = s // bstride[d]
            if coord[d] + (n - 1) * step < base[d]:
                owner[d], steps[d] = j, step
                break
        else:
            return ("gather",)
    index = tuple(
        (coord[d], coord[d] + (size[owner[d]] - 1) * steps[d] + 1, steps[d]) if d in owner else coord[d]
        for d in range(len(base))
    )
    kept = [owner[d] for d in sorted(owner)]  # view dims, in base order
    perm = tuple(sorted(range(len(kept)), key=lambda k: kept[k]))
    bshape = tuple(1 if (n == 1 or s == 0) else n for n, s in zip(size, stride))
    return ("slice", index, perm, bshape)


def _flat_index(size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> np.ndarray:
    idx = np.full(size, offset, dtype=np.int64)
    for d, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return idx


def _as_index(index: tuple) -> tuple:
    return tuple(slice(*i) if isinstance(i, tuple) else i for i in index)


def _read(plan: tuple, base_shape, size, stride, offset, dtype, base):
    kind = plan[0]
    if kind == "empty":
        return jnp.zeros(size, dtype)
    if kind == "reshape":
        return base.reshape(size)
    if kind == "flat":
        return lax.slice(base.reshape(-1), (plan[1],), (plan[1] + math.prod(size),)).reshape(size)
    if kind == "slice":
        sub = jnp.transpose(base[_as_index(plan[1])], plan[2])
        return jnp.broadcast_to(sub.reshape(plan[3]), size)
    if kind == "reshaped":
        return _read(plan[2], plan[1], size, stride, offset, dtype, base.reshape(plan[1]))
    if kind == "cut":
        return _read(plan[3], plan[2], size, stride, offset, dtype, base[_as_index(plan[1])])
    return base.reshape(-1)[_flat_index(size, stride, offset)]


def _write(plan: tuple, base_shape, size, stride, offset, dtype, base, value):
    value = jnp.broadcast_to(jnp.asarray(value).astype(dtype), size)
    kind = plan[0]
    if kind == "empty":
        return base
    if kind in ("id", "reshape"):
        return value.reshape(base_shape)
    if kind == "flat":
        flat = lax.dynamic_update_slice(base.reshape(-1), value.reshape(-1), (plan[1],))
        return flat.reshape(base_shape)
    if kind == "slice":
        kept = [j for j, (n, s) in enumerate(zip(size, stride)) if n != 1 and s != 0]
        sub = value[tuple(slice(None) if j in kept else 0 for j in range(len(size)))]
        sub = jnp.transpose(sub, tuple(np.argsort(plan[2])))
        return base.at[_as_index(plan[1])].set(sub)
    if kind == "reshaped":
        return _write(plan[2], plan[1], size, stride, offset, dtype, base.reshape(plan[1]), value).reshape(base_shape)
    if kind == "cut":
        index = _as_index(plan[1])
        return base.at[index].set(_write(plan[3], plan[2], size, stride, offset, dtype, base[index], value))
    idx = _flat_index(size, stride, offset).reshape(-1)
    return base.reshape(-1).at[idx].set(value.reshape(-1)).reshape(base_shape)


def _geometry_key(base_shape: tuple, size: tuple, stride: tuple, offset: int, dtype: Any) -> tuple:
    """What a strided read or write is specialised on, for the recompilation explainer."""
    return (("storage shape", tuple(base_shape)), ("size", tuple(size)), ("stride", tuple(stride)),
            ("offset", offset), ("dtype", dtype))


@functools.lru_cache(maxsize=65536)
def _read_program(base_shape, size, stride, offset, dtype) -> Program:
    plan = _plan(base_shape, size, stride, offset)
    return Program(
        f"read {plan[0]} {list(size)} of {list(base_shape)}",
        functools.partial(_read, plan, base_shape, size, stride, offset, dtype),
        key=_geometry_key(base_shape, size, stride, offset, dtype),
    )


@functools.lru_cache(maxsize=65536)
def _write_program(base_shape, size, stride, offset, dtype) -> Program:
    plan = _plan(base_shape, size, stride, offset)
    return Program(
        f"write {plan[0]} {list(size)} into {list(base_shape)}",
        functools.partial(_write, plan, base_shape, size, stride, offset, dtype),
        key=_geometry_key(base_shape, size, stride, offset, dtype),
    )


@functools.lru_cache(maxsize=4096)
def _flat_read_program(base_shape, size, dtype) -> Program:
    """A contiguous run of the base (an element, a row) at a runtime offset: one program for every
    offset, where a strided read is specialised on it (gradcheck reads each element in turn)."""
    n = math.prod(size)

    def run(base, offset):
        return lax.dynamic_slice(base.reshape(-1), (offset,), (n,)).reshape(size)

    return Program(f"read flat {list(size)} of {list(base_shape)}", run,
                   key=(("storage shape", tuple(base_shape)), ("size", tuple(size)), ("dtype", dtype)))


@functools.lru_cache(maxsize=4096)
def _flat_write_program(base_shape, size, dtype) -> Program:
    """The write twin of :func:`_flat_read_program`."""

    def run(base, offset, value):
        value = jnp.broadcast_to(jnp.asarray(value).astype(dtype), size)
        return lax.dynamic_update_slice(base.reshape(-1), value.reshape(-1), (offset,)).reshape(base_shape)

    return Program(f"write flat {list(size)} into {list(base_shape)}", run,
                   key=(("storage shape", tuple(base_shape)), ("size", tuple(size)), ("dtype", dtype)))


def _slice_parts(plan: tuple) -> tuple[tuple, tuple]:
    """A "slice" plan split into what its program is specialised on (per base dim the extent and
    step of the window, or None for a fixed coordinate; the transpose; the shape) and the start
    coordinates, which become runtime arguments."""
    index = plan[1]
    window = tuple((i[1] - i[0], i[2]) if isinstance(i, tuple) else None for i in index)
    starts = tuple(i[0] if isinstance(i, tuple) else i for i in index)
    return (window, plan[2], plan[3]), starts


def _window(window: tuple) -> tuple[tuple, tuple]:
    """The block a window covers (its sizes) and the strided index of the view inside it."""
    sizes = tuple(w[0] if w is not None else 1 for w in window)
    inner = tuple(slice(None, None, w[1]) if w is not None else 0 for w in window)
    return sizes, inner


@functools.lru_cache(maxsize=4096)
def _slice_read_program(base_shape, size, parts, dtype) -> Program:
    """A strided view that the slicing plan serves, at runtime start coordinates: one program for
    every position of the same window (gradcheck reads a jacobian's columns, one offset each),
    where :func:`_read_program` is specialised on the offset."""
    window, perm, bshape = parts
    sizes, inner = _window(window)

    def run(base, *starts):
        block = lax.dynamic_slice(base, starts, sizes)
        return jnp.broadcast_to(jnp.transpose(block[inner], perm).reshape(bshape), size)

    return Program(f"read slice {list(size)} of {list(base_shape)} at runtime offsets", run,
                   key=(("storage shape", tuple(base_shape)), ("size", tuple(size)), ("window", parts),
                        ("dtype", dtype)))


@functools.lru_cache(maxsize=4096)
def _slice_write_program(base_shape, size, stride, parts, dtype) -> Program:
    """The write twin of :func:`_slice_read_program` (gradcheck writes a jacobian column per input
    element)."""
    window, perm, _ = parts
    sizes, inner = _window(window)
    kept = [j for j, (n, s) in enumerate(zip(size, stride)) if n != 1 and s != 0]
    pick = tuple(slice(None) if j in kept else 0 for j in range(len(size)))
    back = tuple(np.argsort(perm))

    def run(base, value, *starts):
        value = jnp.broadcast_to(jnp.asarray(value).astype(dtype), size)
        sub = jnp.transpose(value[pick], back)
        block = lax.dynamic_slice(base, starts, sizes).at[inner].set(sub)
        return lax.dynamic_update_slice(base, block, starts)

    return Program(f"write slice {list(size)} into {list(base_shape)} at runtime offsets", run,
                   key=(("storage shape", tuple(base_shape)), ("size", tuple(size)), ("stride", tuple(stride)),
                        ("window", parts), ("dtype", dtype)))


def _alias_geometry(base_shape, base_dtype, view_dtype):
    """How a view with another element type sees a storage: (its base shape in view elements, its
    jax dtype, base -> view-typed base, view-typed base -> base). Only the complex/real pairs that
    view_as_real and view_as_complex make."""
    # (a complex32's parts are float16, held as float32 in its complex64 array: _dtypes)
    if base_dtype.is_complex and view_dtype == base_dtype.to_real():
        part = _dtypes.to_jax(view_dtype)
        wide = jnp.float16 if part == jnp.float16 else None
        return (
            tuple(base_shape) + (2,), part,
            lambda b: jnp.stack([jnp.real(b), jnp.imag(b)], axis=-1).astype(part),
            lambda v: lax.complex(*(v[..., i] if wide is None else v[..., i].astype(jnp.float32) for i in (0, 1))),
        )
    if view_dtype.is_complex and base_dtype == view_dtype.to_real():
        n = math.prod(base_shape)
        part = _dtypes.to_jax(base_dtype)
        work = jnp.float32 if part == jnp.float16 else part
        return (
            (n // 2,), _dtypes.to_jax(view_dtype),
            lambda b: lax.complex(*jnp.moveaxis(b.reshape(n // 2, 2).astype(work), -1, 0)),
            lambda v: jnp.stack([jnp.real(v), jnp.imag(v)], axis=-1).reshape(base_shape).astype(part),
        )
    # any other pair (view(dtype)): the storage's bytes, flat, read as view_dtype; a storage whose
    # size in bytes is no multiple of the view's element is padded with zero bytes, then cut back
    n = math.prod(base_shape)
    nbytes = n * base_dtype.itemsize
    count = -(-nbytes // view_dtype.itemsize)
    pad = count * view_dtype.itemsize - nbytes
    b = _dtypes.to_jax(view_dtype)

    def to_view(base: Any) -> Any:
        raw = _bytes_of(base.reshape(-1), base_dtype)
        if pad:
            raw = jnp.concatenate([raw, jnp.zeros((pad,), jnp.uint8)])
        return _from_bytes_of(raw, view_dtype)

    def from_view(v: Any) -> Any:
        raw = _bytes_of(v, view_dtype)
        return _from_bytes_of(raw[:nbytes] if pad else raw, base_dtype).reshape(base_shape)

    return (count,), b, to_view, from_view


def _bytes_of(flat: Any, dtype: torch.dtype) -> Any:
    """:func:`to_bytes` of a flat array of torch ``dtype`` (a complex32's bytes are two float16s)."""
    if dtype == torch.complex32:
        return to_bytes(jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1).astype(jnp.float16),
                        np.dtype(jnp.float16))
    return to_bytes(flat, _dtypes.to_jax(dtype))


def _from_bytes_of(raw: Any, dtype: torch.dtype) -> Any:
    """The inverse of :func:`_bytes_of`."""
    if dtype == torch.complex32:
        pairs = from_bytes(raw, np.dtype(jnp.float16)).reshape(-1, 2).astype(jnp.float32)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    return from_bytes(raw, _dtypes.to_jax(dtype))


def to_bytes(flat: Any, dtype: Any) -> Any:
    """A flat array's bits as uint8, in memory order (XLA's bitcast knows neither bool nor complex:
    a bool is one byte of 0 or 1, a complex its real then imaginary part)."""
    if dtype == jnp.bool_:
        return flat.astype(jnp.uint8)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        flat = jnp.stack([jnp.real(flat), jnp.imag(flat)], axis=-1).reshape(-1)
    if flat.dtype.itemsize == 1:
        return lax.bitcast_convert_type(flat, jnp.uint8)
    return lax.bitcast_convert_type(flat, jnp.uint8).reshape(-1)


def from_bytes(raw: Any, dtype: Any) -> Any:
    """The inverse of :func:`to_bytes`: uint8 bits read as a flat array of ``dtype``."""
    if dtype == jnp.bool_:
        return raw != 0
    if jnp.issubdtype(dtype, jnp.complexfloating):
        part = jnp.real(jnp.zeros((), dtype)).dtype
        pairs = from_bytes(raw, part).reshape(-1, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(raw, dtype)
    return lax.bitcast_convert_type(raw.reshape(-1, dtype.itemsize), dtype)


@functools.lru_cache(maxsize=4096)
def _alias_read_program(base_shape, base_dtype, view_dtype, size, stride, offset) -> Program:
    vshape, vdt, to_view, _ = _alias_geometry(base_shape, base_dtype, view_dtype)
    plan = _plan(vshape, size, stride, offset)
    return Program(
        f"read {plan[0]} {list(size)} {view_dtype} of {list(base_shape)} {base_dtype}",
        lambda base: _read(plan, vshape, size, stride, offset, vdt, to_view(base)),
    )


@functools.lru_cache(maxsize=4096)
def _alias_write_program(base_shape, base_dtype, view_dtype, size, stride, offset) -> Program:
    vshape, vdt, to_view, from_view = _alias_geometry(base_shape, base_dtype, view_dtype)
    plan = _plan(vshape, size, stride, offset)
    return Program(
        f"write {plan[0]} {list(size)} {view_dtype} into {list(base_shape)} {base_dtype}",
        lambda base, value: from_view(_write(plan, vshape, size, stride, offset, vdt, to_view(base), value)),
    )


@functools.lru_cache(maxsize=1)
def _complex32_program() -> Program:
    return Program("round to complex32", lambda v: _dtypes.round_complex32(jnp.asarray(v).astype(jnp.complex64)))


@functools.lru_cache(maxsize=4096)
def _fill_program(shape, dtype) -> Program:
    return Program(f"fill {list(shape)} {dtype}", lambda v: jnp.broadcast_to(jnp.asarray(v).astype(dtype), shape))


@functools.lru_cache(maxsize=4096)
def _zeros_program(shape, dtype) -> Program:
    return Program(f"zeros {list(shape)}", lambda: jnp.zeros(shape, dtype))


def read_view(base_shape: tuple, size: tuple, stride: tuple, offset: int, dtype: torch.dtype, base: Any) -> Any:
    """Inside a program: the strided view (size, stride, offset) of a contiguous base array."""
    plan = _plan(base_shape, size, stride, offset)
    return _read(plan, base_shape, size, stride, offset, _dtypes.to_jax(dtype), base)


def base_array(st: Any) -> Any:
    """The storage's whole jax array; an uninitialised storage (``empty``) reads as zeros."""
    a = st._jx
    if a is None and _capture is not None:
        a = _capture.materialize(st)  # an empty tensor from before a capture: a static input
    if a is None:
        a = st._jx = execute(_zeros_program(st._shape, _dtypes.to_jax(st._dtype)))
    elif type(a) is fused.Lazy and (a.value is not None or not executor.recording()):
        a = st._jx = fused.concrete(a)  # computed (or needed now, outside fused mode): drop the placeholder
    if _capture is not None:
        _capture.saw(st, a)
    return a


def read(t: torch.Tensor) -> Any:
    """The jax value of tpu tensor ``t``, in ``t``'s own shape."""
    st = t.untyped_storage()
    size = t.shape
    if t.dtype != st._dtype:  # view_as_real / view_as_complex: the same bytes, another element type
        prog = _alias_read_program(st._shape, st._dtype, t.dtype, tuple(size), tuple(t.stride()),
                                   t.storage_offset())
        return execute(prog, base_array(st))
    if size == st._shape and not t.storage_offset() and t.is_contiguous():
        a = st._jx
        if type(a) is fused.Lazy and a.value is not None:
            a = st._jx = a.value  # computed: drop the placeholder (as base_array does)
        if a is None or _capture is not None or type(a) is fused.Lazy:
            return base_array(st)
        return a
    geometry = (st._shape, tuple(size), tuple(t.stride()), t.storage_offset())
    plan = _plan(*geometry)
    if plan[0] == "flat":
        return execute(_flat_read_program(st._shape, tuple(size), _dtypes.to_jax(st._dtype)), base_array(st),
                       geometry[3])
    if plan[0] == "slice":
        parts, starts = _slice_parts(plan)
        return execute(_slice_read_program(st._shape, tuple(size), parts, _dtypes.to_jax(st._dtype)),
                       base_array(st), *starts)
    prog = _read_program(*geometry, _dtypes.to_jax(st._dtype))
    return execute(prog, base_array(st))


def write(t: torch.Tensor, value: Any) -> None:
    """Makes ``t`` hold ``value`` (broadcast and cast to t's shape and dtype), updating its base."""
    st = t.untyped_storage()
    size = t.shape
    if t.dtype is torch.complex32:  # rounded as a complex32 holds it (dtypes)
        value = execute(_complex32_program(), value)
    if t.dtype is not st._dtype:
        prog = _alias_write_program(st._shape, st._dtype, t.dtype, tuple(size), tuple(t.stride()),
                                    t.storage_offset())
        _replace(st, execute(prog, base_array(st), value))
        return
    jdt = _TO_JAX.get(st._dtype) or _dtypes.to_jax(st._dtype)
    if not t.storage_offset() and size == st._shape and t.is_contiguous():  # the whole storage
        if type(value) is _Lazy:  # an op's result, of the shape and dtype its meta kernel gave
            same = value.dtype == jdt and value.shape == size
        else:
            same = getattr(value, "dtype", None) == jdt and tuple(getattr(value, "shape", ())) == size
        if same:
            _replace(st, value)
        else:  # cast and broadcast only: the old contents are not read (nor made, for an empty tensor)
            _replace(st, execute(_fill_program(tuple(size), jdt), value))
        return
    geometry = (st._shape, tuple(size), tuple(t.stride()), t.storage_offset())
    plan = _plan(*geometry)
    if plan[0] == "flat":
        _replace(st, execute(_flat_write_program(st._shape, tuple(size), jdt), base_array(st), geometry[3], value))
        return
    if plan[0] == "slice":
        parts, starts = _slice_parts(plan)
        prog = _slice_write_program(st._shape, tuple(size), geometry[2], parts, jdt)
        _replace(st, execute(prog, base_array(st), value, *starts))
        return
    prog = _write_program(*geometry, jdt)
    _replace(st, execute(prog, base_array(st), value))


def _replace(st: Any, value: Any) -> None:
    """Stores ``value`` as the storage's new array. A pending value remembers which concrete array
    the storage held before the trace (by id), so that a fused program can write it in that
    array's donated buffer: a parameter updated in place keeps its memory."""
    if _capture is not None:
        _capture.wrote(st)
    if type(value) is _Lazy:
        old = st._jx
        if type(old) is _Lazy:
            value.replaces = id(old.value) if old.value is not None else old.replaces
        elif old is not None:
            value.replaces = id(old)
    st._jx = value


def set_base(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, value: Any) -> None:
    """Re-points ``t`` at a fresh contiguous storage of ``shape`` holding ``value`` (resize_, set_)."""
    st = t.untyped_storage()
    if _capture is not None:
        _capture.wrote(st)
    set_geometry(t, st, 0, list(shape), list(contiguous_strides(tuple(shape))))
    st._shape, st._dtype, st._jx = tuple(shape), dtype, value


def read_array(t: torch.Tensor) -> Any:
    """Like :func:`read`, but a concrete jax array: runs a pending fused trace if needed.
    For kernels that compute outside the executor (host reads, data-dependent shapes)."""
    return fused.concrete(read(t))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """Copies a tpu tensor to the host (a sync point)."""
    if _capture is not None:
        _capture.host_read()
    if host_reads.mode:
        host_reads.synchronizing()
    a = np.asarray(read_array(t))
    metrics.transfer_bytes["device_to_host"] += a.nbytes
    checks.raise_pending()
    return a


def to_numpy_many(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """:func:`to_numpy` of several tpu tensors as one sync point (a training loop's step losses,
    read a few steps late, when the device has finished them): each array read as it is, which
    costs about a microsecond for a ready scalar; ``jax.device_get`` of the list costs 25 times
    that."""
    if _capture is not None:
        _capture.host_read()
    if host_reads.mode:
        host_reads.synchronizing()
    out = [np.asarray(read_array(t)) for t in tensors]
    metrics.transfer_bytes["device_to_host"] += sum(a.nbytes for a in out)
    checks.raise_pending()
    return out


# id(array) -> (a weak reference to it, its host data, the value checks it passed: see passed_checks,
# a CPU tensor over the data once host_tensor has made one (for a host op's result, that result
# itself), and whether a host op computed it: see is_host_result)
_HOST_COPIES: dict[int, tuple[weakref.ref, np.ndarray, set, torch.Tensor | None, bool]] = {}
_HOST_COPY_MAX_BYTES = 1 << 22


def remember_host_copy(array: Any, data: np.ndarray, whole: torch.Tensor | None = None,
                       host_result: bool = False) -> None:
    """Keeps the host data a small integer or bool array was uploaded from, while it lives.

    Index tensors (token ids, class targets) arrive from the host, and CPU torch checks their
    values (bounds) at every use. With the host copy at hand such a check reads no device memory,
    so it neither transfers nor waits behind the step the device is still running.
    ``host_result``: a host op computed ``array`` (its host copy is that op's CPU result): the small
    integer bookkeeping of a decoding loop, whose next ops then stay on the host too
    (``host_placement.inputs_on_host``). ``whole``: that result, a CPU tensor over the host copy's
    memory, which :func:`host_tensor` then hands out (no wrapping per read).
    """
    if data.dtype.kind in "iub" and data.nbytes <= _HOST_COPY_MAX_BYTES:
        data.flags.writeable = False  # handed to readers as it is (host_copy)
        key = id(array)
        _HOST_COPIES[key] = (weakref.ref(array, lambda _r, k=key: _HOST_COPIES.pop(k, None)), data, set(), whole,
                             host_result)


def is_host_result(t: torch.Tensor) -> bool:
    """Whether tpu tensor ``t`` reads, as its own element type, an array a host op computed."""
    kept = _kept(t)
    return kept is not None and kept[4]


def _kept(t: torch.Tensor) -> tuple | None:
    """The ``_HOST_COPIES`` entry of the array behind tpu tensor ``t``, or None when it has none
    (or ``t`` reads it as another element type)."""
    st = t.untyped_storage()
    a = st._jx
    kept = _HOST_COPIES.get(id(a)) if a is not None else None
    if kept is None or kept[0]() is not a or t.dtype != st._dtype:
        return None
    return kept


def host_copy(t: torch.Tensor) -> np.ndarray | None:
    """The values of tpu tensor ``t`` from the host data it was uploaded from, or None when there
    is none (values computed on the device). Reads no device memory."""
    kept = _kept(t)
    if kept is None:
        return None
    data = kept[1]
    if not t.storage_offset() and t.shape == data.shape and t.is_contiguous():
        return data  # the whole array, read-only: no strided view to build (most index tensors)
    flat = data.reshape(-1)
    strides = tuple(s * flat.itemsize for s in t.stride())
    return np.lib.stride_tricks.as_strided(flat[t.storage_offset():], tuple(t.shape), strides, writeable=False)


def host_tensor(t: torch.Tensor) -> torch.Tensor | None:
    """:func:`host_copy` as a CPU tensor of ``t``'s shape, strides and offset over the host data
    (which is read-only: for CPU kernels that only read their inputs, the host path's), or None.
    The CPU tensor over the whole data is made once per upload and kept with the host copy, so a
    chain of host ops reads each input without a copy or a numpy round trip."""
    kept = _kept(t)
    if kept is None:
        return None
    whole = kept[3]
    if whole is None:
        data = kept[1]
        try:
            with warnings.catch_warnings():  # not writable: nothing writes it (the docstring)
                warnings.simplefilter("ignore", UserWarning)
                whole = torch.from_numpy(data.reshape(-1))
        except TypeError:  # a numpy type torch cannot wrap
            return None
        if whole.dtype != t.dtype:
            return None
        _HOST_COPIES[id(t.untyped_storage()._jx)] = (kept[0], data, kept[2], whole, kept[4])
    if not t.storage_offset() and t.is_contiguous():
        if whole.shape == t.shape:
            return whole  # read only, as every reader of a host copy (a host op's own result)
        if t.numel() == whole.numel():
            return whole.view(t.shape)
    return whole.as_strided(t.shape, t.stride(), t.storage_offset())


def passed_checks(t: torch.Tensor) -> set | None:
    """The value checks (any hashable description) that the host data behind tpu tensor ``t`` is
    known to pass, kept with its host copy, or None when it has none. The data is a private copy
    and the array is immutable, so a check that passed once passes again: a training loop that
    feeds the same batch tensor every step checks it once."""
    kept = _kept(t)
    if kept is None:
        return None
    return kept[2]


def host_values(t: torch.Tensor) -> np.ndarray:
    """The values of tpu tensor ``t`` on the host: its host copy when it has one, else read from
    the device (a sync). For kernels whose output shape depends on values (bincount)."""
    v = host_copy(t)
    return v if v is not None else to_numpy(t)


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    return _dtypes.numpy_to_cpu(to_numpy(t), t.dtype).reshape(t.shape)


_resize_bytes = torch.UntypedStorage.resize_
_CAN_SHRINK = hasattr(torch.UntypedStorage, "_swap_data_ptr_")  # torch >= 2.13


def _resize_storage(self: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_``, for tpu storages too.

    PyTorch resizes a PrivateUse1 storage through the C++ hook ``resizePrivateUse1Bytes``, which its
    Python backend API does not expose, so the tpu case never reaches C++: see :func:`resize_storage`.
    FSDP2 (``fully_shard``) is the caller that matters: it frees unsharded parameters with
    ``resize_(0)`` after use and re-allocates them with ``resize_(nbytes)`` before the next all-gather.
    """
    if self.device.type == "tpu":
        resize_storage(self, int(size))
        return self
    return _resize_bytes(self, size)


def resize_storage(st: Any, nbytes: int) -> None:
    """Resizes tpu storage ``st`` to ``nbytes`` bytes in place, as CPU's ``resize_`` does: the leading
    bytes are kept, the new ones are uninitialised (they read as zeros), and ``resize_(0)`` frees the
    device memory. Tensors viewing the storage see the change (their geometry is theirs to keep valid).

    The jax array is the data; the C++ ``StorageImpl`` only carries ``nbytes`` (its data pointer is
    null), which ``storage.size()`` reports and FSDP2 reads to decide whether to allocate or free.
    It grows through the Meta ``set_`` kernel (it sets a storage's nbytes when a tensor needs more)
    and shrinks by swapping in an empty storage's (``_swap_data_ptr_``, torch >= 2.13). On older
    torch a storage cannot shrink in C++: ``resize_(0)`` still frees the array but keeps the
    storage's size, so a later ``resize_`` back to it (FSDP2's re-allocation) has nothing to do.
    """
    if nbytes < 0:
        raise RuntimeError(f"UntypedStorage.resize_: size must be non-negative, got {nbytes}")
    dtype = getattr(st, "_dtype", None)
    if dtype is None:  # a storage no tensor typed yet (raw bytes from torch.load)
        _kernel_storage_value(st)
        dtype = getattr(st, "_dtype", torch.uint8)
    item = dtype.itemsize
    if nbytes % item:
        raise RuntimeError(
            f"UntypedStorage.resize_({nbytes}) on tpu: the storage holds {dtype} elements of {item} bytes; "
            "a tpu storage can only be resized to a whole number of them"
        )
    old = st.nbytes()
    if nbytes == old and math.prod(getattr(st, "_shape", (0,))) * item == nbytes:
        return
    if nbytes < old and not _CAN_SHRINK:
        if nbytes:
            raise NotImplementedError(
                f"UntypedStorage.resize_({nbytes}) on tpu: shrinking a {old}-byte storage needs torch >= 2.13 "
                f"(UntypedStorage._swap_data_ptr_), this is {torch.__version__}; only resize_(0) (free) works"
            )
        st._jx = None  # free the device memory; the C++ size stays (see above)
        return
    n = nbytes // item
    _set_elements(st, n, dtype)
    if nbytes < old:
        st._swap_data_ptr_(new_tensor((0,), torch.uint8).untyped_storage())  # now 0 bytes in C++
    if nbytes > st.nbytes():
        set_geometry(torch._C._acc.create_empty_tensor((0,), torch.uint8), st, 0, [nbytes], [1])


def _set_elements(st: Any, n: int, dtype: torch.dtype) -> None:
    """Makes the storage's array ``n`` elements long, keeping the leading ones."""
    if n == math.prod(getattr(st, "_shape", (-1,))):
        return
    a = getattr(st, "_jx", None)
    if n == 0 or a is None:
        st._shape, st._dtype, st._jx = (n,), dtype, None
        return
    st._jx = execute(_resize_program(tuple(st._shape), n, _dtypes.to_jax(dtype)), base_array(st))
    st._shape = (n,)


@functools.lru_cache(maxsize=1024)
def _resize_program(shape: tuple[int, ...], n: int, dtype: Any) -> Program:
    def run(a: Any) -> Any:
        flat = a.reshape(-1)
        if n <= flat.size:
            return flat[:n]
        return jnp.zeros(n, dtype).at[: flat.size].set(flat)

    return Program(f"resize storage {list(shape)} -> [{n}]", run)


def _kernel_storage_value(st: Any) -> None:
    if getattr(st, "_raw", None) is not None:
        storage_value(st, torch.uint8)


torch.UntypedStorage.resize_ = _resize_storage


def _resize_storage_bytes(variable: torch.Tensor, new_size: int) -> None:
    """``torch.ops.inductor.resize_storage_bytes_``, the op compiled graphs (compiled FSDP2) resize
    storages with; its own kernel calls the C++ hook, as ``UntypedStorage.resize_`` does."""
    resize_storage(variable.untyped_storage(), int(new_size))


_inductor_lib = torch.library.Library("inductor", "IMPL")
_inductor_lib.impl("resize_storage_bytes_", _resize_storage_bytes, "PrivateUse1")


def storage_value(st: Any, dtype: torch.dtype) -> Any:
    """A storage's data as a flat array of ``dtype``; raw bytes (from torch.load) are reinterpreted."""
    raw = getattr(st, "_raw", None)
    if raw is not None:
        item = _dtypes.to_jax(dtype).itemsize
        if dtype == torch.bool:
            value = raw.astype(jnp.bool_)
        elif item == 1:
            value = lax.bitcast_convert_type(raw, _dtypes.to_jax(dtype))
        else:
            value = lax.bitcast_convert_type(raw.reshape(-1, item), _dtypes.to_jax(dtype))
        st._raw = None
        st._shape, st._dtype, st._jx = (int(value.shape[0]),), dtype, value
    return st
