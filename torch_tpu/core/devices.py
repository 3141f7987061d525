"""Which XLA device ``tpu:N`` names, and the platform they are.

Device indices: ``tpu:N`` names the N-th local XLA device. PyTorch's Python-only backend hooks
(``torch._C._acc``) create every tensor on index 0 and give no way to place one elsewhere, so
tensors live on ``tpu:0``; using more devices goes through SPMD sharding (``torch_tpu.distributed``),
and ``tpu:N`` for an N>0 that exists raises ``NotImplementedError`` saying so. An index that does
not exist raises ``RuntimeError`` as CUDA does.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax

_PLATFORM_NAMES = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}


def quiet_libtpu_without_a_tpu() -> None:
    """libtpu installed on a machine with no TPU (for compiling to a target chip, ``runtime.target``)
    would ask a cloud metadata server what TPU this is, at JAX's first use, and print a screen of
    errors when none answers. With no TPU device file here (``/dev/accel*``, ``/dev/vfio/<n>``) there
    is none to find: it is told so, and where there is no GPU either, JAX is told to use the CPU.
    Must run before JAX picks its platform; changes nothing on a TPU host, nor what is set already."""
    import glob
    import importlib.util

    if importlib.util.find_spec("libtpu") is None or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    if not jax.config.jax_platforms and not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/kfd"):
        # no GPU either: the CPU, which JAX would pick; named, because with libtpu loaded and no
        # TPU, JAX's profiler (torch_tpu.profile) crashes the process in libtpu's plugin
        jax.config.update("jax_platforms", "cpu")
    # the last: libtpu's lock against two processes sharing a TPU, of which there is none here (a
    # process that compiles for a target chip would stop every other from loading libtpu)
    for name, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                        ("TPU_ACCELERATOR_TYPE", "v5litepod-4"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(name, value)


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
