"""Pointwise ops: arithmetic, comparisons, unary math and activations.

Results are cast by the dispatcher to the dtype torch's type promotion chose, so a lowering may
compute in a wider type.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torch_tpu.ops._registry import aten, lower


def _scaled(b, alpha):
    return b if alpha is None else b * alpha


@lower(aten.add.Tensor, aten.add.Scalar)
def add(self, other, alpha=None):
    return jnp.add(self, _scaled(other, alpha))


@lower(aten.sub.Tensor, aten.sub.Scalar)
def sub(self, other, alpha=None):
    return jnp.subtract(self, _scaled(other, alpha))


@lower(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self, other, alpha=None):
    return jnp.subtract(other, _scaled(self, alpha))


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    return jnp.multiply(self, other)


@lower(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def div(self, other, rounding_mode=None):
    if rounding_mode is None:
        return jnp.true_divide(self, other)
    if rounding_mode == "floor":
        return jnp.floor_divide(self, other)
    a, b = jnp.broadcast_arrays(jnp.asarray(self), jnp.asarray(other))
    dt = jnp.result_type(self, other)
    if jnp.issubdtype(dt, jnp.integer):
        return lax.div(a.astype(dt), b.astype(dt))  # C division truncates, as torch's 'trunc'
    return jnp.trunc(jnp.true_divide(a, b))


@lower(aten.neg)
def neg(self):
    return jnp.negative(self)


@lower(aten.exp)
def exp(self):
    return jnp.exp(self)


@lower(aten.sqrt)
def sqrt(self):
    return jnp.sqrt(self)


@lower(aten.relu)
def relu(self):
    return jax.nn.relu(self)
