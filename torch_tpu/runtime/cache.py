"""The compilation cache of fused traces: fingerprints, statistics, and why a trace recompiled.

A trace's fingerprint is its op sequence (each op's program carries its static parameters and
input signature), how the ops are wired, and the shapes and dtypes of its array inputs. Python
numbers are runtime arguments and never part of it.

When a sync point that compiled before misses the cache, the new trace is compared with the last
one seen there, and the first difference is recorded as the reason: an input whose shape or dtype
changed, or where the op sequence diverged. After ``TORCH_TPU_RECOMPILE_WARN`` (default 8)
recompilations at one site, a warning says why and what to do.

Compiled executables also persist on disk through JAX's own persistent compilation cache, under
``~/.cache/torch_tpu`` (``TORCH_TPU_CACHE_DIR``; ``off`` disables it).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import time
import warnings
from typing import Any

import jax

RECOMPILE_WARN = int(os.environ.get("TORCH_TPU_RECOMPILE_WARN", "8"))


@dataclasses.dataclass
class Entry:
    fingerprint: str
    ops: int
    outputs: frozenset
    slots: dict
    compiled: Any
    compile_seconds: float
    hits: int = 0
    last_use: float = 0.0


@dataclasses.dataclass
class Recompile:
    site: str
    reason: str


_entries: dict[Any, list[Entry]] = {}  # (trace, donated inputs) -> programs, by outputs kept
_last_key_at_site: dict[Any, Any] = {}
_site_recompiles: collections.Counter = collections.Counter()
_warned_sites: set = set()
recompiles: list[Recompile] = []
_stats = {"requests": 0, "hits": 0, "misses": 0, "compile_seconds": 0.0}


def _site_text(site: tuple[str, int] | None) -> str:
    return f"{site[0]}:{site[1]}" if site else "<unknown>"


def _fingerprint(key: Any) -> str:
    h = hashlib.sha1()
    for program, wiring in key:
        h.update(program.name.encode())
        h.update(repr(wiring).encode())
    return h.hexdigest()[:16]


def explain(old: Any, new: Any, sites: list) -> str:
    """The first difference between two traces recorded at the same sync point."""
    for i, ((p_old, w_old), (p_new, w_new)) in enumerate(zip(old, new)):
        if p_old is not p_new:
            if p_old.name.split("(")[0] == p_new.name.split("(")[0]:
                return f"op #{i} {p_new.name.split('(')[0]} changed its inputs: {p_old.name} -> {p_new.name}"
            return (
                f"the op sequence diverged at op #{i} (recorded at {_site_text(sites[i])}): "
                f"{p_old.name} -> {p_new.name}"
            )
        if w_old != w_new:
            for k, (a, b) in enumerate(zip(w_old, w_new)):
                if a != b:
                    if a[0] == "a" and b[0] == "a" and a[2:4] == b[2:4]:
                        return f"input {k} of op #{i} {p_new.name.split('(')[0]} changed its sharding: {a[4]} -> {b[4]}"
                    if a[0] == "a" and b[0] == "a":
                        return (
                            f"input {k} of op #{i} {p_new.name.split('(')[0]} changed from "
                            f"{a[3]}{list(a[2])} to {b[3]}{list(b[2])}"
                        )
                    return f"input {k} of op #{i} {p_new.name.split('(')[0]} changed kind: {a[0]} -> {b[0]}"
    if len(old) != len(new):
        where = _site_text(sites[min(len(old), len(new)) - 1])
        return f"the trace has {len(new)} ops instead of {len(old)} (recorded at {where})"
    return "the same ops, but other values are kept alive as outputs"


def _site_key(flush_site: Any, reason: str, key: Any) -> tuple:
    """Where a trace comes from: the sync point, and the op that starts the trace (its name without
    the signature). One line may end several different traces in a step (a loss read, then an
    optimizer's own reads); only traces of the same family are compared with each other."""
    return flush_site, reason, key[0][0].name.split("(")[0] if key else ""


def _build(key: Any, donate: tuple[int, ...], outputs: list, args: list) -> tuple[Any, float]:
    def replay(*a: Any) -> list:
        env: list = []
        for program, wiring in key:
            xs = [env[w[1]][w[2]] if w[0] == "n" else a[w[1]] for w in wiring]
            r = program.fn(*xs)
            env.append(r if program.multi else (r,))
        return [env[i][j] for i, j in outputs]

    t0 = time.perf_counter()
    compiled = jax.jit(replay, donate_argnums=donate).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _choose(variants: list[Entry], want: list) -> Entry | None:
    """Among the programs compiled for one trace, the one whose outputs are exactly those wanted,
    else the smallest that has them all (a loop that reads the loss after some steps keeps the
    gradients alive then, and must not make every other step write them out)."""
    wanted = frozenset(want)
    best = None
    for e in variants:
        if e.outputs == wanted:
            return e
        if e.outputs.issuperset(wanted) and (best is None or len(e.outputs) < len(best.outputs)):
            best = e
    return best


def run_trace(
    key: Any, donate: tuple[int, ...], want: list, args: list, sites: list, flush_site: Any, reason: str
) -> tuple[list, dict]:
    """Runs one trace: a cached executable when its fingerprint matches, else a fresh compile.
    ``donate``: the positions of inputs whose buffers the program may reuse."""
    _stats["requests"] += 1
    variants = _entries.get((key, donate))
    entry = _choose(variants, want) if variants else None
    if entry is None:
        outputs = list(want)  # its order pairs donated inputs with the outputs that replace them
        try:
            compiled, seconds = _build(key, donate, outputs, args)
        except Exception as e:
            _trace_error(e, key, sites)
        site = _site_key(flush_site, reason, key)
        previous = _last_key_at_site.get(site)
        if previous is not None or variants:
            why = "other values are kept alive as outputs" if variants else explain(previous, key, sites)
            _record_recompile(site, why)
        _last_key_at_site[site] = key
        entry = Entry(
            fingerprint=_fingerprint(key),
            ops=len(key),
            outputs=frozenset(outputs),
            slots={o: i for i, o in enumerate(outputs)},
            compiled=compiled,
            compile_seconds=seconds,
        )
        _entries.setdefault((key, donate), []).append(entry)
        _stats["misses"] += 1
        _stats["compile_seconds"] += seconds
    else:
        entry.hits += 1
        _stats["hits"] += 1
        _last_key_at_site[_site_key(flush_site, reason, key)] = key
    entry.last_use = time.time()
    from torch_tpu.runtime import profiler

    try:
        prof = profiler.active()
        if prof is None:
            values = entry.compiled(*args)
        else:
            values = prof.timed(f"fused program {entry.fingerprint} ({entry.ops} ops)", entry.compiled, *args)
    except Exception as e:
        from torch_tpu.runtime.executor import raise_named

        raise_named(e, f"the fused program of {len(key)} ops (fingerprint {entry.fingerprint}) failed")
    return values, entry.slots


def _trace_error(e: Exception, key: Any, sites: list) -> None:
    """Raises ``e`` with its own type, naming the op (and the user's line that recorded it) whose
    lowering failed."""
    from torch_tpu.runtime.executor import raise_named

    tb = e.__traceback__
    failing = None
    while tb is not None:  # the innermost replay frame knows which program was running
        if tb.tb_frame.f_code.co_name == "replay" and "program" in tb.tb_frame.f_locals:
            failing = tb.tb_frame.f_locals["program"]
        tb = tb.tb_next
    if failing is not None:
        i = next((k for k, (p, _) in enumerate(key) if p is failing), None)
        where = _site_text(sites[i]) if i is not None else "<unknown>"
        raise_named(e, f"{failing.name}, recorded at {where}")
    raise_named(e, f"a fused program of {len(key)} ops failed to compile")


def _record_recompile(site: Any, why: str) -> None:
    text = f"{_site_text(site[0])} ({site[1]}, trace starting with {site[2]})"
    recompiles.append(Recompile(text, why))
    _site_recompiles[site] += 1
    if _site_recompiles[site] >= RECOMPILE_WARN and site not in _warned_sites:
        _warned_sites.add(site)
        message = (
            f"tpu: the fused program at {text} recompiled {_site_recompiles[site]} times; last reason: {why}. "
            "Shapes that change every step recompile every step: pad or bucket them, or use "
            "DataLoader(drop_last=True) so the last batch has the same size."
        )
        if site[0] is not None:  # attributed to the user's line that ended the trace
            warnings.warn_explicit(message, UserWarning, site[0][0], site[0][1])
        else:
            warnings.warn(message, stacklevel=4)


def cache_stats() -> dict[str, Any]:
    """Requests, hits, misses and compile seconds of fused traces, overall and per entry. A
    training step that ended (its trace waits for the next op) runs first, so it is counted."""
    from torch_tpu.runtime import fused

    fused.finish_step()
    return {
        **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in _stats.items()},
        "entries": [
            {
                "fingerprint": e.fingerprint,
                "ops": e.ops,
                "outputs": len(e.outputs),
                "hits": e.hits,
                "compile_seconds": round(e.compile_seconds, 4),
                "last_use": e.last_use,
            }
            for variants in _entries.values()
            for e in variants
        ],
    }


def reset_stats() -> None:
    """Zeroes the counters and the recompilation log (compiled entries stay)."""
    _stats.update(requests=0, hits=0, misses=0, compile_seconds=0.0)
    for variants in _entries.values():
        for e in variants:
            e.hits = 0
    recompiles.clear()
    _site_recompiles.clear()
    _warned_sites.clear()


def configure_persistent_cache() -> str | None:
    """Points JAX's persistent compilation cache at the torch_tpu cache directory, in a folder per
    number of CPU cores this process may use: XLA:CPU compiles its split of the work across threads
    into the executable, and JAX's cache key does not hold it, so a program compiled under
    ``taskset -c 0`` would otherwise run on one core in every later process."""
    where = os.environ.get("TORCH_TPU_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_tpu"))
    if where.lower() == "off":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    where = os.path.join(where, f"cpus-{cores}")
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as e:  # a read-only home, a path through a file: run on, without the disk cache
        warnings.warn(
            f"tpu: the compilation cache directory {where} cannot be created ({e}); compiled programs will not "
            "persist across processes. Set TORCH_TPU_CACHE_DIR to a writable directory, or to 'off'.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    jax.config.update("jax_compilation_cache_dir", where)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(
        os.environ.get("TORCH_TPU_CACHE_MIN_COMPILE_SECONDS", "0.1")))
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return where
