"""Lowerings: factories (arange, linspace, logspace, eye, tril/triu_indices).

``full``/``zeros``/``ones``/``scalar_tensor`` reach the backend as ``empty`` + ``fill_``, which is
already one program, so they need nothing here. ``empty_like`` stays uninitialised (an unset
storage).

Factories have no tensor argument, so their ``out=`` overloads are not twins the dispatcher can
derive; small hand kernels compute the functional result and write it into ``out``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import aten, kernel, lower
from torch_tpu.ops.shape import program
from torch_tpu.runtime.executor import execute
from torch_tpu.tensor.storage import new_tensor, remember_host_copy
from torch_tpu.tensor.transfer import numpy_to_device


@lower(aten._efficientzerotensor.default)
def efficientzerotensor(size, dtype=None):
    """Zeros (the gradient of ``sgn`` and others where torch knows the result is zero); a plain
    array: tpu has no ZeroTensor layout to save memory with."""
    return jnp.zeros(tuple(size), _dtypes.to_jax(dtype) if dtype is not None else jnp.float32)


def _all_int(*xs) -> bool:
    return all(isinstance(x, int | bool) for x in xs)


def _arange_args(start, end=None, step=1):
    if end is None:
        start, end = 0, start
    return start, end, step


def _check_arange(start, end, step) -> None:
    if step == 0:
        raise RuntimeError("arange: step must be nonzero")
    if not all(math.isfinite(float(x)) for x in (start, end)):
        raise RuntimeError(f"arange: unsupported range: {start} -> {end}")
    if (step > 0 and end < start) or (step < 0 and end > start):
        raise RuntimeError("arange: upper bound and larger bound inconsistent with step sign")


def _arange_body(start, step, n: int, acc, out):
    return (start + jnp.arange(n, dtype=acc) * step).astype(out)


@kernel(aten.arange.default, aten.arange.start, aten.arange.start_step)
def _arange(*args, dtype=None, layout=None, device=None, pin_memory=None) -> torch.Tensor:
    """``start + i * step``, accumulated in int64 for integer arguments and float64 otherwise
    (CPU also accumulates in double). A hand kernel because the length depends on the Scalar
    values while ``start`` and ``step`` stay runtime inputs, so a new start never recompiles."""
    start, end, step = (x.item() if isinstance(x, torch.Tensor) else x for x in _arange_args(*args))
    _check_arange(start, end, step)
    integral = _all_int(start, end, step)
    if integral and dtype in (None, torch.int64):  # the common case, without the meta kernel's cost
        n, out_dtype = max(0, -((start - end) // step)), torch.int64  # ceil((end - start) / step), exactly
    else:
        meta = aten.arange.start_step(start, end, step, dtype=dtype, device="meta")  # CPU's dtype and length
        n, out_dtype = meta.shape[0], meta.dtype
    acc = np.int64 if integral else np.float64
    if integral and out_dtype == torch.int64 and n <= _UPLOADED_ARANGE:
        # positions, cache indices: CPU's values computed here (int64 wraps as CPU's) and uploaded,
        # a transfer where a program would compile once per length (a decoding loop's every token)
        # and, in fused mode, run on its own; the host copy also serves index checks
        key = (start, step, n)
        value = _ARANGES.get(key)
        if value is None:
            if len(_ARANGES) >= _ARANGES_KEPT:
                del _ARANGES[next(iter(_ARANGES))]
            value = _ARANGES[key] = numpy_to_device(start + np.arange(n, dtype=np.int64) * step)
        return new_tensor((n,), out_dtype, value)
    fn = program("aten.arange", _arange_body, n, acc, _dtypes.to_jax(out_dtype))
    value = execute(fn, acc(start), acc(step))
    if integral and out_dtype == torch.int64 and n <= _HOST_ARANGE:
        # the values are known here: kept as the array's host copy, an index check (positions fed
        # to an embedding every step) reads them instead of queueing a device check to read back
        remember_host_copy(value, start + np.arange(n, dtype=np.int64) * step)
    return new_tensor((n,), out_dtype, value)


# The uploaded aranges, by (start, step, length): a decoding loop asks for the same positions and
# cache indices at every token, and an upload costs more than the rest of the op. Sharing an array
# between tensors is safe: jax arrays are immutable (a write replaces a storage's array), and the
# reference held here keeps a fused program from donating its buffer (``fused._donatable``).
_ARANGES: dict[tuple[int, int, int], object] = {}
_ARANGES_KEPT = 256
_HOST_ARANGE = 1 << 16  # longest integer arange whose values are kept on the host
_UPLOADED_ARANGE = 4096  # longest integer arange uploaded rather than computed on the device


def _linspace_values(start, end, steps: int):
    """CPU's formula: the first half counts up from ``start``, the second down from ``end``."""
    start = jnp.asarray(start, jnp.float64)
    end = jnp.asarray(end, jnp.float64)
    if steps == 1:
        return start.reshape(1)
    i = jnp.arange(steps, dtype=jnp.float64)
    step = (end - start) / (steps - 1)
    return jnp.where(i < steps // 2, start + i * step, end - (steps - 1 - i) * step)


def _check_steps(start, end, steps, *args, **kwargs):
    if steps < 0:
        raise RuntimeError("number of steps must be non-negative")
    for t in (start, end):
        if isinstance(t, torch.Tensor) and t.dim() != 0:
            raise RuntimeError("linspace only supports 0-dimensional start and end tensors, but got tensor(s) "
                               f"with {t.dim()} dimension(s).")


@lower(aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor,
       check=_check_steps)
def linspace(start, end, steps, dtype=None):
    v = _linspace_values(start, end, steps)
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        return jnp.trunc(v)  # integer results truncate toward zero, as CPU's cast
    return v


@lower(aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor,
       check=_check_steps)
def logspace(start, end, steps, base=10.0, dtype=None):
    return jnp.power(jnp.asarray(base, jnp.float64), _linspace_values(start, end, steps))


def _check_eye(n, m=None, **kwargs):
    for v in (n, m):
        if v is not None and v < 0:
            raise RuntimeError(f"n must be greater or equal to 0, got {v}")


@lower(aten.eye.default, aten.eye.m, check=_check_eye)
def eye(n, m=None, dtype=None):
    return jnp.eye(n, n if m is None else m)


def _tri_indices(which, row: int, col: int, offset: int):
    if row == 0 or col == 0:
        return jnp.zeros((2, 0), jnp.int64)
    r, c = which(row, offset, col)
    return jnp.stack([r, c]).astype(jnp.int64)


@lower(aten.tril_indices)
def tril_indices(row, col, offset=0, dtype=None):
    return _tri_indices(jnp.tril_indices, row, col, offset)


@lower(aten.triu_indices)
def triu_indices(row, col, offset=0, dtype=None):
    return _tri_indices(jnp.triu_indices, row, col, offset)


# ---------------------------------------------------------------------------- out= kernels
def _write_out(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if tuple(out.shape) != tuple(value.shape):
        out.resize_(value.shape)
    out.copy_(value)
    return out


def _out_kernel(op: torch._ops.OpOverload, functional, n_args: int) -> None:
    """``op(*args, out=t)`` runs ``functional`` on tpu with ``out``'s dtype and writes into ``t``."""

    def run(*args, out: torch.Tensor, **kwargs):
        return _write_out(out, functional(*args[:n_args], dtype=out.dtype, device=out.device))

    kernel(op)(run)


_out_kernel(aten.arange.out, aten.arange.default, 1)
_out_kernel(aten.arange.start_out, aten.arange.start_step, 3)
_out_kernel(aten.linspace.out, aten.linspace.default, 3)
_out_kernel(aten.logspace.out, aten.logspace.default, 4)
_out_kernel(aten.eye.out, aten.eye.default, 1)
_out_kernel(aten.eye.m_out, aten.eye.m, 2)
