"""CPU's refusals of writes whose memory overlaps a tensor the op reads.

On CPU a kernel writes its result element by element, so an output that shares memory with an
input would read values it has already overwritten. CPU therefore refuses (or, for a few fills,
warns about) such calls. We compute from the inputs as they were, so nothing would go wrong here,
but code that works on tpu must work on CPU, and tests of PyTorch's own expect the refusal. The
rules follow CPU's (``get_overlap_status``, ``has_internal_overlap``):

- a written tensor with internal overlap (a dimension of stride 0 and size > 1, an ``expand``);
- an input that partly overlaps the written tensor (elementwise ops, ``copy_``): the same memory
  with the same strides is fine (``x.add_(x)``);
- an input that overlaps the written tensor at all (the index and source of the indexed writes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

INTERNAL = ("unsupported operation: more than one element of the written-to tensor refers to a single memory "
            "location. Please clone() the tensor before performing the operation.")
INPUT = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a single "
         "memory location. Please clone() the tensor before performing the operation.")

alias_of = torch._C._is_alias_of  # same storage (C++ Tensor::is_alias_of)


def internal(t: torch.Tensor) -> bool:
    """CPU's ``has_internal_overlap(t) == Yes``: some dimension of stride 0 holds more than one element."""
    strides = t.stride()
    return 0 in strides and any(st == 0 and n > 1 for n, st in zip(t.shape, strides))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill a range of memory exactly once (any order)."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def status(out: torch.Tensor, inp: torch.Tensor) -> str:
    """CPU's ``get_overlap_status``: "full", "partial", "no" or "too hard" (not dense: CPU lets it be)."""
    if out is inp:
        return "full"
    if not alias_of(out, inp) or not out.numel() or not inp.numel():
        return "no"
    if not _dense(out) or not _dense(inp):
        return "too hard"
    a0, b0 = out.storage_offset() * out.element_size(), inp.storage_offset() * inp.element_size()
    a1, b1 = a0 + out.numel() * out.element_size(), b0 + inp.numel() * inp.element_size()
    if a0 == b0 and a1 == b1:
        return "full" if out.stride() == inp.stride() else "partial"
    return "partial" if a0 < b1 and b0 < a1 else "no"


def refuse_partial(out: torch.Tensor, inp: Any) -> None:
    """CPU's ``assert_no_partial_overlap``."""
    if isinstance(inp, torch.Tensor) and status(out, inp) == "partial":
        raise RuntimeError(INPUT)


def refuse_any(out: torch.Tensor, inp: Any) -> None:
    """CPU's ``assert_no_overlap``: the same memory, even exactly, is refused."""
    if isinstance(inp, torch.Tensor) and status(out, inp) in ("full", "partial"):
        raise RuntimeError(INPUT)


_EXPANDED_WARNING = ("Use of {}_ on expanded tensors is deprecated. Please clone() the tensor before performing "
                     "this operation. This also applies to advanced indexing e.g. tensor[{}] = {}")

# The indexed writes, by CPU's kernels: (what an expanded written tensor gets: "refuse" or a
# warning, the arguments that must not overlap it at all, those that must not overlap it partly)
_INDEXED: dict[str, tuple[str | None, tuple[str, ...], tuple[str, ...]]] = {
    "index_add": ("refuse", ("index", "source"), ()),
    "index_copy": ("refuse", ("index", "source"), ()),
    "index_reduce": ("refuse", ("index", "source"), ()),
    "index_fill": (_EXPANDED_WARNING.format("index_fill", "mask", "scalar"), ("index",), ()),
    "put": ("refuse", ("index", "source"), ()),
    "scatter": ("refuse", ("index", "src"), ()),
    "scatter_add": ("refuse", ("index", "src"), ()),
    "scatter_reduce": ("refuse", ("index", "src"), ()),
    "masked_fill": (_EXPANDED_WARNING.format("masked_fill", "mask", "scalar"), (), ("mask",)),
    "masked_scatter": ("refuse", (), ()),
    "index_put": (_EXPANDED_WARNING.format("index_put", "indices", "tensor"), ("values", "indices"), ()),
    "_index_put_impl": (_EXPANDED_WARNING.format("index_put", "indices", "tensor"), ("values", "indices"), ()),
}


# CPU computes these with its TensorIterator too, though torch does not tag them pointwise
_ALSO_ELEMENTWISE = frozenset((
    "__irshift", "__ilshift", "mish", "hardswish", "hardsigmoid", "hardtanh", "softplus", "softshrink",
    "hardshrink", "elu", "celu", "selu", "leaky_relu", "gelu", "silu",
))


def rule(op: torch._ops.OpOverload, kind: str) -> Callable[[tuple, dict], None] | tuple | None:
    """The overlap check of ``op``'s in-place (``kind`` "inplace") or out= form: a function called
    with the call's arguments before it runs (the indexed writes), the positions of the inputs
    :func:`refuse_partial_at` checks (elementwise ops), or None where CPU checks nothing beyond
    internal overlap (which the dispatcher checks once per signature)."""
    if kind == "functional":
        return None
    schema = op._schema
    base = schema.name.split("::")[1].rstrip("_")
    names = [a.name for a in schema.arguments]
    out_name = next((a.name for a in schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write),
                    None)

    def written(args: tuple, kwargs: dict) -> Any:
        return args[0] if kind == "inplace" else kwargs.get(out_name)

    def given(args: tuple, kwargs: dict, name: str) -> Any:
        i = names.index(name)
        return args[i] if i < len(args) else kwargs.get(name)

    indexed = _INDEXED.get(base)
    if indexed is not None:
        expanded, disjoint, not_partly = indexed
        disjoint = tuple(n for n in disjoint if n in names)
        not_partly = tuple(n for n in not_partly if n in names)

        def check_indexed(args: tuple, kwargs: dict) -> None:
            out = written(args, kwargs)
            if not isinstance(out, torch.Tensor):
                return
            if expanded is not None and internal(out):
                if expanded == "refuse":
                    raise RuntimeError(INTERNAL)
                warnings.warn(expanded, UserWarning, stacklevel=3)
            for n in disjoint:
                value = given(args, kwargs, n)
                for v in value if isinstance(value, (list, tuple)) else (value,):
                    refuse_any(out, v)
            for n in not_partly:
                refuse_partial(out, given(args, kwargs, n))

        return check_indexed
    if torch.Tag.pointwise not in op.tags and base not in _ALSO_ELEMENTWISE:
        return None
    return tuple(elementwise_inputs(op, kind)) or None


def elementwise_inputs(op: torch._ops.OpOverload, kind: str) -> list[int]:
    """The positions of the tensor inputs that must not partly overlap the written tensor of an
    elementwise op's in-place or out= form (CPU's TensorIterator checks them), or [] for any other
    op. The dispatcher checks them inline (:func:`refuse_partial_at`): in-place ops are hot."""
    base = op._schema.name.split("::")[1].rstrip("_")
    if kind == "functional" or base in _INDEXED or (torch.Tag.pointwise not in op.tags
                                                      and base not in _ALSO_ELEMENTWISE):
        return []
    return [i for i, a in enumerate(op._schema.arguments)
            if isinstance(a.type, torch.TensorType) and not a.kwarg_only and not (kind == "inplace" and i == 0)]


def refuse_partial_at(out: Any, args: tuple, at: tuple) -> None:
    """:func:`refuse_partial` of ``out`` against ``args[i]`` for each position ``i`` in ``at``."""
    if isinstance(out, torch.Tensor):
        for i in at:
            if i < len(args):
                inp = args[i]
                if isinstance(inp, torch.Tensor) and alias_of(out, inp):
                    refuse_partial(out, inp)
