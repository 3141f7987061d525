"""Lowerings: the FFT primitives behind ``torch.fft``, and complex-number support.

``torch.fft.*`` are CompositeImplicitAutograd functions; all of them end in three ATen ops:
``_fft_r2c`` (real to onesided or full complex), ``_fft_c2r`` (onesided complex to real) and
``_fft_c2c``. Each takes a ``normalization`` code that is the *scale* applied to the unscaled
transform, whatever the direction: 0 none, 1 ``1/sqrt(n)``, 2 ``1/n`` (n the product of the
transformed sizes of the signal). So the lowerings compute unscaled transforms (jax's ``norm=``
"backward" for forward transforms, "forward" for inverse ones) and scale afterwards.

Complex support: ``view_as_real``/``view_as_complex`` reinterpret a tensor's elements. A tpu
storage holds one typed jax array, so these cannot alias it: they are kernels that return a
copy (like ``Tensor.view(dtype)``). Reading through them is exact; writing through them (e.g.
``z.real.zero_()``) does not reach the original tensor.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import aten, kernel, lower
from torch_tpu.runtime.executor import Program, execute
from torch_tpu.tensor import out_dtypes as _out_dtypes
from torch_tpu.tensor.meta import device_mismatch, meta_outputs, to_meta
from torch_tpu.tensor.storage import is_tpu, read, set_base, write

_LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


# ----------------------------------------------------------------------------------------- fft
def _scale(x, n: int, normalization: int):
    """Applies torch's ``fft_norm_mode`` to an unscaled transform of signal size ``n``."""
    if normalization == 1:
        return x * (1.0 / math.sqrt(n)) if n else x
    if normalization == 2:
        return x * (1.0 / n) if n else x
    return x


def _complex_of(x):
    """Low-precision inputs are transformed in complex64 (the result is cast back by the dispatcher)."""
    if np.dtype(x.dtype) in _LOW:
        return x.astype(jnp.float32)
    return x


def _double(self, *args, **kwargs) -> bool:
    """An FFT of float64 or complex128: XLA:TPU's FFT takes 32-bit types only ("Unexpected operand
    type for FFT: f64"), so on a TPU (or with a TPU target) it runs on the host, as CPU computes
    it, rather than in complex64, which would quietly lose half the digits."""
    return self.dtype in (torch.float64, torch.complex128)


@lower(aten._fft_r2c.default, host_on_tpu=_double)
def fft_r2c(self, dim, normalization, onesided):
    """Real-to-complex transform over ``dim``; ``onesided`` keeps the last dim's first n//2+1 bins."""
    x = _complex_of(self)
    dim = [d % x.ndim for d in dim]
    n = math.prod(x.shape[d] for d in dim)
    if onesided:
        out = jnp.fft.rfftn(x, axes=dim, norm="backward")
    else:
        out = jnp.fft.fftn(x, axes=dim, norm="backward")
    return _scale(out, n, normalization)


@lower(aten._fft_c2r.default, host_on_tpu=_double)
def fft_c2r(self, dim, normalization, last_dim_size):
    """Onesided complex-to-real inverse transform; ``last_dim_size`` is the real signal's last size.

    Like pocketfft, only the first ``last_dim_size // 2 + 1`` bins of the last dim are read and the
    imaginary parts that a Hermitian signal cannot have are ignored.
    """
    x = _complex_of(self)
    dim = [d % x.ndim for d in dim]
    s = [x.shape[d] for d in dim[:-1]] + [last_dim_size]
    half = last_dim_size // 2 + 1
    if x.shape[dim[-1]] > half:
        x = lax.slice_in_dim(x, 0, half, axis=dim[-1])
    elif x.shape[dim[-1]] < half:  # zero-pad the missing bins
        pad = [(0, 0)] * x.ndim
        pad[dim[-1]] = (0, half - x.shape[dim[-1]])
        x = jnp.pad(x, pad)
    out = jnp.fft.irfftn(x, s=s, axes=dim, norm="forward")
    return _scale(out, math.prod(s), normalization)


@lower(aten._fft_c2c.default, host_on_tpu=_double)
def fft_c2c(self, dim, normalization, forward):
    """Complex-to-complex transform over ``dim`` (``forward``: the sign of the exponent)."""
    x = _complex_of(self)
    dim = [d % x.ndim for d in dim]
    if not dim:
        return x
    n = math.prod(x.shape[d] for d in dim)
    out = jnp.fft.fftn(x, axes=dim, norm="backward") if forward else jnp.fft.ifftn(x, axes=dim, norm="forward")
    return _scale(out, n, normalization)


# ------------------------------------------------------------------------------------- complex
def _copy_program(name: str, fn, shape: tuple, dtype: torch.dtype, out_shape: tuple, out_dtype: torch.dtype):
    key = (name, shape, dtype, out_shape, out_dtype)
    prog = _PROGRAMS.get(key)
    if prog is None:
        jdt = _dtypes.to_jax(out_dtype)
        prog = _PROGRAMS[key] = Program(
            f"{name}({str(dtype).removeprefix('torch.')}{list(shape)})",
            lambda x: fn(x).astype(jdt).reshape(out_shape),
        )
    return prog


_PROGRAMS: dict[tuple, Program] = {}


# ``_conj`` and ``_neg_view`` are torch's own (an alias with the conjugate or negative bit set):
# true views, so a write through one reaches its base. PyTorch's Conjugate and Negative fallbacks
# hand every other op a resolved clone; ``copy_`` and ``clone``, which they pass through, honour the
# bits (torch_tpu.dispatch.hand_kernels.copy_, elementwise's clone). In a graph, values have no views:
lower(aten._neg_view.default, graph_only=True)(jnp.negative)
lower(aten._conj.default, aten._conj_physical.default, aten.conj_physical.default, graph_only=True)(jnp.conj)


@lower(aten.view_as_real.default, graph_only=True)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@lower(aten.view_as_complex.default, graph_only=True)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@kernel(aten.conj_physical.out)
def conj_physical_out(self: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
    """``conj_physical`` (and ``conj_physical_``, which CompositeExplicitAutograd routes here)."""
    if not is_tpu(out):
        raise device_mismatch("aten.conj_physical.out", out.device)
    if out.dtype != self.dtype:  # CPU's rule for another out dtype (it wants the same), in its words
        verdict = _out_dtypes.cpu_verdict(aten.conj_physical.out, (self,), {"out": out})
        if isinstance(verdict, BaseException):
            raise verdict
    meta = meta_outputs(aten.conj_physical.out, (self,), {"out": to_meta(out)})[0]
    shape = tuple(meta.shape)
    prog = _copy_program("aten.conj_physical", jnp.conj, tuple(self.shape), self.dtype, shape, out.dtype)
    value = execute(prog, read(self))
    if tuple(out.shape) != shape:
        set_base(out, shape, out.dtype, None)
    write(out, value)
    return out


@lower(aten.conj_physical_.default)
def conj_physical_(self):
    """In place: its CompositeExplicitAutograd kernel calls a CPU/CUDA-only stub."""
    return jnp.conj(self)



def _check_parts(a: torch.Tensor, b: torch.Tensor, *args, **kwargs) -> None:
    """CPU's dtype checks for ``complex``/``polar``, which their meta kernels do not make."""
    na, nb = (_dtypes.SCALAR_NAMES.get(t.dtype, str(t.dtype)) for t in (a, b))
    floats = (torch.float16, torch.float32, torch.float64)
    if a.dtype not in floats or b.dtype not in floats:
        raise RuntimeError(f"Expected both inputs to be Half, Float or Double tensors but got {na} and {nb}")
    if a.dtype != b.dtype:
        raise RuntimeError(f"Expected object of scalar type {na} but got scalar type {nb} for second argument")


@lower(aten.complex.default, check=_check_parts)
def complex_(real, imag):
    """``real + i*imag``; its decomposition would write through ``view_as_real``, which is a copy here."""
    return _complex_pair(real, imag)


def _complex_pair(re, im):
    """``re + i*im``, broadcast (the check has made both parts the same float dtype)."""
    re, im = jnp.broadcast_arrays(re, im)
    return lax.complex(re, im)


@lower(aten.polar.default, check=_check_parts)
def polar(abs, angle):  # noqa: A002  (the schema's name)
    return _complex_pair(abs * jnp.cos(angle), abs * jnp.sin(angle))
