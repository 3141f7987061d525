"""Counters for what reached the device: ops, lowerings compiled, decompositions and CPU fallbacks.

Fallbacks are never silent: every one is counted here and warned about once per op.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from torch_tpu.runtime import residency, settle

_lock = threading.Lock()
op_counts: collections.Counter[str] = collections.Counter()
fallback_counts: collections.Counter[str] = collections.Counter()
decomposition_counts: collections.Counter[str] = collections.Counter()
# ops run on the host CPU because their (small, integer) shapes changed at every call
# (torch_tpu.dispatch.host_placement)
host_op_counts: collections.Counter[str] = collections.Counter()
# of the fallbacks, the calls that ran on the host because XLA has no TPU kernel for the op (eig)
# while the platform or the TPU target is a TPU (torch_tpu.dispatch.fallback.host_on_tpu_kernel)
no_tpu_kernel_counts: collections.Counter[str] = collections.Counter()
compile_counts: collections.Counter[str] = collections.Counter()
compile_seconds: collections.Counter[str] = collections.Counter()
transfer_bytes: collections.Counter[str] = collections.Counter()  # host_to_device, device_to_host
# torch.compile graphs run op by op in eager mode (a data-dependent shape), by the op that forced it
eager_graphs: collections.Counter[str] = collections.Counter()
compile_totals = [0, 0.0]  # the sums of compile_counts and compile_seconds, for callers that ask every step


def count_compile(name: str, seconds: float) -> None:
    """Records one XLA compilation: a per-op program (strict and debug mode) or a fused trace
    (named ``fused program <fingerprint>``, one per miss of :func:`cache_stats`), so that
    ``compile_count`` counts every program compiled and ``fused_compile_count`` equals the misses."""
    with _lock:
        compile_counts[name] += 1
        compile_seconds[name] += seconds
        compile_totals[0] += 1
        compile_totals[1] += seconds


_count_sources: list[Callable[[], dict[str, int]]] = []  # op counts kept elsewhere (the C++ views)
_on_reset: list[Callable[[], None]] = []  # other counters cleared with these (the fused cache's statistics)
profile: Any = None  # the profile in progress (set by runtime.profiler): each program run is timed through it


def on_reset(clear: Callable[[], None]) -> None:
    """Registers ``clear`` to run with :func:`reset`, so the cache's statistics reset with the
    counters without this module importing the cache."""
    _on_reset.append(clear)


def count_source(take: Callable[[], dict[str, int]]) -> None:
    """Registers ``take``, which returns op counts kept outside Python since its last call (the
    extension's view kernels count in C++: a call into Python per view would cost what the C++
    kernel saves); :func:`fold` adds them to ``op_counts``."""
    if take not in _count_sources:
        _count_sources.append(take)


def fold() -> None:
    """Adds the counts of every :func:`count_source` to ``op_counts``: before ``op_counts`` is read."""
    for take in _count_sources:
        counts = take()
        if counts:
            op_counts.update(counts)


def reset() -> None:
    """Clears every counter that ``metrics()``, ``metrics_report()`` and ``cache_stats()`` show,
    the recompilation log included (the compiled programs themselves stay cached)."""
    fold()  # the counts kept elsewhere restart too
    for c in (op_counts, fallback_counts, decomposition_counts, host_op_counts, no_tpu_kernel_counts,
              compile_counts, compile_seconds, transfer_bytes, eager_graphs):
        c.clear()
    compile_totals[:] = [0, 0.0]
    for clear in _on_reset:
        clear()


def metrics() -> dict[str, Any]:
    """A snapshot of the counters as plain dicts. What was recorded runs first (a deferred compiled
    graph, a fused trace), so its compilation is counted when the call it belongs to returns; under
    graph capture nothing runs, and the capture's compilation is counted at its end."""
    settle.finished(pending=True)
    fold()
    return {
        "op_counts": dict(op_counts),
        "fallback_counts": dict(fallback_counts),
        "decomposition_counts": dict(decomposition_counts),
        "host_op_counts": dict(host_op_counts),
        "no_tpu_kernel_counts": dict(no_tpu_kernel_counts),
        "compile_count": sum(compile_counts.values()),  # every XLA program: per-op ones and fused traces
        "fused_compile_count": sum(n for k, n in compile_counts.items() if k.startswith("fused program ")),
        "compile_seconds": round(sum(compile_seconds.values()), 4),
        "transfer_bytes": dict(transfer_bytes),
        "eager_graphs": dict(eager_graphs),
        "program_evictions": residency.evictions[0],  # compiled programs dropped at the mapping bound
    }
