"""``torch.matmul`` of batched operands as one op: one ``dot_general`` with batch dimensions.

ATen's ``matmul`` is CompositeImplicitAutograd. For two operands of 3 or more dimensions it
expands their batch dimensions, reshapes each to 3-D (a copy when the operand is a transposed
view, as attention's ``q @ k.transpose(-2, -1)`` is), calls ``bmm`` and views the result back;
its backward is ``bmm``'s, through the same reshapes. On XLA each reshape of a transposed operand
is a copy, and XLA:TPU cannot fold a transpose into the dot once a reshape merges the batch
dimensions: gpt's replayed step moves ~30% more bytes than the same step written in JAX, whose
``einsum`` is one ``dot_general``.

So tpu serves ``aten::matmul`` and ``aten::linear`` at their Autograd key: real floating
operands of 3 or more dimensions (a 2-D right operand, a weight, allowed) become
``torch_tpu_ops::batched_matmul``, whose lowering is ``jnp.matmul`` (batch dimensions broadcast)
and whose backward is the same op on the gradient and the other operand's transposed view, summed
to the operand's shape where it was broadcast. A 2-D operand's gradient is
``torch_tpu_ops::batched_matmul_summed``, one ``dot_general`` contracting every batch dimension
(no reshape to 2-D); a linear's bias is added to the product. ``torch.compile``'s fake and
functional tensors take the same op, so its graphs hold it too. Every other call (fewer
dimensions, integer, complex or mixed dtypes, operands that do not match, which raise CPU's
errors, other tensor subclasses, forward-mode AD, functorch transforms, a user's dispatch mode)
runs ATen's composite kernel, as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from torch_tpu.dispatch.op_kernel import lowering_kernel, register_kernel
from torch_tpu.ops._registry import LOWERINGS
from torch_tpu.ops.linalg import _dot, matmul_lowering, mm

NAMESPACE = "torch_tpu_ops"
_lib = torch.library.Library(NAMESPACE, "FRAGMENT")  # the namespace custom.py's jax ops are defined in
_lib.define("batched_matmul(Tensor self, Tensor other) -> Tensor")
_lib.define("batched_matmul_summed(Tensor self, Tensor other) -> Tensor")
batched_matmul = getattr(torch.ops, NAMESPACE).batched_matmul.default
batched_matmul_summed = getattr(torch.ops, NAMESPACE).batched_matmul_summed.default

_FLOATING = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})
# plain tensors, and the fake and functional tensors torch.compile traces with (so its graphs hold
# the op too); other subclasses keep ATen's composite, which they may override piece by piece
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, FakeTensor, FunctionalTensor})
_TRACING = frozenset({FakeTensorMode, FunctionalTensorMode, ProxyTorchDispatchMode})  # torch.compile's own
_mode_stack = _get_current_dispatch_mode_stack
_composite = torch.ops.aten.matmul.default.decompose
_linear_composite = torch.ops.aten.linear.default.decompose
_forward_ad = torch.autograd.forward_ad
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def _batch_shape(a: tuple, b: tuple) -> tuple | None:
    """The broadcast of two batch shapes, or None where they do not broadcast (a plain loop:
    ``torch.broadcast_shapes`` costs tens of microseconds, and this runs at every product)."""
    if a == b:
        return a
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(out)


def _meta(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    batch = _batch_shape(tuple(self.shape[:-2]), tuple(other.shape[:-2]))
    return self.new_empty((*batch, self.shape[-2], other.shape[-1]))


def _meta_summed(self: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return self.new_empty((self.shape[-1], other.shape[-1]))


def _summed(self, other, precision):
    """``self^T @ other`` summed over the batch dimensions: a 2-D weight's gradient, one
    ``dot_general`` contracting every leading dimension (no reshape to 2-D)."""
    return _dot(self, other, precision, "...nk,...np->kp")


class _Product(torch.autograd.Function):
    """``a @ b`` as ``batched_matmul``, differentiable to any order: the backward is products too.
    (A Function of our own, not ``torch.library.register_autograd``, whose Python layers cost
    about as much as the op's whole dispatch.)"""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # ctx in forward, not a setup_context: Function.apply then skips binding the arguments to
        # the signature (inspect's), another ~50 us a call
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, b if ctx.needs_input_grad[0] else None)
        ctx.shapes = (a.shape, b.shape)
        return batched_matmul(a, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, b = ctx.saved_tensors
        a_shape, b_shape = ctx.shapes
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _Product.apply(grad, b.transpose(-2, -1))
            if ga.shape != a_shape:
                ga = ga.sum_to_size(a_shape)
        if ctx.needs_input_grad[1]:
            if len(b_shape) == 2:
                gb = _Summed.apply(a, grad)
            else:
                gb = _Product.apply(a.transpose(-2, -1), grad)
                if gb.shape != b_shape:
                    gb = gb.sum_to_size(b_shape)
        return ga, gb


class _Summed(torch.autograd.Function):
    """``a^T @ g`` summed over the batch dimensions (a 2-D operand's gradient), differentiable."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, g)
        return batched_matmul_summed(a, g)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        a, g = ctx.saved_tensors
        ga = _Product.apply(g, grad.transpose(-2, -1)) if ctx.needs_input_grad[0] else None
        gg = _Product.apply(a, grad) if ctx.needs_input_grad[1] else None
        return ga, gg


def _batched(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` is served as one op (see the module docstring); else ATen's composite."""
    if type(a) not in _PLAIN or type(b) not in _PLAIN or a.dim() < 3 or b.dim() < 2:
        return False
    if a.dtype is not b.dtype or a.dtype not in _FLOATING or a.device != b.device:
        return False
    if a.layout is not torch.strided or b.layout is not torch.strided or a.shape[-1] != b.shape[-2]:
        return False
    if _forward_ad._current_level >= 0:
        return False
    if torch._C._len_torch_dispatch_stack() and not all(type(m) in _TRACING for m in _mode_stack()):
        return False  # a user's dispatch mode (a flop counter, a logger) sees ATen's ops
    if _wrapped(a) or _wrapped(b):
        return False
    # operands that do not broadcast: ATen's composite says so, in CPU's words
    return _batch_shape(a.shape[:-2], b.shape[:-2]) is not None


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if _batched(a, b):
        return _Product.apply(a, b)
    return _composite(a, b)


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    plain_bias = bias is None or (type(bias) in _PLAIN and bias.dtype is x.dtype and bias.dim() == 1
                                  and bias.shape[0] == w.shape[0])
    if x.dim() >= 3 and w.dim() == 2 and plain_bias:  # a 2-D input: ATen's addmm, no transposed view made
        wt = w.t()
        if _batched(x, wt):
            out = _Product.apply(x, wt)
            return out if bias is None else out + bias
    return _linear_composite(x, w, bias)


def install() -> None:
    """Registers the two ops (meta, lowering, kernel) and ``aten::matmul``'s and ``aten::linear``'s
    tpu Autograd kernels. Called once, after the serving table is registered."""
    _lib.impl("batched_matmul", _meta, "Meta")
    matmul_lowering(batched_matmul)(mm)  # mm and bmm's lowering: jnp.matmul broadcasts batch dimensions
    _lib.impl("batched_matmul_summed", _meta_summed, "Meta")
    matmul_lowering(batched_matmul_summed)(_summed)
    for op in (batched_matmul, batched_matmul_summed):
        register_kernel(op, lowering_kernel(op, LOWERINGS[op]), "lowering (functional)")
    aten_lib = torch.library.Library("aten", "IMPL")
    aten_lib.impl("matmul", _matmul, "AutogradPrivateUse1")
    aten_lib.impl("linear", _linear, "AutogradPrivateUse1")
    _lib._aten = aten_lib  # kept alive with the op's library
