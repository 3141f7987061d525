"""``torch.isclose`` as one program.

torch's ``isclose`` is a CompositeImplicitAutograd function: served op by op it dispatches about a
dozen pointwise ops (``eq``, ``isnan``, ``mul``, ``abs``, ``add``, ``sub``, ``le``, ``isfinite``,
logical ands and ors), and on this backend each one compiles a program for every new shape. Every
``assertEqual``/``assert_close`` of tpu tensors goes through it, so a test comparing results of a
few dozen shapes spent most of its time compiling those twelve programs per shape (a second per
shape on the 2-core machine). Here it is one program per signature.

Its result is boolean and carries no gradient, so a backend kernel hides no autograd formula (the
reason composites are otherwise left to torch). Values follow CPU's kernel step by step, each
intermediate rounded to the operands' dtype as CPU's separate ops round it (float16 and bfloat16
included); integer and boolean operands are subtracted in torch's default float dtype as CPU does
(no wrap-around), a variant per default dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import Lowering, aten, kernel_from_lowerings, lower

_DEFAULTS = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def _isclose(self, other, rtol=1e-05, atol=1e-08, equal_nan=False, default=torch.float32):
    inexact = jnp.issubdtype(self.dtype, jnp.inexact)
    close = self == other
    if equal_nan and inexact:
        close = close | (jnp.isnan(self) & jnp.isnan(other))
    if not inexact and rtol == 0 and atol == 0:
        return close  # exact types with no tolerance: equality alone, as CPU
    if not inexact:  # CPU subtracts integers and booleans in the default float dtype (no wrap-around)
        fdt = _dtypes.to_jax(default)
        self, other = self.astype(fdt), other.astype(fdt)
    dt = self.dtype
    real = jnp.abs(jnp.zeros((), dt)).dtype  # complex64 -> float32
    # each step rounded to its dtype, as CPU's separate ops round it
    allowed = jnp.abs((other * jnp.asarray(rtol, dt)).astype(dt)).astype(real)
    allowed = (allowed + jnp.asarray(atol, real)).astype(real)
    actual = jnp.abs((self - other).astype(dt)).astype(real)
    return close | (jnp.isfinite(actual) & (actual <= allowed))


def _choose(*args, **kwargs) -> str:
    return str(torch.get_default_dtype())


def _build(adapt):
    return adapt(aten.isclose.default, Lowering(
        _isclose, static_scalars=True, variants={k: {"default": v} for k, v in _DEFAULTS.items()}, choose=_choose,
    ), "functional")


kernel_from_lowerings(aten.isclose.default, _build, "kernel (one program for torch's composite)")


@lower(aten.isclose.default, graph_only=True, static_scalars=True)
def _isclose_in_graphs(self, other, rtol=1e-05, atol=1e-08, equal_nan=False):
    """Graphs name the op whole where this backend has a kernel for it (Dynamo guards the default
    dtype, read when the graph is traced)."""
    return _isclose(self, other, rtol, atol, equal_nan, default=torch.get_default_dtype())
