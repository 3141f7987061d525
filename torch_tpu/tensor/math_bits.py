"""The conjugate and negative bits (``z.conj()``, ``x._neg_view()``, ``z.conj().imag``) on tpu tensors.

Those views are torch's own: an alias of the storage with a bit set, so a write through one reaches
its base. PyTorch's Conjugate and Negative fallbacks hand most ops a resolved clone, but pass some
straight through to the backend's kernel, expecting it to read the bit itself: ``copy_`` and
``clone`` (served by ``torch_tpu.dispatch.hand_kernels.copy_`` and elementwise's ``clone``, which honour it), and
for the conjugate bit the matrix products (``mm``, ``addmm``, ``bmm``, ``dot``...), which CPU's BLAS
calls read conjugated. Our lowerings read storage values, so :func:`honouring` resolves such an
argument before the lowering runs, as the fallback would have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_DK = torch._C.DispatchKey

# Ops torch passes through that read no values, or honour the bits themselves.
_OWN_RULE = frozenset({
    "aten::copy_", "aten::clone", "aten::neg_", "aten::conj_physical_", "aten::empty_strided",
    "aten::empty_like", "aten::empty.memory_format", "aten::empty.out", "aten::full_like",
    "aten::_new_zeros_with_same_feature_meta", "aten::resize_", "aten::set_", "aten::as_strided_",
    "aten::_has_same_storage_numel", "aten::requires_grad_", "aten::detach_", "aten::resolve_conj",
    "aten::resolve_neg",
})


def _passed_through(op: torch._ops.OpOverload, key: Any) -> bool:
    name = op.name() + ("" if op._overloadname == "default" else "." + op._overloadname)
    try:
        return torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(name, key)
    except RuntimeError:  # the op has no entry for the key at all
        return False


def _bit_test(op: torch._ops.OpOverload) -> Callable[[torch.Tensor], bool] | None:
    """How to tell an argument whose bit ``op``'s kernel must resolve itself, or None where the
    fallback resolves every bit before our kernel runs."""
    name = op.name() + ("" if op._overloadname == "default" else "." + op._overloadname)
    if name in _OWN_RULE or op.name() in _OWN_RULE:
        return None
    returns = op._schema.returns
    if returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write:
        return None  # a view: it keeps the bit, as on CPU
    conj, neg = _passed_through(op, _DK.Conjugate), _passed_through(op, _DK.Negative)
    if conj and neg:
        return lambda t: t.is_conj() or t.is_neg()
    if conj:
        return torch.Tensor.is_conj
    if neg:
        return torch.Tensor.is_neg
    return None


def honouring(op: torch._ops.OpOverload, fn: Callable) -> Callable:
    """``fn``, the kernel of ``op``, made to see resolved values where torch passes a tensor with
    the conjugate or negative bit straight through to it; ``fn`` itself where it never does."""
    has_bit = _bit_test(op)
    if has_bit is None:
        return fn
    schema = op._schema.arguments
    positions = [i for i, a in enumerate(schema) if isinstance(a.type, torch.TensorType) and not a.kwarg_only]
    written = {a.name for a in schema if a.alias_info is not None and a.alias_info.is_write}
    names = [a.name for a in schema]

    def run(*args: Any, **kwargs: Any) -> Any:
        # a plain loop, not any() over a generator: this runs at every matrix product
        n = len(args)
        for i in positions:
            if i < n:
                a = args[i]
                if a is not None and has_bit(a):
                    return resolved(args, kwargs)
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, torch.Tensor) and has_bit(v):
                    return resolved(args, kwargs)
        return fn(*args, **kwargs)

    def resolved(args: tuple, kwargs: dict) -> Any:
        """``fn`` on clones of the bit-set arguments (written ones copied back under their bits)."""
        args, kwargs = list(args), dict(kwargs)
        mutated: list[tuple[torch.Tensor, torch.Tensor]] = []

        def resolve(name: str, t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, torch.Tensor) or not has_bit(t):
                return t
            clone = t.clone()  # clone honours the bits: the values, without them
            if name in written:
                mutated.append((t, clone))
            return clone

        for i in range(len(args)):
            args[i] = resolve(names[i], args[i])
        for k in kwargs:
            kwargs[k] = resolve(k, kwargs[k])
        result = fn(*args, **kwargs)
        for original, clone in mutated:  # written through a bit: copy_ writes the values back under it
            if tuple(original.shape) != tuple(clone.shape):
                original.resize_(clone.shape)
            original.copy_(clone)
            if result is clone:
                result = original
        return result

    run.counts_itself = getattr(fn, "counts_itself", False)
    return run
