"""Hand-written PrivateUse1 kernels: the tensor life cycle and views.

These are the ops that are not pure functions of arrays: allocation, host transfers, reading a
scalar, views (which share storage) and storage surgery (``resize_``, ``set_``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch
from torch.nn.parameter import UninitializedTensorMixin

from torch_tpu.core import extension as _extension
from torch_tpu.core.devices import check_index
from torch_tpu.dispatch import host_placement as _host_placement
from torch_tpu.ops import amp as _amp
from torch_tpu.ops import optim as _optim
from torch_tpu.ops._registry import kernel
from torch_tpu.runtime import host_reads, metrics
from torch_tpu.runtime.executor import Program, execute
from torch_tpu.runtime.fused import user_site
from torch_tpu.tensor import overlap as _overlap
from torch_tpu.tensor import value_checks as _value_checks
from torch_tpu.tensor.meta import device_mismatch, view_dispatch_key
from torch_tpu.tensor.storage import (
    contiguous_strides,
    dense_layout,
    is_tpu,
    new_strided,
    new_tensor,
    read,
    read_array,
    resize_storage,
    set_base,
    set_geometry,
    storage_value,
    to_cpu,
    to_numpy,
    write,
)
from torch_tpu.tensor.transfer import host_to_device

aten = torch.ops.aten
DK = torch._C.DispatchKey


def _check_device(device: Any) -> None:
    if device is not None:
        d = torch.device(device)
        if d.type == "tpu":
            check_index(d.index)


def _check_size(op: str, size) -> tuple[int, ...]:
    shape = tuple(int(s) for s in size)
    if any(s < 0 for s in shape):
        raise RuntimeError(f"{op}: Trying to create tensor with negative dimension: {list(shape)}")
    return shape


_complex_half_warned = False


def _warn_complex_half() -> None:
    """CPU's warning when memory for complex32 is made: once a process, at every allocation where
    ``torch._C._set_warnAlways(True)`` (as PyTorch's tests set)."""
    global _complex_half_warned
    if _complex_half_warned and not torch._C._get_warnAlways():
        return
    _complex_half_warned = True
    site = user_site() or ("<unknown>", 0)  # the user's line, as CPU's C++ warning names it
    warnings.warn_explicit("ComplexHalf support is experimental and many operators don't support it yet.",
                           UserWarning, site[0], site[1])
    with warnings.catch_warnings():  # torch's own once-a-process warning is spent too: the meta
        warnings.simplefilter("ignore")  # tensors standing in for this one would give it again
        torch.empty(0, dtype=torch.complex32, device="meta")


@kernel(aten.empty.memory_format, fusable=True)
def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    _check_device(device)
    shape = _check_size("empty", size)
    dtype = dtype or torch.get_default_dtype()
    if dtype is torch.complex32:
        _warn_complex_half()
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        t = new_tensor(shape, dtype)
    else:
        stride = tuple(torch.empty(shape, device="meta", memory_format=memory_format).stride())  # raises as CPU
        t = _strided(shape, stride, dtype)
    return t.fill_(_fill_value(dtype)) if _deterministic_fill() else t


@kernel(aten.empty_strided.default, fusable=True)
def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    """Dense strides (channels_last, a permutation: what empty_like and autograd's gradient layout
    ask for) are kept; an overlapping or gapped layout is made contiguous (XLA arrays are dense)."""
    _check_device(device)
    dtype = dtype or torch.get_default_dtype()
    if dtype is torch.complex32:
        _warn_complex_half()
    t = _strided(_check_size("empty_strided", size), tuple(stride), dtype)
    return t.fill_(_fill_value(dtype)) if _deterministic_fill() else t


def _strided(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if stride != contiguous_strides(shape):
        storage_shape = dense_layout(shape, stride)
        if storage_shape is not None:
            return new_strided(shape, stride, storage_shape, dtype, None)
    return new_tensor(shape, dtype)


@kernel(aten._copy_from.default, fusable=True)
def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if is_tpu(dst):
        if tuple(src.shape) != tuple(dst.shape):
            _check_copy_broadcast(tuple(dst.shape), tuple(src.shape))
            src = src.expand(dst.shape) if not is_tpu(src) else src
        write(dst, read(src) if is_tpu(src) else host_to_device(src))
        return dst
    if dst.device.type != "cpu":
        raise device_mismatch("aten._copy_from", dst.device)
    with torch.no_grad():
        dst.copy_(to_cpu(src))
    return dst


_COMPOSITE_COPY = torch.library.get_kernel(aten.copy_.default, "CPU")  # torch's own: CPU's checks, then _copy_from
_CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


@kernel(aten.copy_.default, fusable=True)
def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """torch's own ``copy_``, except into a negative or conjugate view (``x._neg_view()``,
    ``z.conj()``). torch's fallback for those bits passes ``copy_`` through but not the
    ``_copy_from`` it calls, which would then write into a resolved clone: the write was lost.
    Here the source's values are made (torch's checks and casts), given the destination's bits and
    written to its storage, as CPU's copy does when the bits differ."""
    if is_tpu(self) and self is not src:  # CPU's TensorIterator checks, which torch's copy_ skips for us
        if _overlap.internal(self):
            raise RuntimeError(f"aten.copy_: {_overlap.INTERNAL}")
        if _overlap.status(self, src) == "partial":
            raise RuntimeError(f"aten.copy_: {_overlap.INPUT}")
    if not (self.is_neg() or self.is_conj()):
        return _COMPOSITE_COPY.call_boxed(_CPU_KEYS, self, src, non_blocking)
    if not is_tpu(self):  # a CPU view with a bit, from a tpu source: CPU's copy honours the bit
        return self.copy_(src.to("cpu"))
    value = torch.empty(self.shape, dtype=self.dtype, device=self.device)
    _COMPOSITE_COPY.call_boxed(_CPU_KEYS, value, src, non_blocking)  # the fallback resolves src's bits
    if self.is_neg():
        value.neg_()
    if self.is_conj():
        value.conj_physical_()
    write(self, read(value))
    return self


def _check_copy_broadcast(dst: tuple[int, ...], src: tuple[int, ...]) -> None:
    """``copy_``'s shape rule in CPU's words: ``src`` must broadcast to ``dst``'s shape."""
    nd = max(len(dst), len(src))
    a, b = (1,) * (nd - len(dst)) + dst, (1,) * (nd - len(src)) + src
    for d in reversed(range(nd)):
        if a[d] != b[d] and a[d] != 1 and b[d] != 1:
            raise RuntimeError(f"The size of tensor a ({a[d]}) must match the size of tensor b ({b[d]}) "
                               f"at non-singleton dimension {d}")
    full = tuple(max(x, y) if min(x, y) != 0 else 0 for x, y in zip(a, b))
    if full != dst:
        raise RuntimeError(f"output with shape {list(dst)} doesn't match the broadcast shape {list(full)}")


@kernel(aten._copy_from_and_resize.default, fusable=True)
def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if tuple(dst.shape) != tuple(src.shape):
        dst.resize_(src.shape)
    return _copy_from(src, dst)


@kernel(aten._to_copy.default, fusable=True)
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """``.to()`` from tpu. To the host, the copy is synchronous, so ``non_blocking`` needs no pinned
    buffer (which PyTorch's Python backend hooks cannot provide)."""
    if isinstance(self, UninitializedTensorMixin):
        # a lazy module's parameter moved before its first forward: its Python class hides
        # .shape; the empty tensor under it moves like any other (the parameter keeps its class)
        self = self.as_subclass(torch.Tensor)
    dtype = dtype or self.dtype
    target = torch.device(device) if device is not None else self.device
    if not is_tpu(self):  # BackendSelect sends CPU -> tpu copies here too
        if self.device.type != "cpu":
            raise device_mismatch("aten._to_copy", self.device)
        check_index(target.index)
        shape, stride = tuple(self.shape), tuple(self.stride())
        if memory_format in (None, torch.preserve_format) and stride != contiguous_strides(shape):
            storage_shape = dense_layout(shape, stride)
            if storage_shape is not None:  # channels_last stays so, as a copy to CUDA does
                perm = sorted(range(len(shape)), key=lambda d: -stride[d])
                value = host_to_device(self.to(dtype).permute(perm))
                return new_strided(shape, stride, storage_shape, dtype, value)
        elif memory_format not in (None, torch.preserve_format):
            self = self.contiguous(memory_format=memory_format)
            return _to_copy(self, dtype=dtype, device=target, non_blocking=non_blocking)
        return new_tensor(shape, dtype, host_to_device(self.to(dtype)))
    if target.type == "cpu":
        out = to_cpu(self).to(dtype)
        if memory_format not in (None, torch.preserve_format):
            out = out.contiguous(memory_format=memory_format)
        elif not self.is_contiguous() and dense_layout(tuple(self.shape), tuple(self.stride())) is not None:
            # a dense layout (channels_last, a transpose) keeps its strides, as a copy from CUDA does
            out = torch.empty_strided(self.shape, self.stride(), dtype=dtype).copy_(out)
        return out
    if target.type != "tpu":
        raise device_mismatch("aten._to_copy", target)
    check_index(target.index)
    if not self.is_floating_point() and not self.is_complex() and self.is_contiguous() and _host_placement.on_host(
            "aten._to_copy.default", (_host_placement.signature(self), dtype), (self,), {}):
        return _host_placement.run(aten._to_copy.default, (self,), {"dtype": dtype})
    if self.is_contiguous() or memory_format not in (None, torch.preserve_format):
        out = _empty(tuple(self.shape), dtype, memory_format=memory_format)
    else:  # preserve_format: a dense layout (channels_last) is kept, as on CPU
        like = torch.empty_like(torch.empty_strided(self.shape, self.stride(), device="meta"))
        out = _strided(tuple(self.shape), tuple(like.stride()), dtype)
    write(out, read(self))
    return out


@kernel(aten._local_scalar_dense.default)
def _local_scalar_dense(t: torch.Tensor) -> Any:
    if t.numel() != 1:
        raise RuntimeError(f"a Tensor with {t.numel()} elements cannot be converted to Scalar")
    value = to_numpy(t).reshape(()).item()
    if t.dtype.is_floating_point:
        return float(value)
    if t.dtype.is_complex:
        return complex(value)
    if t.dtype == torch.bool:
        return bool(value)
    return int(value)


def _zero(xp: Any, values: Any) -> Any:
    return values == 0


@kernel(aten._assert_async.default, aten._assert_async.msg)
def _assert_async(self: torch.Tensor, assert_msg: str | None = None) -> None:
    """``torch._assert_async``: a check that does not wait for the device, as on CUDA. A tensor whose
    value the host holds is checked at once; one the device computes is checked with the step and
    raises CPU's RuntimeError at the next host read. The element count is checked now (CPU's words)."""
    if self.numel() != 1:
        raise RuntimeError(f"Boolean value of Tensor with {'no values' if not self.numel() else 'more than one value'} "
                           "is ambiguous")
    message = assert_msg or "Expected Tensor with single nonzero value, but got zero"
    _value_checks.check_values(self, _zero, (), lambda _value: RuntimeError(message))


@kernel(aten.record_stream.default)
def _record_stream(self: torch.Tensor, s: Any) -> None:
    """Nothing to record: XLA keeps a buffer until every queued program that reads it has run, on
    the device's one queue (``torch.tpu.Stream``)."""


@kernel(aten.equal.default)
def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    for t in (a, b):  # either may be the CPU one: the dispatcher picks tpu's kernel for the pair
        if not is_tpu(t):
            raise device_mismatch("aten.equal", t.device)
    if a.shape != b.shape:
        return False
    if host_reads.mode:
        host_reads.synchronizing()
    return bool(np.asarray(jnp.array_equal(read_array(a), read_array(b))))


def _view_kernel(op: torch._ops.OpOverload):
    """A view runs torch's own meta kernel on our tensor: exact sizes, strides and offset, and the
    result shares our storage (so it shares the jax array)."""
    key = view_dispatch_key(op)
    name = str(op)
    counts = metrics.op_counts
    get_kernel = getattr(torch.library, "get_kernel", None)  # torch >= 2.10
    if op is aten._unsafe_view.default and get_kernel is not None:
        # CPU's _unsafe_view is view's computation (view_impl) over the same storage, without
        # autograd's view tracking (that is the autograd layer's, above us); the Meta kernel torch
        # registers for it is a Python decomposition that comes back here through aten.view
        viewed = get_kernel(aten.view.default, "Meta").call_boxed
        keyset = torch._C.DispatchKeySet(DK.Meta)

        def run(self, size):
            counts[name] += 1
            return viewed(keyset, self, size)

        run.counts_itself = True
        return run
    if key == DK.Meta and get_kernel is not None:
        # the Meta kernel itself, called boxed: ``_op_dk`` finds the operation and matches the
        # arguments against its schema at every call, a third of a view's cost (transpose, slice
        # and expand each come here through as_strided)
        keyset = torch._C.DispatchKeySet(DK.Meta)
        if op is aten._reshape_alias.default:
            # its Meta kernel is torch's Python decomposition (a view call, which comes back here
            # as aten.view): CPU's kernel aliases the storage with the given sizes and strides,
            # which is as_strided at the tensor's own offset
            strided = get_kernel(aten.as_strided.default, "Meta").call_boxed

            def run(self, size, stride):
                counts[name] += 1
                return strided(keyset, self, size, stride, self.storage_offset())

            run.counts_itself = True
            return run
        meta = get_kernel(op, "Meta").call_boxed
        if op is aten.as_strided.default:
            checked = _as_strided_checked()

            def run(self, size, stride, storage_offset=None):
                counts[name] += 1
                return checked(self, size, stride, storage_offset)

            run.counts_itself = True
            return run

        def run(*args, **kwargs):
            counts[name] += 1  # counted here: views are hot, a counting wrapper is a frame more
            return meta(keyset, *args, **kwargs)

        run.counts_itself = True
        return run

    def run(*args, **kwargs):
        counts[name] += 1  # counted here: views are hot, a counting wrapper is a frame more
        return op._op_dk(key, *args, **kwargs)

    run.counts_itself = True
    return run


def _as_strided_checked() -> Any:
    """as_strided through torch's Meta kernel, which takes any geometry, and CPU's refusal of one
    reaching past the storage (which here would read clamped, wrong elements), uncounted: the view
    kernel below counts, and so does the C++ one (csrc/views.cpp), which calls this for a view it
    cannot show to lie inside its source."""
    meta = torch.library.get_kernel(aten.as_strided.default, "Meta").call_boxed
    keyset = torch._C.DispatchKeySet(DK.Meta)

    def checked(self, size, stride, storage_offset=None):
        out = meta(keyset, self, size, stride, storage_offset)
        extent = 1
        for n, s in zip(size, stride):
            if n == 0:
                return out  # no elements: any storage holds it, as on CPU
            extent += (n - 1) * s
        st = self.untyped_storage()
        shape = getattr(st, "_shape", None)  # None: AOTAutograd's wrappers
        if shape is not None:
            offset = self.storage_offset() if storage_offset is None else storage_offset
            # in elements when the view's dtype is the storage's (nearly always), else in bytes
            if self.dtype is not st._dtype or offset + extent > math.prod(shape):
                _check_strided_bounds(out, size, stride, extent, shape, st._dtype)
        return out

    return checked


def _check_strided_bounds(out: torch.Tensor, size: Any, stride: Any, extent: int, shape: tuple,
                          storage_dtype: torch.dtype) -> None:
    """CPU's refusal of a view whose last element lies past its storage (in bytes, as CPU counts,
    since a dtype view's elements are not its storage's)."""
    itemsize = out.element_size()
    need = (extent + out.storage_offset()) * itemsize
    have = math.prod(shape) * storage_dtype.itemsize
    if need > have:
        raise RuntimeError(
            f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {out.storage_offset()}, and "
            f"itemsize {itemsize} requiring a storage size of {need} are out of bounds for storage of size {have}")


# served by the C++ extension where it is loaded (csrc/views.cpp: CPU's own kernels, without a call into
# Python per view), else here
for _op in (aten.view.default, aten.as_strided.default, aten._reshape_alias.default, aten.unfold.default,
            aten._unsafe_view.default):
    if str(_op) not in _extension.views_in_cpp():
        kernel(_op, fusable=True, how="view (meta)")(_view_kernel(_op))
if _extension.views_in_cpp():
    _extension.set_as_strided_fallback(_as_strided_checked())


@kernel(aten.as_strided_.default, fusable=True)
def _as_strided_(t: torch.Tensor, size, stride, storage_offset=None) -> torch.Tensor:
    """The in-place view ops (unsqueeze_, transpose_, t_, squeeze_, ...) all land here: new
    geometry over the same storage, checked against the base array's size as CPU checks it."""
    offset = t.storage_offset() if storage_offset is None else storage_offset
    st = t.untyped_storage()
    # AOTAutograd replays in-place views on its own wrapper tensors, whose storage is not ours
    numel = math.prod(st._shape) if hasattr(st, "_shape") else None
    if numel is not None and all(s > 0 for s in size):
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= numel:
            raise RuntimeError(
                f"setStorage: sizes {list(size)}, strides {list(stride)}, storage offset {offset} are out of "
                f"bounds for storage of {numel} elements"
            )
    set_geometry(t, st, offset, list(size), list(stride))
    return t


@kernel(aten._new_zeros_with_same_feature_meta.default)
def _new_zeros_with_same_feature_meta(self: torch.Tensor, other: torch.Tensor, *, self_num_batch_dims: int = 0):
    """Forward AD's tangent for a primal that is a view (``x.real``, a slice): zeros over a storage
    as large as the primal's, viewed with the primal's geometry (plus ``self``'s batch dims in
    front). torch's kernel sizes that storage from the storage's ``nbytes``, which a tpu storage
    does not carry (its array lives in jax), and so viewed 10 elements of an empty storage."""
    st = other.untyped_storage()
    numel = math.prod(st._shape) * st._dtype.itemsize // other.dtype.itemsize
    batch = list(self.shape[:self_num_batch_dims])
    strides, acc = [], numel
    for n in reversed(batch):
        strides.append(acc)
        acc *= n
    zeros = torch.zeros(acc, dtype=self.dtype, device=self.device)
    return zeros.as_strided(batch + list(other.shape), strides[::-1] + list(other.stride()),
                            other.storage_offset())


@kernel(aten.view.dtype, fusable=True)
def _view_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A true view, as view_as_real is: torch's own kernel gives the geometry (and CPU's errors,
    naming storage_offset for a slice) over the same storage; reads and writes reinterpret the
    storage's bits (``storage._alias_geometry``)."""
    if dtype == t.dtype:
        return t
    return aten.view.dtype._op_dk(_VIEW_DTYPE_KEY, t, dtype)


_VIEW_DTYPE_KEY = view_dispatch_key(aten.view.dtype)


# --------------------------------------------------------------------------- storage surgery
@kernel(aten.resize_.default)
def _resize_(t: torch.Tensor, size, memory_format=None) -> torch.Tensor:
    """CPU's ``resize_``: the same storage, grown (never shrunk) to hold the new size at the same
    offset, its bytes kept; the tensor becomes contiguous (or ``memory_format``) over it. New
    elements are zeros, or NaN / the largest integer under ``torch.use_deterministic_algorithms``
    (CPU's ``fill_uninitialized_memory``)."""
    shape = _check_size("resize_", size)
    if tuple(t.shape) == shape:
        return t
    st = t.untyped_storage()
    storage_value(st, t.dtype)
    if st._dtype is not None and st._dtype != t.dtype:  # a view(dtype) alias: rebuild it contiguous
        flat = read_array(t).reshape(-1)
        n = math.prod(shape)
        value = jnp.zeros(n, flat.dtype).at[: min(n, flat.size)].set(flat[: min(n, flat.size)]).reshape(shape)
        set_base(t, shape, t.dtype, value)
        return t
    have = math.prod(st._shape) if st._dtype is not None else 0
    need = t.storage_offset() + math.prod(shape)
    if need > have:

        resize_storage(st, need * t.element_size())
        if _deterministic_fill():
            tail = torch.empty(0, dtype=t.dtype, device=t.device)
            set_geometry(tail, st, have, [need - have], [1])
            tail.fill_(_fill_value(t.dtype))
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        stride = contiguous_strides(shape)
    else:
        stride = tuple(torch.empty(shape, device="meta", memory_format=memory_format).stride())
    set_geometry(t, st, t.storage_offset(), list(shape), list(stride))
    return t


def _deterministic_fill() -> bool:
    """Whether new memory is filled (``torch.use_deterministic_algorithms(True)`` with
    ``torch.utils.deterministic.fill_uninitialized_memory``, as CPU and CUDA do)."""
    return torch.are_deterministic_algorithms_enabled() and torch._C._get_deterministic_fill_uninitialized_memory()


def _fill_value(dtype: torch.dtype) -> Any:
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).max


@kernel(aten.set_.source_Storage_storage_offset, fusable=True)
def _set_storage(t, source, storage_offset, size, stride=()):
    storage_value(source, t.dtype)
    # a storage holding another dtype is fine: reads and writes reinterpret its bits, as a
    # view(dtype) does (torch's storage API reads a storage through a uint8 tensor set_ onto it)
    stride = list(stride) if len(stride) else list(contiguous_strides(tuple(size)))
    set_geometry(t, source, storage_offset, list(size), stride)
    return t


@kernel(aten.set_.source_Storage, fusable=True)
def _set_storage_whole(t, source):
    st = storage_value(source, t.dtype)
    nbytes = math.prod(st._shape) * st._dtype.itemsize if st._dtype is not None else 0
    return _set_storage(t, source, 0, [nbytes // t.element_size()], [1])


@kernel(aten.set_.source_Tensor, fusable=True)
def _set_tensor(t, source):
    if not is_tpu(source):
        raise device_mismatch("aten.set_", source.device)
    return _set_storage(t, source.untyped_storage(), source.storage_offset(), list(source.shape), list(source.stride()))


@kernel(aten.is_set_to.default)
def _is_set_to(t, other):
    """CPU's rule: the same storage, offset, sizes and strides (the CPU fallback compared copies)."""
    if not is_tpu(other):
        return False
    return (t.untyped_storage()._cdata == other.untyped_storage()._cdata
            and t.storage_offset() == other.storage_offset()
            and tuple(t.shape) == tuple(other.shape) and tuple(t.stride()) == tuple(other.stride()))


@kernel(aten.set_.default, fusable=True)
def _set_empty(t):
    set_base(t, (0,), t.dtype, None)
    return t


# ------------------------------------------------------- mixed-precision loss scaling (GradScaler)
def _one_element(op: str, name: str, t: torch.Tensor, dtype: torch.dtype, kind: str) -> None:
    """CPU's checks on the scaler's bookkeeping tensors."""
    if not is_tpu(t):
        raise device_mismatch(op, t.device)
    if t.numel() != 1:
        raise RuntimeError(f"{op}: {name} must be a 1-element tensor.")
    if t.dtype != dtype:
        raise RuntimeError(f"{op}: {name} must be a {kind} tensor.")


def _unscale_all(*xs: Any) -> tuple:
    outs, found = _amp.unscale(list(xs[:-2]), xs[-2], xs[-1])
    return (*outs, found)


def _update_all(*xs: Any) -> tuple:
    return _amp.update_scale(*xs)


_UNSCALE = Program("aten._amp_foreach_non_finite_check_and_unscale_", _unscale_all, multi=True)
_UPDATE_SCALE = Program("aten._amp_update_scale_", _update_all, multi=True)


@kernel(aten._amp_foreach_non_finite_check_and_unscale_.default, fusable=True)
def _amp_unscale_(grads, found_inf, inv_scale):
    op = "aten._amp_foreach_non_finite_check_and_unscale_"
    _one_element(op, "found_inf", found_inf, torch.float32, "float")
    _one_element(op, "inv_scale", inv_scale, torch.float32, "float")
    for g in grads:
        if not is_tpu(g):
            raise device_mismatch(op, g.device)
    if not grads:
        return None
    values = execute(_UNSCALE, *[read(g) for g in grads], read(found_inf), read(inv_scale))
    for g, v in zip(grads, values):
        write(g, v)
    write(found_inf, values[-1])
    return None


@kernel(aten._amp_update_scale_.default, fusable=True)
def _amp_update_scale_(scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval):
    op = "aten._amp_update_scale_"
    _one_element(op, "growth_tracker", growth_tracker, torch.int32, "int")
    _one_element(op, "current_scale", scale, torch.float32, "float")
    _one_element(op, "found_inf", found_inf, torch.float32, "float")
    new_scale, tracker = execute(_UPDATE_SCALE, read(scale), read(growth_tracker), read(found_inf),
                                 float(scale_growth_factor), float(scale_backoff_factor), int(growth_interval))
    write(scale, new_scale)
    write(growth_tracker, tracker)
    return scale


# ------------------------------------------------------------- fused=True optimizers (one program)
_OPTIMIZER_PROGRAMS: dict[tuple, Program] = {}


def _optimizer_program(name: str, step: Any, sizes: tuple, flags: dict) -> Program:
    """A program for one optimizer kernel over lists of the given lengths: its inputs are the lists'
    arrays, one after another, then the optional tensors and the hyperparameters."""
    key = (name, sizes, tuple(sorted(flags.items())))
    program = _OPTIMIZER_PROGRAMS.get(key)
    if program is None:
        n_lists = len(sizes)

        def run(*xs: Any) -> tuple:
            lists, at = [], 0
            for n in sizes:
                lists.append(list(xs[at:at + n]))
                at += n
            rest = list(xs[at:])
            extra = {k: rest.pop(0) if flags[f"has_{k}"] else None for k in ("grad_scale", "found_inf")}
            options = {k: v for k, v in flags.items() if k not in ("has_grad_scale", "has_found_inf")}
            outs = step(*lists[:n_lists], *rest, **options, **extra)
            return tuple(x for out in outs for x in out)

        program = _OPTIMIZER_PROGRAMS[key] = Program(name, run, multi=True)
    return program


def _run_optimizer(name: str, step: Any, lists: list[list], written: list[list], scalars: list, flags: dict,
                   grad_scale: Any, found_inf: Any) -> None:
    for ts in lists:
        for t in ts:
            if not is_tpu(t):
                raise device_mismatch(name, t.device)
    extra = [read(t) for t in (grad_scale, found_inf) if t is not None]
    flags = {**flags, "has_grad_scale": grad_scale is not None, "has_found_inf": found_inf is not None}
    program = _optimizer_program(name, step, tuple(len(ts) for ts in lists), flags)
    values = execute(program, *[read(t) for ts in lists for t in ts], *extra,
                     *[read(s) if is_tpu(s) else float(s) for s in scalars])  # a CPU lr tensor: its value
    targets = [t for ts in written for t in ts]  # None: an output left unwritten (grads, unless unscaled)
    for t, v in zip(targets, values):
        if t is not None:
            write(t, v)


def _fused_adam(decoupled: bool) -> Any:
    name = f"aten._fused_adam{'w' if decoupled else ''}_"

    def kernel_fn(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                  weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        if not self:
            return None
        maxes = max_exp_avg_sqs if amsgrad else []
        grads_written = grads if grad_scale is not None else [None] * len(grads)
        _run_optimizer(
            name, _optim.adam, [self, grads, exp_avgs, exp_avg_sqs, maxes, state_steps],
            [self, grads_written, exp_avgs, exp_avg_sqs, maxes], [lr, beta1, beta2, weight_decay, eps],
            {"amsgrad": bool(amsgrad), "maximize": bool(maximize), "decoupled": decoupled,
             "decay": float(weight_decay) != 0},
            grad_scale, found_inf,
        )
        return None

    return kernel_fn


def _fused_sgd(self, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
               is_first_step, grad_scale=None, found_inf=None):
    if not self:
        return None
    has_momentum = float(momentum) != 0
    buffers = momentum_buffer_list if has_momentum else []
    grads_written = grads if grad_scale is not None else [None] * len(grads)
    _run_optimizer(
        "aten._fused_sgd_", _optim.sgd, [self, grads, buffers], [self, grads_written, buffers],
        [weight_decay, momentum, lr, dampening],
        {"nesterov": bool(nesterov), "maximize": bool(maximize), "is_first_step": bool(is_first_step),
         "has_momentum": has_momentum, "decay": float(weight_decay) != 0},
        grad_scale, found_inf,
    )
    return None


kernel(aten._fused_adam_.default, aten._fused_adam_.tensor_lr, fusable=True)(_fused_adam(False))
kernel(aten._fused_adamw_.default, aten._fused_adamw_.tensor_lr, fusable=True)(_fused_adam(True))
kernel(aten._fused_sgd_.default, aten._fused_sgd_.tensor_lr, fusable=True)(_fused_sgd)
