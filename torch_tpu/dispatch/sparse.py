"""Sparse COO tensors on the tpu device.

Why: PyTorch sends every op that touches a sparse COO tensor to the ``SparsePrivateUse1`` dispatch
key, which has no kernels unless a backend registers them. Without this module even building one
failed ("Could not run 'aten::_sparse_coo_tensor_with_dims_and_tensors' ... 'Sparsetpu' backend"),
so ``nn.Embedding(sparse=True)`` could not run its backward and ``torch.optim.SparseAdam`` could not
step on tpu.

How: a sparse tpu tensor is torch's own ``SparseTensorImpl`` holding two dense tpu tensors, the
``indices`` (``sparse_dim x nnz``, int64) and the ``values`` (``nnz x *dense_size``).

- Building one and reading its fields (``_indices``, ``_nnz``, ``is_coalesced``, resizing, ``zero_``)
  needs no arithmetic: torch's generic C++ kernels, registered for ``SparseMeta``, build and read
  the ``SparseTensorImpl`` of whatever device they are given and allocate its dense parts through
  the dispatcher. They are reached with ``op._op_dk(SparseMeta, ...)``.
- Every op that computes (``coalesce``, ``to_dense``, ``add``, ``sparse_mask``, ``clone``...) is
  written here with dense tpu ops on the indices and values, so the math runs on the device through
  the lowering table. ``coalesce`` needs the number of distinct indices: ``torch.unique`` reads it
  on the host (a sync).
- Any other op on a sparse tpu tensor reaches a ``SparsePrivateUse1`` fallback that raises
  ``NotImplementedError`` naming the op: never a silent wrong result, never a CPU round trip.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_tpu.tensor.meta import device_mismatch

aten = torch.ops.aten
_SPARSE_META = torch._C.DispatchKey.SparseMeta
_SPARSE_CPU = torch._C.DispatchKey.SparseCPU

_lib: torch.library.Library | None = None
_fallback_lib: torch.library.Library | None = None
IMPLEMENTED: dict[str, str] = {}  # overload name -> "generic" (torch's SparseMeta kernel) | "tpu"


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not implemented for sparse tpu tensors (torch_tpu supports the sparse "
                               "COO life cycle, to_dense, coalesce, add/sub, sparse_mask, neg and mul/div by a scalar)")


def make_sparse(sparse_dim: int, dense_dim: int, size: Any, indices: torch.Tensor, values: torch.Tensor,
                coalesced: bool | None = None) -> torch.Tensor:
    """A sparse COO tensor on the device of ``values`` over these (dense tpu) indices and values,
    built by torch's generic constructor (no copy, no check)."""
    return aten._sparse_coo_tensor_with_dims_and_tensors.default._op_dk(
        _SPARSE_META, sparse_dim, dense_dim, list(size), indices, values,
        dtype=values.dtype, layout=torch.sparse_coo, device=values.device, pin_memory=None, is_coalesced=coalesced,
    )


def _parts(t: torch.Tensor) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    return t.sparse_dim(), t.dense_dim(), t._indices(), t._values()


# ---------------------------------------------------------------------------------- construction
def _with_dims_and_tensors(sparse_dim: int, dense_dim: int, size: list, indices: torch.Tensor, values: torch.Tensor,
                           *, dtype: torch.dtype | None = None, layout: Any = None, device: Any = None,
                           pin_memory: bool | None = None, is_coalesced: bool | None = None) -> torch.Tensor:
    """``_sparse_coo_tensor_with_dims_and_tensors`` for device tpu: the indices and values must
    already be tpu tensors (as on CUDA, where they must be CUDA tensors)."""
    for name, t in (("indices", indices), ("values", values)):
        if t.device.type != "tpu":
            raise RuntimeError(f"_sparse_coo_tensor_with_dims_and_tensors: expected {name} on tpu:0, but found "
                               f"{t.device} (move it with .to('tpu') first)")
    return aten._sparse_coo_tensor_with_dims_and_tensors.default._op_dk(
        _SPARSE_META, sparse_dim, dense_dim, size, indices, values,
        dtype=dtype, layout=layout, device=values.device, pin_memory=pin_memory, is_coalesced=is_coalesced,
    )


def _clone(self: torch.Tensor, *, memory_format: Any = None) -> torch.Tensor:
    sd, dd, idx, vals = _parts(self)
    return make_sparse(sd, dd, self.shape, idx.clone(), vals.clone(), self.is_coalesced())


def _copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    if not (self.is_sparse and src.is_sparse):
        raise RuntimeError(
            "copy_() between dense and sparse Tensors is not implemented! Found self type = "
            f"{self.type()} and src type = {src.type()}"
        )
    return aten.copy_sparse_to_sparse_.default._op_dk(_SPARSE_META, self, src, non_blocking)


# -------------------------------------------------------------------------------------- compute
def _linear_index(idx: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
    """Row-major position of each index column among the ``size`` sparse dims (as CPU's flatten)."""
    lin = idx[0]
    for d in range(1, len(size)):
        lin = lin * size[d] + idx[d]
    return lin


def _coalesce(self: torch.Tensor) -> torch.Tensor:
    """Sums duplicate indices and sorts them, as CPU does: unique over the linearised indices (the
    host learns the count), then an ``index_add`` of the values onto their unique slot."""
    sd, dd, idx, vals = _parts(self)
    nnz = idx.shape[1]
    if nnz < 2:
        return make_sparse(sd, dd, self.shape, idx.clone(), vals.clone(), True)
    if sd == 0:  # every entry sits at the one (dense) position
        return make_sparse(sd, dd, self.shape, idx[:, :1].clone(), vals.sum(0, keepdim=True), True)
    size = tuple(self.shape[:sd])
    uniq, inverse = torch.unique(_linear_index(idx, size), sorted=True, return_inverse=True)
    new_vals = vals.new_zeros((uniq.shape[0], *vals.shape[1:])).index_add_(0, inverse, vals)
    rows, rest = [], uniq
    for n in reversed(size):
        rows.append(torch.remainder(rest, n))
        rest = torch.div(rest, n, rounding_mode="floor")
    new_idx = torch.stack(rows[::-1]) if len(rows) > 1 else rows[0].unsqueeze(0)
    return make_sparse(sd, dd, self.shape, new_idx, new_vals, True)


def _scatter_into(dense: torch.Tensor, sparse: torch.Tensor, scale: Any = 1) -> torch.Tensor:
    """Adds ``scale * sparse`` into the dense tpu tensor ``dense`` in place (duplicates add up)."""
    sd, _, idx, vals = _parts(sparse)
    if idx.shape[1] == 0:
        return dense
    if not (isinstance(scale, (int, float)) and scale == 1):
        vals = vals * scale
    vals = vals.to(dense.dtype)
    if sd == 0:
        return dense.add_(vals.sum(0))
    return dense.index_put_(tuple(idx.unbind(0)), vals, accumulate=True)


def _to_dense(self: torch.Tensor, dtype: torch.dtype | None = None, masked_grad: bool | None = None) -> torch.Tensor:
    out = torch.zeros(self.shape, dtype=dtype or self.dtype, device=self.device)
    return _scatter_into(out, self)


def _check_same_size(self: torch.Tensor, other: torch.Tensor, sparse_sparse: bool) -> None:
    if self.shape == other.shape:
        return
    if sparse_sparse:
        raise RuntimeError(f"add: expected sizes of 'self' and 'other' to match, but {list(self.shape)} != "
                           f"{list(other.shape)}")
    raise RuntimeError(
        f"add: expected 'self' and 'other' to have same size, but self has size {list(self.shape)} while other "
        f"has size {list(other.shape)} (FYI: dense-sparse addition does not currently support broadcasting)"
    )


def _scalar_type_name(dtype: torch.dtype) -> str:
    """CPU's name of a dtype in messages ("Float", "Long")."""
    return torch.empty(0, dtype=dtype).type().removeprefix("torch.").removesuffix("Tensor")


def _check_cast(result: torch.dtype, out: torch.dtype) -> None:
    if not torch.can_cast(result, out):
        raise RuntimeError(f"Can't convert result type {_scalar_type_name(result)} to output "
                           f"{_scalar_type_name(out)} in add operation")


def _check_devices(name: str, *tensors: torch.Tensor) -> None:
    """Dense and sparse operands must all be tpu tensors, as on CUDA."""
    for t in tensors:
        if t.device.type != "tpu" and not (t.dim() == 0 and not t.is_sparse):
            raise device_mismatch(name, t.device)


def _sparse_sum(self: torch.Tensor, other: torch.Tensor, alpha: Any, dtype: torch.dtype) -> torch.Tensor:
    """sparse + alpha * sparse: the two entry lists side by side (coalesced again when both were,
    as CPU's merge keeps them)."""
    _check_same_size(self, other, True)
    if self.sparse_dim() != other.sparse_dim() or self.dense_dim() != other.dense_dim():
        raise RuntimeError(f"add: expected 'self' and 'other' to have the same sparse_dim and dense_dim, but got "
                           f"{self.sparse_dim()}/{self.dense_dim()} and {other.sparse_dim()}/{other.dense_dim()}")
    sd, dd, idx, vals = _parts(self)
    oidx, ovals = other._indices(), other._values()
    if not (isinstance(alpha, (int, float)) and alpha == 1):
        ovals = ovals * alpha
    out = make_sparse(sd, dd, self.shape, torch.cat([idx, oidx], 1), torch.cat([vals.to(dtype), ovals.to(dtype)]),
                      False)
    return _coalesce(out) if self.is_coalesced() and other.is_coalesced() else out


def _add(self: torch.Tensor, other: torch.Tensor, *, alpha: Any = 1) -> torch.Tensor:
    _check_devices("add", self, other)
    dtype = torch.promote_types(self.dtype, other.dtype)
    if self.is_sparse and other.is_sparse:
        return _sparse_sum(self, other, alpha, dtype)
    if self.is_sparse:
        raise RuntimeError("add(sparse, dense) is not supported. Use add(dense, sparse) instead.")
    _check_same_size(self, other, False)
    return _scatter_into(self.to(dtype, copy=True), other, alpha)


def _add_(self: torch.Tensor, other: torch.Tensor, *, alpha: Any = 1) -> torch.Tensor:
    _check_devices("add_", self, other)
    dtype = torch.promote_types(self.dtype, other.dtype)
    _check_cast(dtype, self.dtype)
    if self.is_sparse and other.is_sparse:
        return _copy_(self, _sparse_sum(self, other, alpha, self.dtype))
    if self.is_sparse:
        raise RuntimeError("add(sparse, dense) is not supported. Use add(dense, sparse) instead.")
    _check_same_size(self, other, False)
    return _scatter_into(self, other, alpha)


def _sub(self: torch.Tensor, other: torch.Tensor, *, alpha: Any = 1) -> torch.Tensor:
    return _add(self, other, alpha=-alpha)


def _sub_(self: torch.Tensor, other: torch.Tensor, *, alpha: Any = 1) -> torch.Tensor:
    return _add_(self, other, alpha=-alpha)


def _sparse_mask(self: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Dense ``self`` read at ``mask``'s indices (duplicates kept), with ``mask``'s coalesced flag."""
    _check_devices("sparse_mask", self, mask)
    if self.shape != mask.shape:
        raise RuntimeError(f"sparse_mask(): operands have incompatible sizes; self has size {list(self.shape)} "
                           f"but mask has size {list(mask.shape)}")
    sd, dd, idx, _ = _parts(mask)
    if self.is_sparse:
        vals = _sparse_values_at(self, idx)
    elif sd:
        vals = self[tuple(idx.unbind(0))]
    else:
        vals = self.unsqueeze(0).expand(idx.shape[1], *self.shape).clone()
    return make_sparse(sd, dd, self.shape, idx.clone(), vals, mask.is_coalesced())


def _sparse_mask_projection(self: torch.Tensor, mask: torch.Tensor, accumulate_matches: bool = False) -> torch.Tensor:
    """Sparse ``self`` read at ``mask``'s indices: ``sparse_mask``'s backward. Duplicate indices of
    ``self`` are summed (``self`` is coalesced first), which is CPU's ``accumulate_matches=True``
    and the same result for the coalesced gradients autograd passes."""
    return _sparse_mask(self, mask)


def _sparse_values_at(self: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The (summed) values of sparse ``self`` at each index column of ``idx``, zero where it has
    none: a binary search of the mask's linear indices among ``self``'s sorted ones."""
    if self.sparse_dim() != idx.shape[0]:
        raise _unsupported("sparse_mask of sparse tensors with different sparse_dim")
    src = _coalesce(self) if not self.is_coalesced() else self
    sidx, svals = src._indices(), src._values()
    out_shape = (idx.shape[1], *svals.shape[1:])
    if sidx.shape[1] == 0 or idx.shape[1] == 0:
        return svals.new_zeros(out_shape)
    if self.sparse_dim() == 0:  # one position, which coalesced ``self`` holds: every column reads it
        return svals[:1].expand(out_shape).clone()
    size = tuple(self.shape[: self.sparse_dim()])
    have, want = _linear_index(sidx, size), _linear_index(idx, size)
    pos = torch.searchsorted(have, want).clamp_(max=have.shape[0] - 1)
    found = have[pos] == want
    picked = svals[pos]
    return torch.where(found.view(-1, *[1] * (picked.dim() - 1)), picked, svals.new_zeros(()))


def _scalar_other(name: str, other: Any) -> None:
    if isinstance(other, torch.Tensor) and (other.is_sparse or other.dim() != 0):
        raise _unsupported(f"aten::{name} of a sparse tensor with a tensor operand (only a scalar one is)")


def _values_op(name: str, fn: Callable[..., torch.Tensor], inplace: bool, commutes: bool = False) -> Callable:
    """An op that maps zero to zero, so applies to the values alone (the indices are shared)."""

    def run(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if commutes and not self.is_sparse and args and getattr(args[0], "is_sparse", False) and self.dim() == 0:
            self, args = args[0], (self, *args[1:])  # scalar tensor * sparse
        if not self.is_sparse:
            raise _unsupported(f"aten::{name} of a dense tensor with a sparse operand")
        if args:
            _scalar_other(name, args[0])
        sd, dd, idx, vals = _parts(self)
        new_vals = fn(vals, *args, **kwargs)
        if inplace:
            vals.copy_(new_vals)  # may raise CPU's in-place cast error
            return self
        return make_sparse(sd, dd, self.shape, idx.clone(), new_vals, self.is_coalesced())

    return run


# ------------------------------------------------------------------------- dense -> sparse (PrivateUse1)
def _dense_to_sparse(self: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    """``to_sparse(sparse_dim)`` of a dense tpu tensor, as CPU's: one entry per position of the
    first ``sparse_dim`` dims whose slice holds a non-zero (NaN counts), sorted, so coalesced.
    ``nonzero`` tells the host the count (a sync), as CPU's kernel learns it."""
    nd = self.dim()
    if not 0 <= sparse_dim <= nd:
        raise RuntimeError(f"dense_to_sparse: sparse_dim argument must be in [0,{nd}] range, but {sparse_dim} is given")
    if nd > 0 and sparse_dim == 0:
        raise RuntimeError("dense_to_sparse: sparse_dim argument must be in >0 when self.dim()>0")
    mask = self != 0
    if sparse_dim < nd:
        mask = mask.flatten(sparse_dim).any(-1)
    pos = mask.nonzero()  # nnz x sparse_dim
    if nd == 0:
        nnz = pos.shape[0]
        return make_sparse(0, 0, (), pos.t().contiguous(), self.reshape(1)[:nnz].clone(), True)
    idx = pos.t().contiguous()
    vals = self[tuple(idx.unbind(0))]
    return make_sparse(sparse_dim, nd - sparse_dim, self.shape, idx, vals, True)


def _to_sparse_sparse_dim(self: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    return _dense_to_sparse(self, sparse_dim)


def _to_sparse(self: torch.Tensor, *, layout: Any = None, blocksize: Any = None,
               dense_dim: int | None = None) -> torch.Tensor:
    if layout not in (None, torch.sparse_coo):
        raise _unsupported(f"to_sparse(layout={layout})")
    if blocksize is not None:
        raise RuntimeError("to_sparse for Strided to SparseCoo conversion does not use specified blocksize")
    return _dense_to_sparse(self, self.dim() - (dense_dim or 0))


# ------------------------------------------------------------------------------------ fallback
def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    raise _unsupported(f"{op}")


# -------------------------------------------------------------------------------- registration
_GENERIC = (  # torch's device-agnostic SparseMeta kernels: fields and allocation only, no arithmetic
    aten._indices.default, aten._values.default, aten.indices.default, aten.values.default, aten._nnz.default,
    aten.sparse_dim.default, aten.dense_dim.default, aten._dimV.default, aten.is_coalesced.default,
    aten._coalesced_.default, aten.sparse_resize_.default, aten.sparse_resize_and_clear_.default,
    aten.zero_.default, aten.copy_sparse_to_sparse_.default, aten._sparse_coo_tensor_with_dims.default,
    aten.empty.memory_format, aten.empty_like.default,
)


def _generic(op: torch._ops.OpOverload, key: torch._C.DispatchKey = _SPARSE_META) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        return op._op_dk(key, *args, **kwargs)

    return run


def register() -> None:
    """Registers the ``SparsePrivateUse1`` kernels and the fallback for every other sparse op."""
    global _lib, _fallback_lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    kernels: dict[torch._ops.OpOverload, tuple[Callable, str]] = {op: (_generic(op), "generic") for op in _GENERIC}
    kernels[aten._dimI.default] = (_generic(aten._dimI.default, _SPARSE_CPU), "generic")  # a field read as well
    kernels.update({
        aten._sparse_coo_tensor_with_dims_and_tensors.default: (_with_dims_and_tensors, "generic"),
        aten.clone.default: (_clone, "tpu"),
        aten.copy_.default: (_copy_, "tpu"),
        aten._coalesce.default: (_coalesce, "tpu"),
        aten._to_dense.default: (_to_dense, "tpu"),
        aten.add.Tensor: (_add, "tpu"),
        aten.add_.Tensor: (_add_, "tpu"),
        aten.sub.Tensor: (_sub, "tpu"),
        aten.sub_.Tensor: (_sub_, "tpu"),
        aten.sparse_mask.default: (_sparse_mask, "tpu"),
        aten._sparse_mask_projection.default: (_sparse_mask_projection, "tpu"),
        aten.neg.default: (_values_op("neg", torch.neg, False), "tpu"),
        aten.neg_.default: (_values_op("neg_", torch.neg, True), "tpu"),
        aten.mul.Tensor: (_values_op("mul.Tensor", torch.mul, False, commutes=True), "tpu"),
        aten.mul_.Tensor: (_values_op("mul_.Tensor", torch.mul, True), "tpu"),
        aten.div.Tensor: (_values_op("div.Tensor", torch.div, False), "tpu"),
        aten.div_.Tensor: (_values_op("div_.Tensor", torch.div, True), "tpu"),
    })
    for op, (fn, how) in kernels.items():
        _lib.impl(op.name().split("::", 1)[1], fn, "SparsePrivateUse1")
        IMPLEMENTED[str(op)] = how
    # dense -> sparse takes a dense tpu tensor, so it dispatches to PrivateUse1, not the sparse key
    _lib.impl("_to_sparse.sparse_dim", _to_sparse_sparse_dim, "PrivateUse1")
    _lib.impl("_to_sparse", _to_sparse, "PrivateUse1")
    _fallback_lib = torch.library.Library("_", "IMPL")
    _fallback_lib.fallback(_fallback, "SparsePrivateUse1")
