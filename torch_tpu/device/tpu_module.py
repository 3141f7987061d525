"""The ``tpu`` device: PrivateUse1 renamed, and the ``torch.tpu`` module (shaped like ``torch.cuda``).

The light hook (:mod:`_torch_tpu_autoload`) registers ``torch.tpu`` during ``import torch``: a small
module whose cheap functions (``is_available``, ``is_bf16_supported`` ...) answer without JAX and
whose other attributes are looked up here once the package is imported. So this module never
imports the hook: ``torch_tpu/__init__.py`` connects the two. Device indices: :mod:`torch_tpu.core.devices`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu.core import rng as _rng
from torch_tpu.core.devices import _devices, check_index, jax_device, platform  # noqa: F401  (torch.tpu's names)
from torch_tpu.device.graphed_callables import make_graphed_callables  # noqa: F401
from torch_tpu.device.graphs import (  # noqa: F401  (CUDA graphs' API: capture once, replay per step)
    TPUGraph,
    graph,
    graph_pool_handle,
    is_current_stream_capturing,
)
from torch_tpu.device.streams import Event, Stream, current_stream, default_stream, set_stream, stream  # noqa: F401
from torch_tpu.runtime.executor import synchronize as _synchronize
from torch_tpu.runtime.host_reads import get_sync_debug_mode, set_sync_debug_mode  # noqa: F401
from torch_tpu.tensor.legacy_storage import storage_classes as _storage_classes
from torch_tpu.tensor.storage import new_tensor

# ------------------------------------------------------------------ the torch.cuda-like API
# (``is_available``, ``is_initialized``, ``get_amp_supported_dtype``, ``is_bf16_supported`` and
# ``take_lost_exception`` are the light hook's own, set on ``torch.tpu`` before this module loads)


def device_count() -> int:
    return len(_devices())


def current_device() -> int:
    return 0


def set_device(device: int | str | torch.device) -> None:
    check_index(_index_of(device))


def _index_of(device: int | str | torch.device | None) -> int | None:
    if device is None or isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "tpu":
        raise ValueError(f"expected a tpu device, got {d}")
    return d.index


@contextlib.contextmanager
def device(device: int | str | torch.device | None) -> Iterator[None]:
    """Context manager selecting a device, like ``torch.cuda.device``."""
    check_index(_index_of(device))
    yield


def device_of(obj: Any) -> contextlib.AbstractContextManager:
    """``torch.cuda.device_of``: the device of ``obj`` (a tpu tensor) selected for the block; a
    no-op for anything else, as CUDA's is for a CPU tensor."""
    if isinstance(obj, torch.Tensor) and obj.device.type == "tpu":
        return device(obj.device)
    return contextlib.nullcontext()


def synchronize(device: int | str | torch.device | None = None) -> None:
    """Waits for every queued computation on the device."""
    _synchronize()


def manual_seed(seed: int) -> None:
    _rng.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    _rng.manual_seed(seed)


def seed() -> int:
    return _rng.seed()


def seed_all() -> int:
    return _rng.seed()


def initial_seed() -> int:
    return _rng.initial_seed()


def get_rng_state(device: int | str | torch.device = "tpu") -> torch.Tensor:
    return _rng.get_state()


def set_rng_state(new_state: torch.Tensor, device: int | str | torch.device = "tpu") -> None:
    _rng.set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    """One state per device, as ``torch.cuda.get_rng_state_all`` (checkpointing code saves it so).
    The devices share one random stream (one program runs on all of them), so every entry is the
    same state."""
    return [_rng.get_state() for _ in range(device_count())]


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    """Restores :func:`get_rng_state_all`'s states. They must agree: tpu devices share one stream,
    and a list of different per-device states (saved from CUDA devices, say) has no faithful
    meaning here, so it is refused rather than reduced to one of them."""
    states = list(new_states)
    if not states:
        return
    first = states[0].detach().cpu()
    for i, other in enumerate(states[1:], 1):
        if not torch.equal(other.detach().cpu(), first):
            raise ValueError(
                f"torch.tpu.set_rng_state_all: state {i} differs from state 0; tpu devices share one random "
                "stream, so every device's state must be the same (pass one with torch.tpu.set_rng_state)")
    _rng.set_state(first)


def init() -> None:
    """Starts the XLA runtime now rather than at the first tpu tensor, like ``torch.cuda.init``."""
    _devices()


# what CUDA raises when an allocation fails (``torch.cuda.OutOfMemoryError``); XLA's RESOURCE_EXHAUSTED
# surfaces as it (torch_tpu.runtime.errors)
OutOfMemoryError = torch.OutOfMemoryError


def get_device_name(device: int | str | torch.device | None = None) -> str:
    d = jax_device(_index_of(device))
    return f"{d.device_kind} ({d.platform}:{d.id})"


@dataclass(frozen=True)
class DeviceProperties:
    """What XLA tells about a device."""

    name: str
    platform: str
    device_kind: str
    id: int
    total_memory: int | None


def get_device_properties(device: int | str | torch.device | None = None) -> DeviceProperties:
    d = jax_device(_index_of(device))
    stats = _memory_stats_or_none(d)
    return DeviceProperties(
        name=get_device_name(device),
        platform=d.platform,
        device_kind=d.device_kind,
        id=d.id,
        total_memory=None if stats is None else stats.get("bytes_limit"),
    )


def _memory_stats_or_none(d: Any) -> dict[str, int] | None:
    try:
        return d.memory_stats()
    except Exception:  # some PJRT clients raise instead of returning None
        return None


def memory_stats(device: int | str | torch.device | None = None) -> dict[str, int]:
    """XLA's memory statistics. Raises where the platform keeps none (XLA:CPU): never a made-up 0."""
    d = jax_device(_index_of(device))
    stats = _memory_stats_or_none(d)
    if not stats:
        raise RuntimeError(f"torch.tpu.memory_stats: the XLA {d.platform} platform reports no memory statistics")
    return stats


def memory_allocated(device: int | str | torch.device | None = None) -> int:
    return int(memory_stats(device)["bytes_in_use"])


def max_memory_allocated(device: int | str | torch.device | None = None) -> int:
    stats = memory_stats(device)
    return int(stats.get("peak_bytes_in_use", stats["bytes_in_use"]))


def _stat(device: int | str | torch.device | None, key: str, api: str) -> int:
    stats = memory_stats(device)
    if key not in stats:
        raise RuntimeError(f"torch.tpu.{api}: the XLA {jax_device(_index_of(device)).platform} platform reports no "
                           f"{key!r} (it reports {sorted(stats)})")
    return int(stats[key])


def memory_reserved(device: int | str | torch.device | None = None) -> int:
    return _stat(device, "bytes_reserved", "memory_reserved")


def max_memory_reserved(device: int | str | torch.device | None = None) -> int:
    return _stat(device, "peak_bytes_reserved", "max_memory_reserved")


def mem_get_info(device: int | str | torch.device | None = None) -> tuple[int, int]:
    """(free, total) bytes, from XLA's allocator limit and what is in use."""
    total = _stat(device, "bytes_limit", "mem_get_info")
    return total - memory_allocated(device), total


def empty_cache() -> None:
    """Nothing to release: XLA frees a buffer when its last array goes; this only waits for queued work."""
    synchronize()


def reset_peak_memory_stats(device: int | str | torch.device | None = None) -> None:
    raise NotImplementedError("torch.tpu.reset_peak_memory_stats: XLA keeps its peak for the process's lifetime "
                              "and PJRT offers no reset")


reset_accumulated_memory_stats = reset_peak_memory_stats
reset_max_memory_allocated = reset_peak_memory_stats  # CUDA's older names for the same reset
reset_max_memory_cached = reset_peak_memory_stats
memory_cached = memory_reserved  # CUDA's older names: the cache is what the allocator reserved
max_memory_cached = max_memory_reserved


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def memory_summary(device: int | str | torch.device | None = None, abbreviated: bool = False) -> str:
    """A printable table of XLA's memory statistics for the device, as ``torch.cuda.memory_summary``
    prints CUDA's allocator's. Raises where the platform keeps none (XLA:CPU), as
    :func:`memory_stats` does. ``abbreviated`` is accepted for CUDA's signature (the table is short)."""
    stats = memory_stats(device)
    d = jax_device(_index_of(device))
    rows = [(k, _bytes(int(v)) if "bytes" in k or "size" in k else str(v)) for k, v in sorted(stats.items())]
    width = max(len(k) for k, _ in rows)
    lines = [f"XLA memory summary, device {d} ({d.platform})", "-" * (width + 20)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)

# PyTorch's names (torch.accelerator.memory_stats) for XLA's statistics
_TORCH_STAT_NAMES = {"bytes_in_use": "allocated_bytes.all.current", "peak_bytes_in_use": "allocated_bytes.all.peak",
                     "bytes_reserved": "reserved_bytes.all.current", "peak_bytes_reserved": "reserved_bytes.all.peak",
                     "num_allocs": "allocation.all.allocated", "largest_alloc_size": "largest_alloc_size"}


def accelerator_memory_stats(device: int | str | torch.device | None = None) -> dict[str, int]:
    """``torch.accelerator.memory_stats`` on tpu: XLA's statistics under PyTorch's names where one
    exists (``allocated_bytes.all.current`` ...), and every XLA statistic as ``xla.<name>``."""
    stats = memory_stats(device)
    out = {_TORCH_STAT_NAMES[k]: int(v) for k, v in stats.items() if k in _TORCH_STAT_NAMES}
    out.update({f"xla.{k}": v for k, v in stats.items()})
    return dict(sorted(out.items()))


# torch.tpu.FloatStorage ... as torch.cuda's (what a tpu tensor's storage_type() names)
globals().update(_storage_classes())


class _EngineProbe(torch.autograd.Function):
    """An identity whose backward runs on the tpu device's autograd thread, on an empty tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return new_tensor(tuple(x.shape), x.dtype)  # no device work: nothing reads it

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def check_autograd_engine() -> None:
    """Warns when PyTorch's autograd engine has no thread for tpu tensors.

    The engine sizes its per-device threads once, at the first backward pass of the process, from
    the device types registered then. A backward that ran before ``import torch_tpu`` (a CPU model,
    a notebook cell) leaves it without a tpu queue, and every later backward through tpu tensors
    fails deep in the engine with an internal assert that asks for a PyTorch bug report. A probe
    backward over an empty tensor (no device work) finds out here, where the warning can say what
    to do instead."""
    x = new_tensor((0,), torch.float32).requires_grad_()
    try:
        torch.autograd.grad(_EngineProbe.apply(x), x, new_tensor((0,), torch.float32))
    except RuntimeError as e:
        if "device_ready_queues_" not in str(e):
            raise
        warnings.warn(
            "tpu: a backward pass ran in this process before torch_tpu was imported, so PyTorch's autograd "
            "engine has no thread for the tpu device and backward() through tpu tensors will fail with an "
            "internal assert. Import torch_tpu before the first backward() (at the top of the script), or "
            "restart the process.",
            RuntimeWarning,
            stacklevel=3,
        )
