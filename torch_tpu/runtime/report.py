"""``torch_tpu.metrics_report()``: the counters and the fused cache's statistics, for a person.

It reads both :mod:`.metrics` and :mod:`.cache`, so it sits above them (the counters never import
the cache).
"""

from __future__ import annotations

from torch_tpu.runtime import cache, metrics


def metrics_report(top: int = 15) -> str:
    """The counters as a short human-readable report."""
    m = metrics.metrics()
    lines = [
        f"ops executed: {sum(metrics.op_counts.values())} ({len(metrics.op_counts)} distinct)",
        f"programs compiled: {m['compile_count']} in {m['compile_seconds']:.2f} s",
    ]
    if metrics.op_counts:
        lines.append("top ops:")
        lines += [f"  {n:>8}  {name}" for name, n in metrics.op_counts.most_common(top)]
    if metrics.decomposition_counts:
        lines.append(f"decomposed ops: {sum(metrics.decomposition_counts.values())}")
        lines += [f"  {n:>8}  {name}" for name, n in metrics.decomposition_counts.most_common(top)]
    if metrics.host_op_counts:
        lines.append(f"ops on the host (shapes new at every call): {sum(metrics.host_op_counts.values())}")
        lines += [f"  {n:>8}  {name}" for name, n in metrics.host_op_counts.most_common(top)]
    s = cache.cache_stats()
    lines.append(
        f"fused programs: {s['requests']} runs, {s['hits']} hits, "
        f"{s['misses']} compiles in {s['compile_seconds']:.2f} s"
    )
    if cache.recompiles:
        lines.append(f"recompilations: {len(cache.recompiles)}")
        lines += [f"  {r.site}: {r.reason}" for r in cache.recompiles[-top:]]
    if metrics.fallback_counts:
        lines.append(f"CPU fallbacks: {sum(metrics.fallback_counts.values())}")
        lines += [f"  {n:>8}  {name}" for name, n in metrics.fallback_counts.most_common(top)]
    else:
        lines.append("CPU fallbacks: none")
    return "\n".join(lines)
