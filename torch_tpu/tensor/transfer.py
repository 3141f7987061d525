"""Data crossing between the host and the device: CPU tensors and numpy arrays uploaded as jax arrays.

Every upload of the package goes through :func:`numpy_to_device`, so that the transfer is counted
(``metrics.transfer_bytes``) and the host copy kept for host reads (``storage.remember_host_copy``).
The upload calls jaxlib's batched put directly where it can, a sixth of ``jax.device_put``'s cost.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.runtime import metrics
from torch_tpu.tensor.storage import new_tensor, remember_host_copy


def _make_put() -> Any:
    """``jax.device_put(data)`` for a numpy array: to JAX's default device (the process's first
    local one unless configured), uncommitted. jaxlib's batched put is what it ends in; called
    directly it costs 6 us instead of 35 (a training loop sends every batch this way). Plain
    ``jax.device_put`` where jaxlib lacks it."""
    try:
        from jax._src.interpreters import pxla
        from jax._src.lib import xla_client

        put, default_device = xla_client.batched_device_put, pxla.get_default_device
        shaped = jax.core.ShapedArray
        placements: dict[Any, tuple[Any, list]] = {}  # device -> (its sharding, [device])
        avals: dict[tuple, Any] = {}  # (shape, dtype) -> its ShapedArray: making one costs more than the put

        def device_put(data: np.ndarray) -> Any:
            device = default_device()
            where = placements.get(device)
            if where is None:
                where = placements[device] = (jax.sharding.SingleDeviceSharding(device), [device])
            k = (data.shape, data.dtype)
            aval = avals.get(k)
            if aval is None:
                if len(avals) > 4096:  # a loader of ragged batches: a bounded memo
                    avals.clear()
                aval = avals[k] = shaped(data.shape, data.dtype)
            return put(aval, where[0], [data], where[1], False)

        probe = np.arange(3, dtype=np.float32)
        if not np.array_equal(np.asarray(device_put(probe)), probe):
            return jax.device_put
    except Exception:  # noqa: BLE001 - any change in jaxlib's private API: the public call
        return jax.device_put
    return device_put


_put: list[Any] = []


# dtypes whose CPU tensors numpy reads as they are (bfloat16 and complex32 need a reinterpretation)
_NUMPY_NATIVE = frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})


def host_to_device(t: torch.Tensor) -> Any:
    """A jax array on tpu:0 with a private copy of a CPU tensor's data. *Uncommitted* (no device
    named), so jit may move it next to arrays sharded over a mesh (torch_tpu.distributed).

    A plain tensor of a dtype numpy holds is copied straight from ``t.numpy()`` (C order, so a
    strided view comes out contiguous): the general path's detach, contiguous and conj/neg
    resolution cost more than the copy of a small batch, paid for every tensor of every batch."""
    if t.dtype in _NUMPY_NATIVE and not t.requires_grad and not t.is_conj() and not t.is_neg():
        return numpy_to_device(np.array(t.numpy(), copy=True, order="C"))
    return numpy_to_device(np.array(_dtypes.cpu_to_numpy(t), copy=True))


def numpy_to_device(data: np.ndarray, whole: torch.Tensor | None = None, host_result: bool = False) -> Any:
    """:func:`host_to_device` of a numpy array the caller gives up (the array keeps it as its host
    copy): a transfer, never a compile, whatever the shape. ``whole`` and ``host_result``: what
    :func:`remember_host_copy` keeps with the copy (a host op's result, ``host_placement``)."""
    metrics.transfer_bytes["host_to_device"] += data.nbytes
    if not _put:
        _put.append(_make_put())
    array = _put[0](data)
    remember_host_copy(array, data, whole, host_result)
    return array


def storage_from_bytes(data: np.ndarray) -> Any:
    """A tpu storage holding raw bytes, typed when a tensor is set onto it (used by torch.load)."""
    t = new_tensor((0,), torch.uint8)
    st = t.untyped_storage()
    st._raw = jax.device_put(np.array(data, dtype=np.uint8, copy=True))  # uncommitted, like host_to_device
    st._t = t  # keep the owning tensor alive with the storage
    return st
