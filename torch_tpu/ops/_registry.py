"""The serving table: ATen overload -> a lowering (a pure function of jax arrays), or a hand kernel.

Both tables are filled when the ops modules are imported; :func:`torch_tpu.dispatch.op_kernel.register_table`
then registers every entry with torch once, by one rule (a hand kernel serves eager mode where an op
has both; graphs always use the lowering), so import order decides nothing.

Each lowering is written once, for the functional overload, and receives the ATen arguments as the
schema names them, with tensors replaced by jax arrays. The dispatcher derives the in-place and
``out=`` kernels from it, casts results to the dtype torch's own meta kernel computed, and checks
the shape. A lowering never knows which mode runs it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import torch

aten = torch.ops.aten
# Arguments no lowering sees: where a result lives and how it is laid out are the backend's, and a
# random op's generator becomes its PRNG key.
IGNORED_KWARGS = frozenset(("layout", "device", "pin_memory", "generator", "memory_format"))


@dataclass(frozen=True)
class Lowering:
    """One table entry.

    ``static_scalars``: every Python number becomes a compile-time constant, for ops whose output
    shape depends on them (arange) or whose best lowering needs the value (integer powers, norm
    orders). Otherwise Python floats are runtime arguments, so a changing learning rate never
    recompiles; Python ints are always constants.
    ``random``: the function takes a jax PRNG key as its first argument.
    ``check``: called with the op's torch arguments before every run, for what a meta kernel
    cannot see (index values out of range); it raises the error CPU would raise.
    ``graph_only``: used by ``torch.compile`` graphs only (views and factories, which eager mode
    serves with torch's own view kernels and hand-written kernels).
    ``meta``: stands in for torch's meta kernel where the op has none (same arguments, returns meta
    tensors); eager mode runs it once per signature for the result shapes, dtypes and CPU's errors.
    ``own_shapes``: the results keep the shapes the lowering gives where torch's meta kernel
    disagrees with CPU (batch norm's saved statistics in eval mode: CPU ``(0,)``, meta ``(C,)``).
    """

    fn: Callable
    static_scalars: bool = False
    random: bool = False
    check: Callable | None = None
    graph_only: bool = False
    meta: Callable | None = None
    own_shapes: bool = False
    twins: bool = True  # the dispatcher derives in-place and out= kernels from it
    # Static keyword variants of ``fn``, one eager kernel (and its programs) each, picked per call
    # by ``choose`` from the torch arguments (matmul precision); ``fn`` itself is the first one.
    variants: dict | None = None
    choose: Callable | None = None
    # Arguments whose Python ints and bools are runtime arguments as well (a fill value: as a
    # constant, a flag that flips once, such as "this sequence is done", would compile a program
    # per value). Only for arguments no shape depends on.
    runtime_numbers: tuple[str, ...] = ()
    # XLA has no TPU kernel for it (eig): eager calls run on the host where the platform or the
    # TPU target is a TPU, counted as CPU fallbacks (``dispatch.fallback.host_on_tpu_kernel``). A
    # predicate of the call's (args, kwargs) limits it to some calls (FFTs of float64: XLA:TPU's
    # FFT takes 32-bit types only)
    host_on_tpu: bool | Callable[..., bool] = False

    def apply(self, key: Any, args: Sequence, kwargs: dict, outs: Sequence, name: str) -> list:
        """Calls the lowering: the one protocol of eager programs and of compiled graphs.

        ``key``: the PRNG key of a random op (else None). ``outs``: per result, what torch's meta
        kernel (eager) or trace (graphs) says it is: a (shape, jax dtype) pair (a shape of None, or
        with symbolic sizes, is not checked) or None for an undefined result (a backward's
        ``output_mask``). A lowering may return only the defined results. Each result is cast to
        its dtype and broadcast to its shape (which raises when the lowering got a shape wrong).
        Returns one entry per ``outs`` entry, None where undefined.
        """
        res = self.fn(key, *args, **kwargs) if self.random else self.fn(*args, **kwargs)
        res = list(res) if isinstance(res, (tuple, list)) else [res]
        if len(res) != len(outs):
            defined = [o for o in outs if o is not None]
            if len(res) != len(defined):
                raise RuntimeError(f"lowering of {name} returned {len(res)} outputs, expected {len(outs)}")
            it = iter(res)
            res = [None if o is None else next(it) for o in outs]
        done = []
        for r, o in zip(res, outs):
            if o is None or r is None:
                done.append(None)
                continue
            shape, jdt = o
            r = jnp.asarray(r)
            if r.dtype != jdt:
                r = r.astype(jdt)
            if shape is not None and not self.own_shapes and tuple(r.shape) != shape:
                r = jnp.broadcast_to(r, shape)
            done.append(r)
        return done


LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


@dataclass(frozen=True)
class HandKernel:
    """A kernel written against torch tensors, for an op that is not a pure array function (copies
    between devices, storage changes, host reads, masks turned into indices).

    ``fusable``: the kernel only passes arrays through the executor (copies, allocation), so fused
    mode may record it; otherwise it runs as in strict mode inside a fused trace (it may read the
    host). ``build``: the kernel is made at registration from the lowering adapter
    (``build(lowering_kernel)``), for kernels that route to lowerings (boolean masks). ``how``: what
    the serving report calls it.
    """

    fn: Callable | None
    fusable: bool = False
    how: str = "kernel"
    build: Callable[[Callable], Callable] | None = None


HAND_KERNELS: dict[torch._ops.OpOverload, HandKernel] = {}


def _add_kernel(op: torch._ops.OpOverload | None, entry: HandKernel) -> None:
    if op is None:  # an op this torch version lacks (torch_tpu.core.compat.aten_overload)
        return
    if op in HAND_KERNELS:
        raise ValueError(f"kernel: {op} has two hand kernels")
    HAND_KERNELS[op] = entry


def kernel(*ops: torch._ops.OpOverload | None, fusable: bool = False,
           how: str = "kernel") -> Callable[[Callable], Callable]:
    """Enters the decorated function as the hand kernel of ``ops`` (see :class:`HandKernel`)."""

    def deco(fn: Callable) -> Callable:
        for op in ops:
            _add_kernel(op, HandKernel(fn, fusable, how))
        return fn

    return deco


def kernel_from_lowerings(op: torch._ops.OpOverload, build: Callable[[Callable], Callable], how: str) -> None:
    """Enters a hand kernel made at registration by ``build(lowering_kernel)``, where
    ``lowering_kernel(op, Lowering(...), kind)`` is the adapter that serves a lowering eagerly."""
    _add_kernel(op, HandKernel(None, True, how, build))


def _returns_tensor(op: torch._ops.OpOverload) -> bool:
    return any("Tensor" in str(r.type) for r in op._schema.returns)


def is_mutating(op: torch._ops.OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


def dispatcher_overloads(packet: torch._ops.OpOverloadPacket) -> list[torch._ops.OpOverload]:
    """The overloads of ``packet`` that the dispatcher knows (not TorchScript-only ones)."""
    found = []
    for name in packet.overloads():
        op = getattr(packet, name)
        try:
            torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        except RuntimeError:
            continue
        if _returns_tensor(op):
            found.append(op)
    return found


def lower(
    *targets,
    static_scalars: bool = False,
    random: bool = False,
    check: Callable | None = None,
    graph_only: bool = False,
    meta: Callable | None = None,
    own_shapes: bool = False,
    by_name: bool = False,
    variants: dict | None = None,
    choose: Callable | None = None,
    runtime_numbers: tuple[str, ...] = (),
    host_on_tpu: bool | Callable[..., bool] = False,
) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the lowering of ``targets``.

    A packet (``aten.add``) means all its functional overloads; an overload (``aten.add.Tensor``)
    means itself. An in-place overload may be named directly when it has no functional twin
    (``aten.uniform_``): its lowering returns the new value of ``self``. ``by_name``: ``fn`` takes
    every argument by its schema name (for functions whose optional arguments come last), so it
    serves one overload only. ``variants`` and ``choose``: see :class:`Lowering`.
    """

    def deco(fn: Callable) -> Callable:
        call = _by_name(targets[0], fn) if by_name else fn
        if variants:
            call = functools.partial(call, **next(iter(variants.values())))
        entry = Lowering(call, static_scalars, random, check, graph_only, meta, own_shapes, not by_name, variants,
                         choose, runtime_numbers, host_on_tpu)
        for target in targets:
            if target is None:  # an op this torch version lacks (torch_tpu.core.compat.aten_overload)
                continue
            if isinstance(target, torch._ops.OpOverloadPacket):
                mutating = target._qualified_op_name.endswith("_")
                ops = [o for o in dispatcher_overloads(target) if mutating or not is_mutating(o)]
                if not ops:
                    raise ValueError(f"lower: {target} has no dispatcher overloads")
            else:
                ops = [target]
            for op in ops:
                if graph_only and op in LOWERINGS:
                    continue  # eager already lowers it; graphs use that
                if op in LOWERINGS and LOWERINGS[op].graph_only:
                    pass  # an eager lowering supersedes a graph-only one
                elif op in LOWERINGS:
                    raise ValueError(f"lower: {op} is lowered twice")
                LOWERINGS[op] = entry
        return fn

    return deco


def _by_name(op: torch._ops.OpOverload, fn: Callable) -> Callable:
    """``fn`` called with the schema's argument names (runs when a program is traced, not per call)."""
    if not isinstance(op, torch._ops.OpOverload):
        raise ValueError(f"lower(by_name=True): {op} must be one overload")
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(**dict(zip(names, args)), **kwargs)

    call.__name__ = getattr(fn, "__name__", "lowering")
    return call
