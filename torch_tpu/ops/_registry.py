"""The lowering table: ATen overload -> a pure function of jax arrays.

Each lowering is written once, for the functional overload, and receives the ATen arguments as the
schema names them, with tensors replaced by jax arrays. The dispatcher derives the in-place and
``out=`` kernels from it, casts results to the dtype torch's own meta kernel computed, and checks
the shape. A lowering never knows which mode runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

aten = torch.ops.aten


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
    """

    fn: Callable
    static_scalars: bool = False
    random: bool = False
    check: Callable | None = None
    graph_only: bool = False


LOWERINGS: dict[torch._ops.OpOverload, Lowering] = {}


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
) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the lowering of ``targets``.

    A packet (``aten.add``) means all its functional overloads; an overload (``aten.add.Tensor``)
    means itself. An in-place overload may be named directly when it has no functional twin
    (``aten.uniform_``): its lowering returns the new value of ``self``.
    """

    def deco(fn: Callable) -> Callable:
        entry = Lowering(fn, static_scalars, random, check, graph_only)
        for target in targets:
            if target is None:  # an op this torch version lacks (torch_tpu._compat.aten_overload)
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
