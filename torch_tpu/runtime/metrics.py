"""Counters for what reached the device: ops, lowerings compiled, decompositions and CPU fallbacks.

Fallbacks are never silent: every one is counted here and warned about once per op.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

_lock = threading.Lock()
op_counts: collections.Counter[str] = collections.Counter()
fallback_counts: collections.Counter[str] = collections.Counter()
decomposition_counts: collections.Counter[str] = collections.Counter()
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


def reset() -> None:
    """Clears every counter that ``metrics()``, ``metrics_report()`` and ``cache_stats()`` show,
    the recompilation log included (the compiled programs themselves stay cached)."""
    from torch_tpu.runtime import cache

    for c in (op_counts, fallback_counts, decomposition_counts, compile_counts, compile_seconds, transfer_bytes,
              eager_graphs):
        c.clear()
    compile_totals[:] = [0, 0.0]
    cache.reset_stats()


def metrics() -> dict[str, Any]:
    """A snapshot of the counters as plain dicts. What was recorded runs first (a deferred compiled
    graph, a fused trace), so its compilation is counted when the call it belongs to returns; under
    graph capture nothing runs, and the capture's compilation is counted at its end."""
    from torch_tpu import _storage
    from torch_tpu.runtime import fused

    fused.finish_step()
    if fused.pending_count() and _storage._capture is None:
        fused.flush(reason="metrics()")
    return {
        "op_counts": dict(op_counts),
        "fallback_counts": dict(fallback_counts),
        "decomposition_counts": dict(decomposition_counts),
        "compile_count": sum(compile_counts.values()),  # every XLA program: per-op ones and fused traces
        "fused_compile_count": sum(n for k, n in compile_counts.items() if k.startswith("fused program ")),
        "compile_seconds": round(sum(compile_seconds.values()), 4),
        "transfer_bytes": dict(transfer_bytes),
        "eager_graphs": dict(eager_graphs),
    }


def metrics_report(top: int = 15) -> str:
    """The counters as a short human-readable report."""
    m = metrics()
    lines = [
        f"ops executed: {sum(op_counts.values())} ({len(op_counts)} distinct)",
        f"programs compiled: {m['compile_count']} in {m['compile_seconds']:.2f} s",
    ]
    if op_counts:
        lines.append("top ops:")
        lines += [f"  {n:>8}  {name}" for name, n in op_counts.most_common(top)]
    if decomposition_counts:
        lines.append(f"decomposed ops: {sum(decomposition_counts.values())}")
        lines += [f"  {n:>8}  {name}" for name, n in decomposition_counts.most_common(top)]
    from torch_tpu.runtime import cache

    s = cache.cache_stats()
    lines.append(
        f"fused programs: {s['requests']} runs, {s['hits']} hits, "
        f"{s['misses']} compiles in {s['compile_seconds']:.2f} s"
    )
    if cache.recompiles:
        lines.append(f"recompilations: {len(cache.recompiles)}")
        lines += [f"  {r.site}: {r.reason}" for r in cache.recompiles[-top:]]
    if fallback_counts:
        lines.append(f"CPU fallbacks: {sum(fallback_counts.values())}")
        lines += [f"  {n:>8}  {name}" for name, n in fallback_counts.most_common(top)]
    else:
        lines.append("CPU fallbacks: none")
    return "\n".join(lines)
