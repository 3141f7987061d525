"""TorchTPU: a native PyTorch backend for XLA devices (TPU, then GPU, then CPU).

``import torch`` registers the ``tpu`` device through PyTorch's backend autoload (the light hook
in :mod:`_torch_tpu_autoload`), and the first tpu op imports this package; ``import torch_tpu``
does it explicitly (and is what registers the device when ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``).
Tensors on it are plain ``torch.Tensor`` objects whose data are jax arrays; every ATen op is
lowered once, to jax, in :mod:`torch_tpu.ops`.
"""

from __future__ import annotations

import os

import jax
import torch  # noqa: F401  first: torch's backend autoload imports the hook module whole (it imports torch itself)

import _torch_tpu_autoload

_PLATFORM = os.environ.get("TORCH_TPU_PLATFORM", "").strip().lower()
if _PLATFORM:
    if _PLATFORM not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"TORCH_TPU_PLATFORM={_PLATFORM!r}: expected cpu, gpu or tpu")
    jax.config.update("jax_platforms", {"gpu": "cuda"}.get(_PLATFORM, _PLATFORM))
# Exact int64 and float64, as PyTorch has them. On TPU, 64-bit types are emulated (slower);
# see docs/numerics.md.
jax.config.update("jax_enable_x64", True)

from torch_tpu import _compat, _device  # noqa: E402

_compat.keep_linalg_checks_in_graphs()

_device.register()
from torch_tpu import _extension  # noqa: E402

_extension.load()  # torch.Generator(device="tpu"), where the set-up command built the C++ extension
from torch_tpu import _module_move  # noqa: E402

_module_move.install()

from torch_tpu import _autocast, _dispatch, _fallback, _host, _kernels, _nested, _sparse, _storage_api, ops  # noqa: E402,F401

_dispatch.register_table()
_sparse.register()
_nested.register()
_torch_tpu_autoload.remove_first_use_fallback()  # this package's own fallback replaces it
_fallback.register()
_host.install()
_storage_api.install()
_autocast.install()
ops.conv.install()

from torch_tpu._device import platform  # noqa: E402
from torch_tpu.compile.backend import adjust_dynamo_when_loaded  # noqa: E402
from torch_tpu.compile.export import export, load  # noqa: E402
from torch_tpu.custom import jax_op  # noqa: E402
from torch_tpu.runtime import cache as _cache  # noqa: E402
from torch_tpu.runtime import fused as _fused  # noqa: E402
from torch_tpu.runtime.cache import cache_stats  # noqa: E402
from torch_tpu.runtime.executor import EagerMode, get_eager_mode, set_eager_mode  # noqa: E402
from torch_tpu.runtime.metrics import metrics  # noqa: E402
from torch_tpu.runtime.metrics import reset as reset_metrics  # noqa: E402
from torch_tpu.runtime.profiler import profile  # noqa: E402
from torch_tpu.runtime.report import metrics_report  # noqa: E402

_cache.configure_persistent_cache()
adjust_dynamo_when_loaded()  # Dynamo never traces our kernels, whichever backend runs (see there)
if not _torch_tpu_autoload.autoloaded():  # registered during ``import torch``, before any backward
    _device.check_autograd_engine()
_fused.step_boundary(get_eager_mode() is EagerMode.FUSED)
# the ``tpu`` c10d backend (``dist.init_process_group("tpu")``, and ``init_process_group()``'s default
# for tpu) is registered by _device.register(), through _torch_tpu_autoload
_torch_tpu_autoload.mark_initialized()


def sync() -> None:
    """Runs what fused mode recorded (the explicit trace boundary) and waits for queued device work.
    Never required: every host read is a sync point too."""
    _device.synchronize()


def __getattr__(name: str):
    """``torch_tpu.TPUEstimator`` and ``torch_tpu.History``, imported on first use (import time matters)."""
    if name in ("TPUEstimator", "History"):
        from torch_tpu import estimator

        return getattr(estimator, name)
    raise AttributeError(f"module 'torch_tpu' has no attribute {name!r}")


__all__ = [
    "EagerMode",
    "export",
    "load",
    "cache_stats",
    "get_eager_mode",
    "jax_op",
    "metrics",
    "metrics_report",
    "platform",
    "profile",
    "reset_metrics",
    "set_eager_mode",
    "sync",
]
