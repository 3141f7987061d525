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
import weakref
from typing import Any

import jax
import numpy as np
from jax._src.lax.lax import _convert_element_type

from torch_tpu.runtime import metrics, residency, settle, target
from torch_tpu.runtime.errors import raise_named

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


def _op_name(program: Any) -> str:
    return program.name.split("(")[0]


def _spec_text(v: Any) -> str:
    """One argument of an op's signature in words (the dispatcher's signature types by name, so
    this module need not import the dispatcher)."""
    kind = type(v).__name__
    if kind == "_Tensor":
        return f"{str(v[1]).removeprefix('torch.')}{list(v[0])}"
    if kind == "_View":
        return (f"a view {str(v[1]).removeprefix('torch.')}{list(v[0])} of a {list(v[2])} storage "
                f"(stride {list(v[3])}, offset {v[4]})")
    if kind == "_Empty":
        return f"an uninitialised {str(v[1]).removeprefix('torch.')}{list(v[0])}"
    if kind == "_Scalar":
        return f"a runtime {getattr(v[0], '__name__', str(v[0]).removeprefix('torch.'))}"
    if type(v) is int:
        return f"the Python int {v}"
    if type(v) is bool:
        return f"the Python bool {v}"
    if type(v) is float:
        return f"the Python float {v!r}"
    return repr(v)


def _first_leaf_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """The first place where two signature values differ: (where, old leaf, new leaf)."""
    if type(a) is tuple and type(b) is tuple and len(a) == len(b):
        for k, (x, y) in enumerate(zip(a, b)):
            found = _first_leaf_difference(x, y, f"{path}[{k}]")
            if found is not None:
                return found
        return None
    if type(a) is not type(b) or a != b:
        return path, a, b
    return None


def _hint(a: Any, b: Any) -> str:
    """Why such a difference compiles, and what to do about it."""
    ka, kb = type(a).__name__, type(b).__name__
    if type(a) is int and type(b) is int:
        return (" (Python ints are compile-time constants: each value compiles its own program; pass a tensor, "
                "or a float, where the value changes every step)")
    if ka == kb == "_View" and a[2] != b[2]:
        if not _growth_hint(tuple(a[2]), tuple(b[2])):
            return " (the storage it views has another shape)"
        return (" (the storage it views grew by one: a tensor that grows every step, such as a sequence "
                "extended by torch.cat in a decoding loop or a dynamic KV cache, compiles a program per length; "
                "preallocate it at its final size, e.g. a static cache)")
    if ka == kb == "_Tensor" and a[0] != b[0]:
        return _growth_hint(a[0], b[0])
    return ""


def _growth_hint(old: tuple, new: tuple) -> str:
    if len(old) == len(new) and sum(x != y for x, y in zip(old, new)) == 1:
        d = next(k for k, (x, y) in enumerate(zip(old, new)) if x != y)
        if new[d] == old[d] + 1:
            return (f" (dim {d} grew by one: a tensor that grows every step, such as a sequence extended by "
                    "torch.cat in a decoding loop or a dynamic KV cache, compiles a program per length; "
                    "preallocate it at its final size, e.g. a static cache)")
    return ""


def _program_difference(i: int, old: Any, new: Any, where: str) -> str:
    """Two programs of the same op: which part of what they are specialised on differs."""
    head = f"op #{i} {_op_name(new)} (recorded at {where})"
    ka, kb = old.key, new.key
    if ka is not None and kb is not None:
        da, db = dict(ka), dict(kb)
        labels = [k for k, _ in kb] + [k for k, _ in ka if k not in db]
        for label in labels:
            if label not in da or label not in db:
                va, vb = (_spec_text(da[label]) if label in da else "its default",
                          _spec_text(db[label]) if label in db else "its default")
                return f"{head}: argument '{label}' changed from {va} to {vb}"
            found = _first_leaf_difference(da[label], db[label], f"argument '{label}'")
            if found is not None:
                path, a, b = found
                return f"{head}: {path} changed from {_spec_text(a)} to {_spec_text(b)}{_hint(a, b)}"
    if old.name != new.name:
        return f"{head} changed its inputs: {old.name} -> {new.name}"
    return (f"{head} is another program with the same signature ({new.name}): it was built anew "
            "(a torch.compile graph that Dynamo recompiled, or a custom op defined again)")


def _wire_text(w: tuple) -> str:
    if w[0] == "n":
        return f"output {w[2]} of op #{w[1]}"
    if w[0] == "s":
        return f"a runtime {w[2].__name__} (argument {w[1]})"
    if w[0] == "f":
        return f"a runtime float (number {w[1]} of the trace)"
    return f"input array #{w[1]} ({str(w[3])}{list(w[2])})"


def explain(old: tuple, new: tuple, sites: list) -> str:
    """The first difference between two traces recorded at the same sync point. ``old``, ``new``:
    (trace key, donated inputs, outputs kept). The ops are compared first, then their wiring, then
    the donated buffers and the outputs kept: the text never shows two equal signatures."""
    (k_old, d_old, o_old), (k_new, d_new, o_new) = old, new

    def where(i: int) -> str:
        return _site_text(sites[i]) if i < len(sites) else "<unknown>"

    first_arrays_old: dict[int, tuple] = {}
    first_arrays_new: dict[int, tuple] = {}
    for i, ((p_old, w_old), (p_new, w_new)) in enumerate(zip(k_old, k_new)):
        if p_old is not p_new:
            if _op_name(p_old) == _op_name(p_new):
                return _program_difference(i, p_old, p_new, where(i))
            return f"the op sequence diverged at op #{i} (recorded at {where(i)}): {p_old.name} -> {p_new.name}"
        for k, (a, b) in enumerate(zip(w_old, w_new)):
            head = f"input {k} of op #{i} {_op_name(p_new)} (recorded at {where(i)})"
            if a == b:
                if a[0] == "a":
                    first_arrays_old.setdefault(a[1], (i, k))
                    first_arrays_new.setdefault(b[1], (i, k))
                continue
            if a[0] == "a" and b[0] == "a":
                if a[2:4] != b[2:4]:
                    return (f"{head} changed from {a[3]}{list(a[2])} to {b[3]}{list(b[2])}"
                            f"{_growth_hint(tuple(a[2]), tuple(b[2]))}")
                if a[4] != b[4]:
                    return f"{head} changed its sharding: {a[4]} -> {b[4]}"
                # the same shape: which array it is, relative to the other inputs, changed
                seen_old, seen_new = first_arrays_old.get(a[1]), first_arrays_new.get(b[1])
                if seen_new is not None:
                    return (f"{head} is now the same array as input {seen_new[1]} of op #{seen_new[0]} "
                            "(an input's identity changed: two uses now share one array)")
                if seen_old is not None:
                    return (f"{head} was the same array as input {seen_old[1]} of op #{seen_old[0]}, now a "
                            "different one (an input's identity changed: one array is now two)")
                return f"{head} is another input array: #{a[1]} -> #{b[1]} (the inputs' order or aliasing changed)"
            if a[0] == "n" and b[0] == "n":
                return f"{head} is wired differently: {_wire_text(a)} -> {_wire_text(b)}"
            return f"{head} changed kind: {_wire_text(a)} -> {_wire_text(b)}"
        if len(w_old) != len(w_new):
            return f"op #{i} {_op_name(p_new)} (recorded at {where(i)}) has {len(w_new)} inputs instead of {len(w_old)}"
    if len(k_old) != len(k_new):
        at = min(len(k_old), len(k_new))
        extra = k_new[at][0].name if len(k_new) > at else k_old[at][0].name
        which = "new" if len(k_new) > at else "missing"
        return (f"the trace has {len(k_new)} ops instead of {len(k_old)} (first {which} op #{at}: {extra}, "
                f"recorded at {where(at) if len(k_new) > at else where(at - 1)})")
    if d_old != d_new:
        return (f"the donated input buffers changed: arrays {list(d_old)} -> {list(d_new)} (an input is donated when "
                "nothing outside the trace still holds it; keeping a reference to an old value, or dropping one, "
                "changes that)")
    return _outputs_difference(o_old, o_new, k_new)


def _outputs_difference(o_old: Any, o_new: Any, key: Any) -> str:
    gone, added = sorted(set(o_old) - set(o_new)), sorted(set(o_new) - set(o_old))

    def text(outs: list) -> str:
        shown = ", ".join(f"output {j} of op #{i} {_op_name(key[i][0])}" for i, j in outs[:3])
        return shown + (f" and {len(outs) - 3} more" if len(outs) > 3 else "")

    parts = []
    if added:
        parts.append(f"now also kept: {text(added)}")
    if gone:
        parts.append(f"no longer kept: {text(gone)}")
    return ("the same ops, but other values are kept alive as outputs (" + "; ".join(parts or ["the same set"]) +
            "): a tensor still referenced after the sync point is an output of the program")


def _site_key(flush_site: Any, reason: str, key: Any) -> tuple:
    """Where a trace comes from: the sync point, and the op that starts the trace (its name without
    the signature). One line may end several different traces in a step (a loss read, then an
    optimizer's own reads); only traces of the same family are compared with each other."""
    return flush_site, reason, key[0][0].name.split("(")[0] if key else ""


def _weak_float(numbers: Any, i: int) -> Any:
    """Element ``i`` of the trace's float vector as the program saw a Python float: a weakly typed
    scalar, so that ``x * lr`` keeps ``x``'s dtype."""
    return _convert_element_type(numbers[i], jax.dtypes.canonicalize_dtype(np.float64), weak_type=True)


def _replay(key: Any, outputs: list) -> Any:
    """The trace as one function of its inputs: each op's program on the outputs of those before."""

    def replay(*a: Any) -> list:
        env: list = []
        numbers = a[-1] if a else None  # the runtime floats, when the trace has any ("f" entries): the last argument
        for program, wiring in key:
            xs = [env[w[1]][w[2]] if w[0] == "n" else _weak_float(numbers, w[1]) if w[0] == "f" else a[w[1]]
                  for w in wiring]
            r = program.fn(*xs)
            env.append(r if program.multi else (r,))
        return [env[i][j] for i, j in outputs]

    return replay


def _build(key: Any, donate: tuple[int, ...], outputs: list, args: list) -> tuple[Any, float]:
    t0 = time.perf_counter()
    compiled = jax.jit(_replay(key, outputs), donate_argnums=donate).lower(*args).compile()
    return compiled, time.perf_counter() - t0


def _watched(compiled: Any, key: Any, donate: tuple[int, ...], outputs: list, sites: list, fingerprint: str) -> Any:
    """A trace's executable, also compiled for the target chip where one is set (runtime.target)."""
    if not target.active():
        return compiled
    first = next((s for s in sites if s is not None), None)
    return target.watch(
        compiled, kind="fused", name=f"fused program {fingerprint} ({len(key)} ops)", fn=_replay(key, outputs),
        ops=[program.name for program, _ in key], site=lambda: _site_text(first) if first else None,
        donate=donate, fixed=True,
        parts=lambda specs: target.op_parts(key, lambda w: _weak_float_spec() if w[0] == "f" else specs[w[1]],
                                            [_site_text(s) for s in sites]))


def _weak_float_spec() -> Any:
    """A runtime float of a trace, as :func:`_weak_float` gives it to the program."""
    return jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(np.float64), weak_type=True)


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
) -> tuple[list, Entry]:
    """Runs one trace: a cached executable when its fingerprint matches, else a fresh compile.
    ``donate``: the positions of inputs whose buffers the program may reuse. Returns the outputs
    and the entry that ran (its ``slots`` place each wanted output among them)."""
    variants = _entries.get((key, donate))
    entry = _choose(variants, want) if variants else None
    if entry is not None:
        return run_entry(entry, key, donate, want, args, flush_site, reason), entry
    _stats["requests"] += 1
    outputs = list(want)  # its order pairs donated inputs with the outputs that replace them
    residency.before_compile()
    try:
        compiled, seconds = _build(key, donate, outputs, args)
    except Exception as e:
        _trace_error(e, key, sites)
    site = _site_key(flush_site, reason, key)
    previous = _last_key_at_site.get(site)
    now = (key, donate, frozenset(outputs))
    if variants:  # the same trace and donations: the outputs kept differ from every compiled variant
        closest = min(variants, key=lambda e: len(e.outputs ^ now[2]))
        _record_recompile(site, _outputs_difference(closest.outputs, now[2], key))
    elif previous is not None:
        _record_recompile(site, explain(previous, now, sites))
    _last_key_at_site[site] = now
    fingerprint = _fingerprint(key)
    entry = Entry(
        fingerprint=fingerprint,
        ops=len(key),
        outputs=frozenset(outputs),
        slots={o: i for i, o in enumerate(outputs)},
        compiled=_watched(compiled, key, donate, outputs, sites, fingerprint),
        compile_seconds=seconds,
    )
    _entries.setdefault((key, donate), []).append(entry)
    _stats["misses"] += 1
    _stats["compile_seconds"] += seconds
    metrics.count_compile(f"fused program {entry.fingerprint} ({entry.ops} ops)", seconds)
    entry.last_use = time.time()
    return _call(entry, key, args), entry


def run_entry(entry: Entry, key: Any, donate: tuple[int, ...], want: list, args: list, flush_site: Any,
              reason: str) -> list:
    """Runs a trace whose compiled entry is known (a cache hit): counted as :func:`run_trace`
    counts a hit. The fused trace's replay path calls this directly when a trace repeats the last
    one of its op sequence exactly (``fused._Template``), skipping the fingerprint lookup."""
    _stats["requests"] += 1
    entry.hits += 1
    _stats["hits"] += 1
    _last_key_at_site[_site_key(flush_site, reason, key)] = (key, donate, want)  # a set only if explained
    entry.last_use = time.time()
    return _call(entry, key, args)


def _call(entry: Entry, key: Any, args: list) -> list:
    try:
        prof = metrics.profile
        if prof is None:
            return entry.compiled(*args)
        return prof.timed(f"fused program {entry.fingerprint} ({entry.ops} ops)", entry.compiled, *args)
    except Exception as e:
        raise_named(e, f"the fused program of {len(key)} ops (fingerprint {entry.fingerprint}) failed")
        raise  # raise_named always raises


def _trace_error(e: Exception, key: Any, sites: list) -> None:
    """Raises ``e`` with its own type, naming the op (and the user's line that recorded it) whose
    lowering failed."""
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


def note_program_compile(program: Any, site: tuple[str, int] | None) -> None:
    """A program compiling as it runs on its own (strict and debug modes, one op each): when the same
    op at the same user line compiled another program before, that is a recompile, explained and
    warned about as a fused trace's is (the default mode's decoding loop that grows a sequence
    is told so)."""
    if site is None:  # no user line to attribute it to (torch's own code, autograd's thread)
        return
    op = _op_name(program)
    k = (site, op)
    ref = _last_programs.get(k)
    old = ref() if ref is not None else None
    _last_programs[k] = weakref.ref(program)
    if old is not None and old is not program:
        why = _program_difference(0, old, program, _site_text(site)).removeprefix("op #0 ")
        _record_recompile((site, "op", op), why, f"{op} at {_site_text(site)}")


_last_programs: dict[tuple, Any] = {}  # (user site, op) -> a weak reference to its last compiled program


def _record_recompile(site: Any, why: str, what: str | None = None) -> None:
    """Keeps the reason, and warns once a site has recompiled ``RECOMPILE_WARN`` times. ``what``
    names a single op's program (strict mode: "aten.cat.default at file:line"): one line of a
    model serving several shapes is normal there, so such a site is warned about only for a
    sequence that grows."""
    text = f"{_site_text(site[0])} ({site[1]}, trace starting with {site[2]})"
    if what is not None:
        text = what
    recompiles.append(Recompile(text, why))
    _site_recompiles[site] += 1
    grows = "grows every step" in why or "grew by one" in why
    if _site_recompiles[site] >= RECOMPILE_WARN and site not in _warned_sites and (grows or what is None):
        _warned_sites.add(site)
        if grows:  # the reason already says what to do
            advice = ("A decoding loop whose sequence or KV cache grows by a token per step compiles one program "
                      "per length: use a static cache (generate(..., cache_implementation='static')) and "
                      "fixed-size buffers; see docs/inference.md.")
        else:
            advice = ("Shapes that change every step recompile every step: pad or bucket them, or use "
                      "DataLoader(drop_last=True) so the last batch has the same size.")
        count = _site_recompiles[site]
        if what is None:
            message = f"tpu: the fused program at {text} recompiled {count} times; last reason: {why}. {advice}"
        else:
            message = f"tpu: the program of {what} recompiled {count} times; last reason: {why}. {advice}"
        if site[0] is not None:  # attributed to the user's line that ended the trace
            warnings.warn_explicit(message, UserWarning, site[0][0], site[0][1])
        else:
            warnings.warn(message, stacklevel=4)


def cache_stats() -> dict[str, Any]:
    """Requests, hits, misses and compile seconds of fused traces, overall and per entry. A
    training step that ended (its trace waits for the next op) runs first, so it is counted."""
    settle.finished(pending=False)
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


metrics.on_reset(reset_stats)
residency.on_evict(_entries.clear)


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
