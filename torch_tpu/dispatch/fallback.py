"""What happens to an ATen op with no lowering: decompose, else run on CPU, never silently.

1. A view op runs its meta kernel (it only computes sizes and strides).
2. An op with a ``torch._decomp`` decomposition runs it; its pieces come back through the
   dispatcher to the lowering table. A per-thread guard stops cycles (arange -> iota -> arange).
3. Otherwise the op runs on CPU: inputs copied to the host, outputs and mutated inputs copied back.
   Each op warns once and is counted in ``torch_tpu.metrics()``. ``TORCH_TPU_STRICT=1`` turns this
   into a ``NotImplementedError`` naming the op.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torch_tpu.core import rng as _rng
from torch_tpu.core.devices import platform
from torch_tpu.ops._registry import LOWERINGS
from torch_tpu.runtime import executor, metrics
from torch_tpu.runtime import target as _target
from torch_tpu.runtime.errors import raise_named
from torch_tpu.tensor import out_dtypes as _out_dtypes
from torch_tpu.tensor import overlap as _overlap
from torch_tpu.tensor import storage as _storage
from torch_tpu.tensor.meta import device_mismatch, view_dispatch_key
from torch_tpu.tensor.storage import is_tpu, new_tensor, set_base, to_cpu, write
from torch_tpu.tensor.transfer import host_to_device

_guard = threading.local()
_warned: set[str] = set()


def strict() -> bool:
    return os.environ.get("TORCH_TPU_STRICT", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def _decompositions() -> dict:
    from torch._decomp import core_aten_decompositions, decomposition_table

    table = dict(decomposition_table)
    table.update(core_aten_decompositions())
    return table


def _to_cpu_arg(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.is_nested:  # torch's own copy of the buffer (csrc/nested.cpp)
        return a.to("cpu") if a.device.type == "tpu" else a
    if is_tpu(a):
        return to_cpu(a).clone()
    if isinstance(a, torch.device) and a.type == "tpu":
        return torch.device("cpu")
    if isinstance(a, torch.Generator) and a.device.type == "tpu":  # CPU's kernel takes a CPU generator

        return _rng.cpu_generator_from(a)
    return a


def _from_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type == "cpu":
        if x.is_nested:  # its buffer moves; the metadata stays on CPU, as torch keeps it (csrc/nested.cpp)
            x = x.contiguous()
            return torch._nested_view_from_buffer(_from_cpu(x.values()), x._nested_tensor_size(),
                                                  x._nested_tensor_strides(), x._nested_tensor_storage_offsets())
        if x._is_zerotensor():  # autograd's efficient zeros have no data to copy
            x = torch.zeros(x.shape, dtype=x.dtype)
        return new_tensor(tuple(x.shape), x.dtype, host_to_device(x))
    if isinstance(x, (list, tuple)):
        return type(x)(_from_cpu(y) for y in x)
    return x


def cpu_fallback(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Runs ``op`` on CPU copies of its inputs and brings the results back."""
    name = str(op)
    if strict():
        raise NotImplementedError(f"tpu: {name} has no lowering, and TORCH_TPU_STRICT=1 forbids the CPU fallback")
    metrics.fallback_counts[name] += 1
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"tpu: {name} has no lowering; it runs on CPU (counted in torch_tpu.metrics())", stacklevel=3)
    return run_on_cpu(op, args, kwargs)


def run_on_cpu(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``op`` by CPU torch on CPU copies of its tpu inputs: results uploaded, arguments written in
    place written back. The CPU fallback's work, and ``TORCH_TPU_RANDOM=cpu``'s (``rng``)."""
    flat, spec = tree_flatten((args, kwargs))
    cargs, ckwargs = tree_unflatten([_to_cpu_arg(a) for a in flat], spec)
    if "device" in ckwargs and ckwargs["device"] is not None and torch.device(ckwargs["device"]).type == "tpu":
        ckwargs["device"] = torch.device("cpu")
    out = op(*cargs, **ckwargs)
    schema = op._schema
    mutated = {}  # alias set -> the tpu tensor written in place
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        src = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        res = cargs[i] if i < len(cargs) and not a.kwarg_only else ckwargs.get(a.name)
        if isinstance(src, (list, tuple)):  # a Tensor[] written in place (the _foreach_*_ ops)
            for s, r in zip(src, res):
                _write_back(s, r)
        elif _write_back(src, res):
            mutated[frozenset(a.alias_info.before_set)] = src
    if not schema.returns:  # "-> ()": in-place on a list, nothing returned
        return None
    # each aliased result is the argument of its alias set: rrelu_with_noise_ writes ``self`` and
    # ``noise`` but returns ``self`` alone
    aliased = [None if r.alias_info is None else mutated.get(frozenset(r.alias_info.before_set))
               for r in schema.returns]
    if all(t is not None for t in aliased):
        return aliased[0] if len(aliased) == 1 else tuple(aliased)
    return _from_cpu(out)


def _write_back(src: Any, res: Any) -> bool:
    """Writes the CPU result ``res`` of an in-place argument into its tpu tensor ``src``."""
    if isinstance(src, torch.Tensor) and src.is_nested and src.device.type == "tpu":
        src.copy_(res)  # the same components (an in-place op keeps them); torch's nested copy_
        return True
    if not is_tpu(src):
        return False

    if tuple(res.shape) != tuple(src.shape):
        set_base(src, tuple(res.shape), src.dtype, None)
    write(src, host_to_device(res))
    return True


def _check_devices(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """CPU tensors other than 0-dim scalars cannot mix with tpu tensors, as on CUDA."""
    if op.__name__.startswith("_nested_"):  # their CPU tensors are a nested tensor's sizes, kept on CPU by torch
        return
    for a in tree_flatten((args, kwargs))[0]:
        if isinstance(a, torch.Tensor) and a.device.type != "tpu" and a.dim() > 0:
            raise device_mismatch(str(op), a.device)


@functools.cache
def _overlap_rule(op: torch._ops.OpOverload) -> Any:
    """The overlap check of an in-place or out= op (``torch_tpu.tensor.overlap``), or None."""
    schema = op._schema
    if not schema.is_mutable:
        return None
    if any(a.kwarg_only and a.alias_info and a.alias_info.is_write for a in schema.arguments):
        return _overlap.rule(op, "out")
    first = schema.arguments[0] if schema.arguments else None
    if first is not None and first.alias_info is not None and first.alias_info.is_write:
        return _overlap.rule(op, "inplace")
    return None


def _overlap_partial(op: torch._ops.OpOverload, args: tuple, kwargs: dict, at: tuple) -> None:
    schema = op._schema
    out_name = next((a.name for a in schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write),
                    None)
    out = kwargs.get(out_name) if out_name is not None else args[0]
    try:
        _overlap.refuse_partial_at(out, args, at)
    except RuntimeError as e:
        raise RuntimeError(f"{op}: {e}") from None


def fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    """The catch-all PrivateUse1 kernel for every op without a registered one."""
    _check_devices(op, args, kwargs)
    if op.is_view:
        metrics.op_counts[str(op)] += 1

        return op._op_dk(view_dispatch_key(op), *args, **kwargs)
    overlap = _overlap_rule(op)
    if overlap is not None:  # CPU's refusal of an in-place write over its own input comes first
        if callable(overlap):
            overlap(args, kwargs)
        else:
            _overlap_partial(op, args, kwargs, overlap)
    decomp = _decompositions().get(op)
    active = getattr(_guard, "active", None)
    if active is None:
        active = _guard.active = set()
    if decomp is not None and op not in active:
        refusal = _out_dtypes.integral_refusal_by_dtypes(op, args, kwargs)  # CPU has no kernel for the dtype
        if refusal is not None:
            shapes = ", ".join(f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
                               for a in args if isinstance(a, torch.Tensor))
            raise_named(refusal, f"{op}({shapes})")
        lowering = LOWERINGS.get(op)  # a graph lowering's check: CPU's errors before the decomposition's own
        if lowering is not None and lowering.check is not None:
            lowering.check(*args, **kwargs)
        metrics.decomposition_counts[str(op)] += 1
        active.add(op)
        try:
            out = decomp(*args, **kwargs)
        finally:
            active.discard(op)
        if out is not NotImplemented:
            return out
    return cpu_fallback(op, args, kwargs)


def register() -> None:
    global _lib
    _lib = torch.library.Library("_", "IMPL")
    _lib.fallback(fallback, "PrivateUse1")


def host_on_tpu_kernel(op: torch._ops.OpOverload, device_kernel: Callable,
                       when: Callable[..., bool] | None = None) -> Callable:
    """The kernel of an op XLA cannot compile for a TPU (``Lowering.host_on_tpu``: eig): on a TPU,
    or with a TPU target set (``runtime.target``), each call (each one ``when(*args, **kwargs)``
    accepts, if given: an FFT of float64) runs on the host as a CPU fallback (counted, warned once,
    named in the target's report); elsewhere the device kernel runs."""
    name = str(op)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not (_target.active() or platform() == "tpu") or (when is not None and not when(*args, **kwargs)):
            return device_kernel(*args, **kwargs)
        _target.note_host_op(name)
        metrics.op_counts[name] += 1
        metrics.fallback_counts[name] += 1
        metrics.no_tpu_kernel_counts[name] += 1
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"tpu: {name} has no TPU kernel in XLA; it runs on the host (counted in "
                          "torch_tpu.metrics())", stacklevel=2)
        with executor.eager_section():
            return run_on_cpu(op, args, kwargs)

    run.counts_itself = True
    return run


def cpu_stream_kernel(op: torch._ops.OpOverload, device_kernel: Callable) -> Callable:
    """The kernel of random op ``op`` under ``TORCH_TPU_RANDOM=cpu``: CPU torch's kernel on CPU copies
    of the inputs, drawing from CPU's default generator (a tpu generator's op draws from a CPU
    generator seeded from it), its results uploaded. So after ``torch.manual_seed(s)`` a script
    draws on tpu the very numbers it draws on CPU (dropout masks, initialisations, sampled
    tokens), and the two runs can be compared number for number when porting. Each draw is a
    host op and a transfer, and a sync where it reads device values (``bernoulli`` of a computed
    probability): for comparing, not for speed. Graphs keep the device's stream: a graph capture
    records the device kernel, and ``torch.compile`` graphs lower their random ops as always."""
    name = str(op)

    def run(*args: Any, **kwargs: Any) -> Any:
        if _storage._capture is not None:
            return device_kernel(*args, **kwargs)
        metrics.op_counts[name] += 1
        # poisson's generator is positional
        args = tuple(_rng.shadow_generator(a) if type(a) is torch.Generator else a for a in args)
        if type(kwargs.get("generator")) is torch.Generator:
            kwargs = {**kwargs, "generator": _rng.shadow_generator(kwargs["generator"])}
        with executor.eager_section():
            return run_on_cpu(op, args, kwargs)

    run.counts_itself = True
    return run
