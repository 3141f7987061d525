"""Which XLA device ``tpu:N`` names, and the platform they are.

Device indices: ``tpu:N`` names the N-th local XLA device. PyTorch's Python-only backend hooks
(``torch._C._acc``) create every tensor on index 0 and give no way to place one elsewhere, so
tensors live on ``tpu:0``; using more devices goes through SPMD sharding (``torch_tpu.distributed``),
and ``tpu:N`` for an N>0 that exists raises ``NotImplementedError`` saying so. An index that does
not exist raises ``RuntimeError`` as CUDA does.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

_PLATFORM_NAMES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def platform() -> str:
    """The XLA platform tpu tensors run on: ``"tpu"``, ``"gpu"`` or ``"cpu"``."""
    return _PLATFORM_NAMES.get(jax.devices()[0].platform, jax.devices()[0].platform)


@functools.lru_cache(maxsize=1)
def _devices() -> tuple[Any, ...]:
    return tuple(jax.local_devices())


def jax_device(index: int | None = 0) -> Any:
    """The jax device behind ``tpu:index``."""
    return _devices()[check_index(index)]


def check_index(index: int | None) -> int:
    """Validates a device index, raising as CUDA does for one that does not exist."""
    index = 0 if index is None or index < 0 else index
    n = len(_devices())
    if index >= n:
        raise RuntimeError(f"tpu: invalid device ordinal {index}: there are {n} tpu device(s) ({platform()})")
    if index > 0:
        raise NotImplementedError(
            f"tpu:{index}: tensors live on tpu:0 (PyTorch's Python backend hooks create every tensor on "
            "index 0); use torch_tpu.distributed sharding to spread work over the other devices"
        )
    return index
