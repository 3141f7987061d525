"""Meta tensors standing in for tpu ones.

Torch's meta kernels know every op's result shapes and dtypes, and raise CPU's errors for bad
arguments; the dispatcher runs them once per signature, and hand kernels run them directly. This
module holds the conversion and the call, and the error for a tensor on another device, so that the
ops modules need nothing of the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def device_mismatch(op_name: str, other: torch.device) -> RuntimeError:
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, tpu:0 and "
        f"{other}! (when checking argument for {op_name})"
    )



def to_meta(a: Any) -> Any:
    """``a`` with each tpu tensor (and 0-dim CPU one) replaced by a meta tensor of its shape, strides and
    dtype, and a tpu device by the meta device."""
    if isinstance(a, torch.Tensor) and (a.device.type == "tpu" or a.dim() == 0):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(to_meta(x) for x in a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return torch.device("meta")
    if isinstance(a, str) and a.startswith("tpu"):
        return "meta"
    return a


def meta_outputs(op: torch._ops.OpOverload, args: tuple, kwargs: dict,
                 meta: Callable | None = None) -> list[torch.Tensor | None]:
    """Runs torch's meta kernel (or ``meta``, standing in for it): raises CPU's errors, returns meta
    tensors of the results, None for an undefined one (a backward's ``output_mask``)."""
    # a generator changes no shape, and torch's reference meta kernels refuse one (exponential_)
    margs, mkwargs = to_meta(args), {k: None if k == "generator" else to_meta(v) for k, v in kwargs.items()}
    if torch.are_deterministic_algorithms_enabled():
        out = _without_cuda_alerts(meta or op, margs, mkwargs)
    else:
        out = (meta or op)(*margs, **mkwargs)
    if out is None:  # an in-place op on a list (_foreach_mul_): no result
        return []
    if isinstance(out, torch.Tensor):
        return [out]
    flat: list[torch.Tensor | None] = []
    for o in out:
        if o is None or isinstance(o, torch.Tensor):
            flat.append(o)
        else:
            flat.extend(o)
    return flat


def _without_cuda_alerts(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """``fn`` run with deterministic algorithms off: a meta kernel takes a meta tensor for a CUDA
    one and raises CUDA's nondeterminism alerts ("_histc_cuda with floating point input", "median
    CUDA with indices output") for kernels tpu does not have. The alerts that are tpu's, CPU's
    list (``put_`` without accumulation, ``max_unpool``), are raised by those ops' checks."""
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


def _cpu_stand_in(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.device.type == "meta":
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).zero_()
    if isinstance(a, (list, tuple)):
        return type(a)(_cpu_stand_in(x) for x in a)
    if isinstance(a, torch.device) and a.type == "meta":
        return torch.device("cpu")
    return a


def cpu_meta(packet: torch._ops.OpOverloadPacket) -> Callable:
    """A ``meta`` for ops whose meta kernel checks less than CPU's kernel (searchsorted: the
    boundaries' rank, ``side``, the sorter's dtype; the non-contiguous warning): the op itself on
    zero-filled CPU tensors of the arguments' shapes, strides and dtypes, once per signature. It
    raises (and warns) what CPU does for those; checks of values are not made here."""

    def meta(*args: Any, **kwargs: Any) -> Any:
        out = packet(*_cpu_stand_in(args), **{k: _cpu_stand_in(v) for k, v in kwargs.items()})
        if isinstance(out, torch.Tensor):
            return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        return type(out)(torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device="meta") for o in out)

    return meta


# ------------------------------------------------------------------------------------ views
def view_dispatch_key(op: torch._ops.OpOverload) -> torch._C.DispatchKey:
    """The key whose kernel computes a view's geometry without touching data."""
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
        return torch._C.DispatchKey.Meta
    return torch._C.DispatchKey.CompositeExplicitAutograd
