"""``@torch_tpu.jax_op``: a function on jax arrays (``jax.numpy``, ``lax``, or a Pallas kernel)
becomes a PyTorch op on tpu tensors.

The op is registered like every ATen op: its lowering goes into the same table, so it runs in
strict, debug and fused eager mode, and stays one node in ``torch.compile`` graphs. Its gradient
comes from ``jax.vjp`` of the function, or from a ``vjp`` the user supplies; either way the
backward is an op too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.dispatch.op_kernel import lowering_kernel, register_kernel
from torch_tpu.ops._registry import LOWERINGS, Lowering

NAMESPACE = "torch_tpu_ops"
_lib = torch.library.Library(NAMESPACE, "DEF")


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _meta_kernel(fn: Callable) -> Callable:
    def meta(args: list, *rest: list) -> list:
        tensors = [*args, *(x for r in rest for x in r)]
        specs = [jax.ShapeDtypeStruct(tuple(t.shape), _dtypes.to_jax(t.dtype)) for t in tensors]
        outs = _as_list(jax.eval_shape(fn, *specs))
        return [torch.empty(tuple(o.shape), dtype=_dtypes.to_torch(o.dtype), device="meta") for o in outs]

    return meta


def _define(name: str, schema: str, lowering: Callable, shape_fn: Callable) -> torch._ops.OpOverload:
    _lib.define(f"{name}{schema}")
    op = getattr(getattr(torch.ops, NAMESPACE), name).default
    _lib.impl(name, shape_fn, "Meta")
    LOWERINGS[op] = Lowering(lowering)
    register_kernel(op, lowering_kernel(op, LOWERINGS[op]), "jax_op")
    return op


def jax_op(fn: Callable | None = None, *, name: str | None = None, vjp: Callable | None = None) -> Callable:
    """Turns ``fn(*arrays) -> array | tuple of arrays`` into a function on tpu tensors.

    ``vjp(*inputs, *cotangents) -> tuple of input gradients``, on jax arrays, replaces the
    automatic ``jax.vjp`` when given. Usable as ``@jax_op`` or ``@jax_op(name=..., vjp=...)``.
    """

    def make(f: Callable) -> Callable:
        opname = re.sub(r"\W", "_", name or f.__name__)

        def forward(args: list) -> list:
            return _as_list(f(*args))

        def backward(args: list, cotangents: list) -> list:
            if vjp is not None:
                return _as_list(vjp(*args, *cotangents))
            out, pull = jax.vjp(f, *args)
            ct = tuple(cotangents) if isinstance(out, (tuple, list)) else cotangents[0]
            return list(pull(ct))

        op = _define(opname, "(Tensor[] args) -> Tensor[]", forward, _meta_kernel(f))

        def vjp_shapes(args: list, cotangents: list) -> list:
            return [torch.empty(tuple(a.shape), dtype=a.dtype, device="meta") for a in args]

        vop = _define(f"{opname}_vjp", "(Tensor[] args, Tensor[] cotangents) -> Tensor[]", backward, vjp_shapes)

        def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
            ctx.save_for_backward(*inputs[0])

        def autograd_backward(ctx: Any, grads: list) -> tuple:
            args = list(ctx.saved_tensors)
            outs_meta = op(*[[torch.empty_like(a, device="meta") for a in args]])
            cts = [torch.zeros(m.shape, dtype=m.dtype, device=args[0].device) if g is None else g
                   for g, m in zip(grads, outs_meta)]
            return (vop(args, cts),)

        torch.library.register_autograd(f"{NAMESPACE}::{opname}", autograd_backward, setup_context=setup_context)

        def call(*tensors: torch.Tensor, **kwargs: Any) -> Any:
            extra = list(kwargs) + [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
            if extra:
                raise TypeError(
                    f"{opname}: a jax_op takes tensors only (got {', '.join(extra)}); bind numbers and options "
                    "before decorating, with functools.partial or a closure"
                )
            outs = op(list(tensors))
            return outs[0] if len(outs) == 1 else tuple(outs)

        call.__name__ = f.__name__
        call.__doc__ = f.__doc__
        call.op = op
        return call

    return make(fn) if fn is not None else make
