"""The one map between torch dtypes and jax/numpy dtypes.

bfloat16 has no native numpy type; jax uses ``ml_dtypes.bfloat16``, and host copies go through
a same-width integer view so that no value is rounded on the way.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(jnp.float32),
    torch.float64: np.dtype(jnp.float64),
    torch.float16: np.dtype(jnp.float16),
    torch.bfloat16: np.dtype(jnp.bfloat16),
    torch.int64: np.dtype(jnp.int64),
    torch.int32: np.dtype(jnp.int32),
    torch.int16: np.dtype(jnp.int16),
    torch.int8: np.dtype(jnp.int8),
    torch.uint8: np.dtype(jnp.uint8),
    torch.uint16: np.dtype(jnp.uint16),
    torch.uint32: np.dtype(jnp.uint32),
    torch.uint64: np.dtype(jnp.uint64),
    torch.bool: np.dtype(jnp.bool_),
    torch.complex64: np.dtype(jnp.complex64),
    torch.complex128: np.dtype(jnp.complex128),
}
JAX_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in TORCH_TO_JAX.items()}
# complex32 has no XLA type: a tpu complex32 tensor holds complex64 values, each part rounded to
# float16 whenever an op or a copy makes it (round_complex32), so it holds exactly the values a
# CPU complex32 tensor would; host copies convert through CPU's complex32.
TORCH_TO_JAX[torch.complex32] = np.dtype(jnp.complex64)


# c10's names of the scalar types, which CPU's error messages use ("expected scalar type Long")
SCALAR_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
    torch.complex32: "ComplexHalf",
}


def round_complex32(x):
    """Inside a program: complex64 values as a complex32 holds them (each part rounded to float16)."""
    from jax import lax

    return lax.complex(jnp.real(x).astype(jnp.float16).astype(jnp.float32),
                       jnp.imag(x).astype(jnp.float16).astype(jnp.float32))


def to_jax(dtype: torch.dtype) -> np.dtype:
    """The jax dtype for a torch dtype, or a TypeError that names the dtype."""
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"tpu: dtype {dtype} is not supported on the tpu device") from None


def to_torch(dtype) -> torch.dtype:
    """The torch dtype for a jax/numpy dtype."""
    return JAX_TO_TORCH[np.dtype(dtype)]


def cpu_to_numpy(t: torch.Tensor) -> np.ndarray:
    """A contiguous numpy array with the exact bits of a CPU tensor (bfloat16 included)."""
    t = t.detach().contiguous()
    if t.dtype not in TORCH_TO_JAX:
        to_jax(t.dtype)  # the dtype named, where numpy says "Got unsupported ScalarType ComplexHalf"
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.complex32:  # numpy has no complex32: its values, exactly, as complex64
        return t.to(torch.complex64).resolve_conj().numpy()
    return t.resolve_conj().resolve_neg().numpy()


def numpy_to_cpu(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor with the bits of a numpy array (bfloat16 included)."""
    a = np.asarray(a, order="C")  # np.ascontiguousarray would make a 0-d array 1-d
    if dtype == torch.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if dtype == torch.complex32:
        return torch.from_numpy(a.astype(np.complex64)).to(torch.complex32)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a)
