"""``torch_tpu.profile``: a JAX profiler trace (TensorBoard, Perfetto) plus a summary of where the
time went.

While a profile is active, each program's run is timed to completion (so the figures are device
time as seen from the host, and the run is synchronous). ``summary()`` then lists the top
programs, compile time, host<->device bytes, CPU fallbacks and recompilations: what to change next.
"""

from __future__ import annotations

import collections
import os
import time
import warnings
from typing import Any

import jax

from torch_tpu.runtime import cache, executor, metrics, target


def active() -> Profile | None:
    """The profile in progress, if any (its slot is ``metrics.profile``, read on every program run)."""
    return metrics.profile


class Profile:
    """Context manager returned by :func:`profile`."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.run_seconds: collections.Counter[str] = collections.Counter()
        self.runs: collections.Counter[str] = collections.Counter()
        self._start: dict[str, Any] = {}

    def __enter__(self) -> Profile:
        executor.synchronize()
        self._tracing = self.path is not None
        if self._tracing and target.client_loaded() and jax.default_backend() != "tpu":
            warnings.warn("torch_tpu.profile: no JAX trace is written in a process that compiled for a TPU target "
                          "(with libtpu's compile-only client loaded and no TPU, JAX's profiler crashes the process); "
                          "the summary is kept", RuntimeWarning, stacklevel=2)
            self._tracing = False
        if self._tracing:
            jax.profiler.start_trace(self.path)
        m = metrics.metrics()
        self._start = {
            "compile_seconds": m["compile_seconds"] + cache.cache_stats()["compile_seconds"],
            "h2d": metrics.transfer_bytes["host_to_device"],
            "d2h": metrics.transfer_bytes["device_to_host"],
            "fallbacks": collections.Counter(metrics.fallback_counts),
            "recompiles": len(cache.recompiles),
            "t": time.perf_counter(),
        }
        metrics.profile = self
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            executor.synchronize()
        finally:
            metrics.profile = None
            self._end = {
                "compile_seconds": metrics.metrics()["compile_seconds"] + cache.cache_stats()["compile_seconds"],
                "h2d": metrics.transfer_bytes["host_to_device"],
                "d2h": metrics.transfer_bytes["device_to_host"],
                "fallbacks": collections.Counter(metrics.fallback_counts),
                "recompiles": len(cache.recompiles),
                "t": time.perf_counter(),
            }
            if self._tracing:
                jax.profiler.stop_trace()

    def timed(self, name: str, fn: Any, *args: Any) -> Any:
        """Runs ``fn(*args)`` to completion and books its time under ``name``."""
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        self.run_seconds[name] += time.perf_counter() - t0
        self.runs[name] += 1
        return out

    def summary(self, top: int = 10) -> str:
        """A table of the top programs by time, then compile time, transfers, fallbacks, recompiles."""
        end = getattr(self, "_end", None)
        if end is None:
            raise RuntimeError("torch_tpu.profile: summary() is available once the profile has ended")
        s = self._start
        total = end["t"] - s["t"]
        device = sum(self.run_seconds.values())
        lines = [f"profile: {total:.3f} s wall, {device:.3f} s in device programs" +
                 (f", trace in {self.path}" if self.path else "")]
        lines.append(f"{'program':70s} {'runs':>6s} {'seconds':>9s} {'share':>6s}")
        for name, sec in self.run_seconds.most_common(top):
            lines.append(f"{name[:70]:70s} {self.runs[name]:6d} {sec:9.4f} {sec / max(device, 1e-12):6.1%}")
        lines.append(f"compile time: {end['compile_seconds'] - s['compile_seconds']:.3f} s")
        lines.append(f"host->device: {end['h2d'] - s['h2d']:,} bytes; device->host: {end['d2h'] - s['d2h']:,} bytes")
        fb = end["fallbacks"] - s["fallbacks"]
        lines.append("CPU fallbacks: " + (", ".join(f"{k} x{v}" for k, v in fb.most_common(top)) or "none"))
        rec = cache.recompiles[s["recompiles"]:end["recompiles"]]
        lines.append(f"recompilations: {len(rec)}")
        lines += [f"  {r.site}: {r.reason}" for r in rec[:top]]
        return "\n".join(lines)


def profile(path: str | os.PathLike | None = None) -> Profile:
    """``with torch_tpu.profile("trace_dir") as prof: ...``, then ``print(prof.summary())``.

    With a path, a JAX profiler trace is written there (open it in TensorBoard or Perfetto)."""
    return Profile(path)
