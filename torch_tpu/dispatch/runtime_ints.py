"""Python ints that change at every call of an op line become runtime arguments of its programs.

torch hands an ATen kernel a Python number as itself (``x * step``, ``x + position``,
``t.clamp(max=n)``), and the dispatcher keeps ints in the signature as compile-time constants:
a lowering may branch on an int (a dim, a size, a count), and most programs meet the same few
values. A loop whose int changes at every step (a counter, a position, ``random.randint``) would
then compile one program per value, a compile of tenths of a second for an op of microseconds.

So when one op line misses its kernel's cache with the ``TORCH_TPU_INT_CHURN``-th (default 3)
distinct set of Python ints in *value* arguments (schema type ``Tensor`` or ``Scalar``, the
places torch puts a wrapped number; never ``int``, ``int[]`` or ``SymInt``, which are dims and
sizes), everything else about the call equal, the kernel takes ints and bools in those arguments
as runtime inputs from then on, at every line, as it takes floats: one program per shape and
dtype, whatever the values. The values keep their meaning: jax passes a Python number as a weakly
typed scalar, which torch's type promotion (``ops/elementwise.result_dtype``) counts as the
wrapped number it is. A lowering that cannot take a traced number (it branches on the value) is
found by tracing the first such program abstractly, at the op; that kernel keeps its ints static.
``TORCH_TPU_INT_CHURN=0`` keeps every int static.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from torch_tpu.runtime import fused

CHURN_AFTER = int(os.environ.get("TORCH_TPU_INT_CHURN", "3"))
_MAX_PATTERNS = 512  # per kernel: a bound on what watching costs, whatever a program does

# a kernel's state: None (no value arguments, or they already take numbers), "watch", "runtime", "refused"
WATCH, RUNTIME, REFUSED = "watch", "runtime", "refused"


def _holds_a_value(t: Any) -> bool:
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, (torch.TensorType, torch.NumberType))


def value_arguments(schema: Any) -> tuple[list[int], set[str]]:
    """The positions and keyword names of ``schema``'s arguments that may hold a Python number as a
    value (``Tensor``, ``Scalar``, optional or not)."""
    positional = [a for a in schema.arguments if not a.kwarg_only]
    at = [i for i, a in enumerate(positional) if _holds_a_value(a.type)]
    kw = {a.name for a in schema.arguments if a.kwarg_only and _holds_a_value(a.type)}
    return at, kw


def _ints(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """The Python ints and bools of a call in its kernel's value arguments, in order."""
    found = [(i, args[i]) for i in kernel.value_at if i < len(args) and type(args[i]) in (int, bool)]
    if kwargs:
        found.extend((k, v) for k, v in kwargs.items() if k in kernel.value_kw and type(v) in (int, bool))
    return tuple(found)


def churns(kernel: Any, key: tuple, args: tuple, kwargs: dict) -> bool:
    """Whether this cache miss of ``kernel`` (signature ``key``) is the one that makes its value
    ints runtime inputs: the ``CHURN_AFTER``-th distinct set of them at this line, with the rest
    of the signature as before."""
    if CHURN_AFTER <= 0:
        return False
    ints = _ints(kernel, args, kwargs)
    if not ints:
        return False
    where = {i for i, _ in ints}
    pos = tuple(None if i in where else s for i, s in enumerate(key[0]))
    rest = tuple((k, None if k in where else s) for k, s in key[1]) if len(key) > 1 else ()
    pattern = (fused.user_site(), pos, rest, key[2:])
    seen = kernel.int_values.get(pattern)
    if seen is None:
        if len(kernel.int_values) >= _MAX_PATTERNS:
            kernel.int_values.clear()
        seen = kernel.int_values[pattern] = set()
    seen.add(tuple(v for _, v in ints))
    return len(seen) >= CHURN_AFTER
