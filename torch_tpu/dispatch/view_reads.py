"""Ops that keep meeting new view geometries read the views first, instead of compiling each one.

An op whose input is a strided view (a slice, a permutation, a ``channels_last`` tensor) reads
it inside the op's own program, so the view costs no device call of its own: right for a
training step, which meets the same few geometries at every step. But the program is
specialised on the geometry (the storage's shape, the strides, the offset), so code that walks
many layouts of one logical shape compiles a program per op per layout: a test looping over
every permutation and slicing of a tensor, or a loop reading ``x[:, t]`` at each ``t``, compiles
each op it runs once for every view it meets.

So the dispatcher asks here when a functional or in-place op misses its program cache with a view among its
inputs (never on the hot path of a hit). An op *pattern* is the op at one source line of the
caller with its arguments' logical shapes and dtypes (views reduced to their shape). Once a
pattern has met ``TORCH_TPU_VIEW_CHURN`` (default 4) view geometries, each new one runs in
three steps that share their programs: every view is read on its own (one program per
geometry, shared by every op that reads it), the op runs on those dense copies (the program of
the contiguous signature, shared by every layout), and a result that CPU lays out in a
permuted order (``channels_last``, a permuted input's order) is transposed into it (one program
per shape, order and dtype); an in-place op's view then takes its copy's new value. Results,
strides included, are those of the fused path.

Fused eager mode records whole steps and compiles them together, so it never takes this path;
``TORCH_TPU_VIEW_CHURN=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax.numpy as jnp
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.runtime import fused
from torch_tpu.runtime.executor import Program, execute
from torch_tpu.tensor import storage as _storage

CHURN_AFTER = int(os.environ.get("TORCH_TPU_VIEW_CHURN", "4"))

# pattern -> the view geometries it has compiled; patterns past CHURN_AFTER
_seen: dict[tuple, set] = {}
_churning: set[tuple] = set()


def _split(spec: Any, geometry: list) -> Any:
    """A signature with each view reduced to its logical (shape, dtype), its geometry (the
    storage's shape, strides, offset) appended to ``geometry``."""
    if isinstance(spec, tuple):
        if type(spec).__name__ == "_View":
            geometry.append(spec[2:])
            return ("V", spec[0], spec[1])
        return tuple(_split(s, geometry) for s in spec)
    return spec


def churns(name: str, key: Any) -> bool:
    """Whether this cache miss of functional op ``name`` (signature ``key``, with ``_spec``'s
    types) runs on dense copies of its views (see the module docstring)."""
    geometry: list = []
    logical = _split(key, geometry)
    if not geometry:
        return False
    pattern = (name, fused.user_site(), logical)
    if pattern in _churning:
        return True
    seen = _seen.setdefault(pattern, set())
    seen.add(tuple(geometry))
    if len(seen) < CHURN_AFTER:
        return False
    _churning.add(pattern)
    del _seen[pattern]
    return False  # this geometry compiles, as the ones before it; the next new one reads first


def _dense(a: Any) -> Any:
    """``a``, with a tpu view (of any list too) replaced by a fresh contiguous copy."""
    if isinstance(a, torch.Tensor) and _storage.is_tpu(a):
        st = a.untyped_storage()
        if a.dtype is st._dtype and tuple(a.shape) == st._shape and not a.storage_offset() and a.is_contiguous():
            return a
        return _storage.new_tensor(tuple(a.shape), a.dtype, _storage.read(a))
    if isinstance(a, (list, tuple)):
        return type(a)(_dense(x) for x in a)
    return a


@functools.lru_cache(maxsize=4096)
def _relayout_program(shape: tuple, perm: tuple, dtype: Any) -> Program:
    return Program(f"lay out {list(shape)} in order {list(perm)}", lambda a: jnp.transpose(a, perm),
                   key=(("shape", shape), ("order", perm), ("dtype", dtype)))


def _laid_out(t: Any, meta: Any, layout: Any) -> Any:
    """Contiguous result ``t`` in the dense permuted layout CPU gives it (``meta``'s strides)."""
    if not isinstance(t, torch.Tensor) or meta is None or tuple(t.shape) != tuple(meta.shape):
        return t
    lay = layout(meta)
    if lay is None:
        return t
    stride, storage_shape, perm = lay
    value = execute(_relayout_program(tuple(t.shape), perm, _dtypes.to_jax(t.dtype)), _storage.read(t))
    return _storage.new_strided(tuple(t.shape), stride, storage_shape, t.dtype, value)


def run(kernel: Any, args: tuple, kwargs: dict, metas: Any, layout: Any) -> Any:
    """``kernel`` (an ``_OpKernel``) on dense copies of the views among ``args``/``kwargs``, its
    results laid out as ``metas`` (a callable giving the meta results of the original call)."""
    out = kernel(*_dense(args), **{k: _dense(v) for k, v in kwargs.items()})
    single = isinstance(out, torch.Tensor)
    results = [out] if single else list(out)
    if not any(isinstance(r, torch.Tensor) and not r.is_contiguous() for r in results):
        ms = metas()
        results = [_laid_out(r, m, layout) for r, m in zip(results, ms)]
    if single:
        return results[0]
    return results if isinstance(out, list) else tuple(results)


def run_inplace(kernel: Any, args: tuple, kwargs: dict) -> Any:
    """In-place ``kernel`` on dense copies of the views among its arguments; a view ``self``
    then takes the copy's new value (one write program per geometry, as the fused path's)."""
    first = args[0]
    dense = _dense(args)
    kernel(*dense, **{k: _dense(v) for k, v in kwargs.items()})
    if dense[0] is not first:
        _storage.write(first, _storage.read(dense[0]))
    return first
