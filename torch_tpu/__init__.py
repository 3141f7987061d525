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
from torch_tpu.core import devices as _devices

_devices.quiet_libtpu_without_a_tpu()  # before JAX picks its platform
_PLATFORM = os.environ.get("TORCH_TPU_PLATFORM", "").strip().lower()
if _PLATFORM:
    if _PLATFORM not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"TORCH_TPU_PLATFORM={_PLATFORM!r}: expected cpu, gpu or tpu")
    jax.config.update("jax_platforms", {"gpu": "cuda"}.get(_PLATFORM, _PLATFORM))
# Exact int64 and float64, as PyTorch has them. On TPU, 64-bit types are emulated (slower);
# see docs/numerics.md.
jax.config.update("jax_enable_x64", True)

# This module is where the layers are put together: the ones below never import the light hook
# (``_torch_tpu_autoload``, which ``torch.tpu`` and the c10d backend come from) nor this module.
# The device is registered (if ``import torch`` did not) and the C++ extension loaded before the
# kernels are imported, as their modules make tpu tensors and storages while they load.
from torch_tpu.core import compat as _compat  # noqa: E402
from torch_tpu.core import extension as _extension  # noqa: E402

_compat.keep_linalg_checks_in_graphs()
_torch_tpu_autoload.register()  # PrivateUse1 renamed ``tpu``, ``torch.tpu``, the c10d backend (idempotent)
_extension.load()  # the C++ extension: torch.Generator(device="tpu") and more; built here if missing

from torch_tpu import ops  # noqa: E402
from torch_tpu.compile.backend import adjust_dynamo_when_loaded  # noqa: E402
from torch_tpu.compile.export import export, load  # noqa: E402
from torch_tpu.core.devices import platform  # noqa: E402
from torch_tpu.custom import jax_op  # noqa: E402
from torch_tpu.device import module_move as _module_move  # noqa: E402
from torch_tpu.device import tpu_module as _tpu_module  # noqa: E402
from torch_tpu.dispatch import autocast as _autocast  # noqa: E402
from torch_tpu.dispatch import batched_matmul as _batched_matmul  # noqa: E402
from torch_tpu.dispatch import fallback as _fallback  # noqa: E402
from torch_tpu.dispatch import hand_kernels as _hand_kernels  # noqa: E402,F401  (registers its kernels)
from torch_tpu.dispatch import nested as _nested  # noqa: E402
from torch_tpu.dispatch import op_kernel as _op_kernel  # noqa: E402
from torch_tpu.dispatch import sparse as _sparse  # noqa: E402
from torch_tpu.runtime import cache as _cache  # noqa: E402
from torch_tpu.runtime import fused as _fused  # noqa: E402
from torch_tpu.runtime import target as _target  # noqa: E402
from torch_tpu.runtime.cache import cache_stats  # noqa: E402
from torch_tpu.runtime.executor import EagerMode, get_eager_mode, set_eager_mode  # noqa: E402
from torch_tpu.runtime.metrics import metrics  # noqa: E402
from torch_tpu.runtime.metrics import reset as reset_metrics  # noqa: E402
from torch_tpu.runtime.profiler import profile  # noqa: E402
from torch_tpu.runtime.report import metrics_report  # noqa: E402
from torch_tpu.runtime.target import TargetCompileError, set_target  # noqa: E402
from torch_tpu.runtime.target import report as target_report  # noqa: E402
from torch_tpu.runtime.target import step as target_step  # noqa: E402
from torch_tpu.tensor import serialization as _serialization  # noqa: E402
from torch_tpu.tensor import storage_api as _storage_api  # noqa: E402

_module_move.install()
_op_kernel.register_table()
_batched_matmul.install()
_sparse.register()
_nested.register()
_torch_tpu_autoload.remove_first_use_fallback()  # this package's own fallback replaces it
_fallback.register()
_serialization.install()
_storage_api.install()
_autocast.install()
ops.conv.install()
_cache.configure_persistent_cache()
_target.configure_from_env()  # TORCH_TPU_TARGET: every program also compiled for that TPU chip
adjust_dynamo_when_loaded()  # Dynamo never traces our kernels, whichever backend runs (see there)
if not _torch_tpu_autoload.autoloaded():  # registered during ``import torch``, before any backward
    _tpu_module.check_autograd_engine()
_fused.step_boundary(get_eager_mode() is EagerMode.FUSED)
_torch_tpu_autoload.mark_initialized()


def __getattr__(name: str):
    """``torch_tpu.TPUEstimator`` and ``torch_tpu.History``, imported on first use: the estimator
    brings :mod:`torch_tpu.distributed`, safetensors and tqdm, which ``import torch_tpu`` never loads."""
    if name in ("TPUEstimator", "History"):
        from torch_tpu import estimator  # on demand: see the docstring

        return getattr(estimator, name)
    raise AttributeError(f"module 'torch_tpu' has no attribute {name!r}")


def sync() -> None:
    """Runs what fused mode recorded (the explicit trace boundary) and waits for queued device work.
    Never required: every host read is a sync point too."""
    _tpu_module.synchronize()


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
    "set_target",
    "sync",
    "target_report",
    "target_step",
    "TargetCompileError",
]
