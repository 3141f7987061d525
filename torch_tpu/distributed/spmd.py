"""Single-process SPMD: one Python process drives every local device through sharded jax arrays.

A tpu tensor's data is a jax array on its storage. Re-placing that array with a
``NamedSharding`` spreads the tensor over a device mesh; every op after that is an ordinary
jitted program, and jit propagates the shardings: XLA partitions the computation and inserts the
collectives (an all-reduce of the weight gradients in data parallelism, for example). Nothing in
the op lowerings knows about meshes.

The tensor itself still reports ``tpu:0``: PyTorch's Python backend hooks cannot make other
device indices, and the sharding is a property of the array behind it, which
:func:`sharding_of` shows.

Tensors made the ordinary way (factories, ``.to("tpu")``) hold *uncommitted* arrays, which jit may
move next to sharded ones, so sharded and unsharded tensors mix freely in one op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from torch_tpu.runtime import fused
from torch_tpu.tensor.storage import base_array, is_tpu, read_array

SpecEntry = str | tuple[str, ...] | None


def mesh(shape: int | Sequence[int], axis_names: str | Sequence[str], devices: Sequence[Any] | None = None) -> Mesh:
    """A device mesh of ``shape`` with one name per axis, over the local devices.

    ``devices``: the jax devices (or local device indices) to use, in mesh order; all local
    devices by default. One entry of ``shape`` may be ``-1``: it takes what the others leave.
    The mesh must use exactly the devices given.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if len(shape) != len(names):
        raise ValueError(f"mesh: shape {shape} has {len(shape)} axes but {len(names)} axis names {names} were given")
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"mesh: axis names must be distinct non-empty strings, got {names}")
    local = jax.local_devices()
    if devices is None:
        devs = list(local)
    else:
        devs = [local[d] if isinstance(d, (int, np.integer)) else d for d in devices]
        if len({id(d) for d in devs}) != len(devs):
            raise ValueError("mesh: a device is listed twice")
    if shape.count(-1) > 1 or any(n < -1 or n == 0 for n in shape):
        raise ValueError(f"mesh: invalid shape {shape}: sizes must be positive, with at most one -1")
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        if len(devs) % known:
            raise ValueError(f"mesh: shape {shape} cannot cover {len(devs)} devices")
        shape = tuple(len(devs) // known if n == -1 else n for n in shape)
    if math.prod(shape) != len(devs):
        hint = "" if devices is not None else f"; pass devices= to use a subset of the {len(local)} local devices"
        raise ValueError(
            f"mesh: shape {shape} needs {math.prod(shape)} devices but {len(devs)} are used "
            f"({devs[0].platform if devs else 'none'}){hint}"
        )
    return Mesh(np.array(devs, dtype=object).reshape(shape), names)


def _check_whole(tensor: torch.Tensor, what: str) -> Any:
    """The storage of ``tensor``, which must be a tpu tensor covering all of it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if not is_tpu(tensor):
        raise ValueError(f"{what}: expected a tpu tensor, got one on {tensor.device}; move it with .to('tpu') first")
    st = tensor.untyped_storage()
    whole = (
        tuple(tensor.shape) == st._shape
        and tensor.dtype == st._dtype
        and tensor.storage_offset() == 0
        and tensor.is_contiguous()
    )
    if not whole:
        raise ValueError(
            f"{what}: this tensor is a view of a larger or differently laid-out storage; shard the tensor it "
            "views (its base) instead: the view then reads from the sharded array"
        )
    return st


def _normalize_spec(spec: Any, mesh: Mesh, shape: tuple[int, ...], what: str) -> tuple[SpecEntry, ...]:
    """``spec`` as a tuple with one entry per dim (missing trailing entries: replicated), checked
    against the mesh and the shape so mistakes raise here, naming the dim."""
    if spec is None:
        spec = ()
    if isinstance(spec, str):
        spec = (spec,)
    spec = tuple(spec)
    if len(spec) > len(shape):
        raise ValueError(f"{what}: spec {spec} has {len(spec)} entries but the tensor has {len(shape)} dims {shape}")
    spec = spec + (None,) * (len(shape) - len(spec))
    used: set[str] = set()
    out: list[SpecEntry] = []
    for d, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(f"{what}: dim {d}: {a!r} is not an axis of the mesh {dict(mesh.shape)}")
            if a in used:
                raise ValueError(f"{what}: mesh axis {a!r} shards more than one dim in spec {spec}")
            used.add(a)
        parts = math.prod(mesh.shape[a] for a in axes)
        if shape[d] % parts:
            raise ValueError(
                f"{what}: dim {d} of size {shape[d]} cannot be split evenly into {parts} parts over mesh axes {axes}"
            )
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def shard(tensor: torch.Tensor, mesh: Mesh, spec: Sequence[SpecEntry] | PartitionSpec | None) -> torch.Tensor:
    """Spreads ``tensor`` over ``mesh``: dim ``d`` is split along mesh axis ``spec[d]`` (a name, a
    tuple of names, or None: not split). Works in place on the tensor's storage and returns it.

    Only whole tensors can be sharded, not views: the storage holds one array, and every view of
    it, existing or future, reads from the re-placed array. (A view covering its whole storage in
    order, such as ``t.view(-1)``, is that array and counts as whole.) Values do not change, so autograd
    and optimizers are unaffected. ``shard(t, mesh, ())`` replicates ``t`` on every device.
    """
    st = _check_whole(tensor, "shard")
    spec = _normalize_spec(spec, mesh, tuple(tensor.shape), "shard")
    array = fused.concrete(base_array(st))  # fused mode: the value must exist to be moved
    st._jx = jax.device_put(array, NamedSharding(mesh, PartitionSpec(*spec)))
    return tensor


def replicate(tensor: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """A full copy of ``tensor`` on every device of ``mesh`` (parameters in data parallelism)."""
    return shard(tensor, mesh, ())


def replicate_module(module: torch.nn.Module, mesh: Mesh) -> torch.nn.Module:
    """Replicates every parameter and buffer of ``module`` (already on tpu) over ``mesh``."""
    for t in [*module.parameters(), *module.buffers()]:
        replicate(t, mesh)
    return module


def sharding_of(tensor: torch.Tensor) -> jax.sharding.Sharding:
    """How the array behind ``tensor`` is laid out over devices (a ``jax.sharding.Sharding``;
    ``.spec`` of a ``NamedSharding`` is the partition spec). Runs pending fused work if needed.
    For a view, the sharding of the array it reads as (computed by a slice of its base)."""
    if not is_tpu(tensor):
        raise ValueError(f"sharding_of: expected a tpu tensor, got one on {tensor.device}")
    return read_array(tensor).sharding
