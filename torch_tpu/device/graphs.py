"""Graph capture and replay: PyTorch's CUDA-graph API on tpu (``torch.tpu.graph``, ``TPUGraph``).

A small model's training step on a fast accelerator is bound by the host: Python dispatching
hundreds of ops costs far more than the device's math. CUDA graphs remove that cost by recording
a step once and replaying it as one launch; code written for them ports here by the device name.

The semantics are CUDA graphs':

* ops run under ``with torch.tpu.graph(g):`` are recorded, not run (the fused mode's trace, in
  every mode), and compiled at the end of the region into one XLA executable;
* a tensor whose data the region reads, and which existed before it, is a *static input*: each
  ``replay()`` reads whatever array its storage holds then (the user refreshes it with ``copy_``);
* a tensor the region writes or creates is a *static output*: each replay rebinds its storage to
  the new value, in place as far as anyone holding the tensor can tell. Inputs that the region
  overwrites (parameters, optimizer state) are donated, so XLA updates them in their own buffers;
* the capture itself runs nothing: afterwards written tensors hold their values from before the
  capture, and created ones read as zeros until the first replay (CUDA leaves them uninitialised);
* random ops advance per replay: each replay hands the captured random ops the next counters of
  the device generator, as CUDA advances its Philox offset, so dropout differs per replay and a
  ``torch.manual_seed`` makes replays repeat;
* what CUDA cannot capture is refused, naming the op and the user's line: a host read (``.item()``,
  ``.cpu()``, ``print``, a sync), an op whose output shape depends on values (``nonzero``, boolean
  masks), an optimizer step with ``capturable=False`` (its step count lives on the host).

Replay is one executable call and a loop that rebinds the output storages: no dispatch, no
autograd, no tracing. Python numbers seen during capture (a learning rate) are frozen into the
graph, as in CUDA graphs; change them through tensors if they must vary.
"""

from __future__ import annotations

import itertools
import operator
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.core import rng as _rng
from torch_tpu.runtime import cache, checks, executor, fused, host_reads, metrics, residency, settle, target
from torch_tpu.tensor import storage as _storage

_MADE = object()  # the "value before the capture" of a storage the capture created
_Lazy = fused.Lazy
_NoneType = type(None)
_array_of = operator.attrgetter("_jx")  # a storage's array, read in C by map

# Hand-written kernels whose output shape depends on the values they read.
_DATA_DEPENDENT = ("nonzero", "masked_select", "unique", "bincount", "repeat_interleave", "histogram", "index")
_host_op = host_reads.what_read
_site_text = host_reads.site_text


def _refused(what: str, why: str) -> RuntimeError:
    return RuntimeError(f"tpu graph capture: {what}, at {_site_text()}, cannot be captured: {why}")


_HOST_WHY = ("a captured graph runs on the device alone, so a value cannot reach the host inside it. Read "
             "the graph's static outputs after replay() instead")


class _Capture:
    """What a capture in progress has seen, told by the storage layer (``storage._capture``)."""

    def __init__(self) -> None:
        # id(storage) -> (weak reference, its value before the capture, or _MADE)
        self.touched: dict[int, tuple[weakref.ref, Any]] = {}
        # id(array) -> (array, the storages that held it when the capture began)
        self.reads: dict[int, tuple[Any, list]] = {}
        self.rng: list[list] = []
        self.checks_before = {id(c[0]) for c in checks._pending}

    # -- the storage layer's hooks
    def made(self, st: Any) -> None:
        self.touched[id(st)] = (weakref.ref(st), _MADE)

    def _known(self, st: Any) -> bool:
        e = self.touched.get(id(st))
        return e is not None and e[0]() is st

    def wrote(self, st: Any) -> None:
        if self._known(st):
            return
        old = st._jx
        if type(old) is _Lazy and old.value is None:
            old = None  # cannot happen after the flush at capture_begin, but never keep a capture value
        self.touched[id(st)] = (weakref.ref(st), old)

    def saw(self, st: Any, a: Any) -> None:
        if self._known(st):
            return  # the capture's own value: made or written inside the region
        if type(a) is _Lazy:  # the zeros of an empty storage, recorded just now
            self.touched[id(st)] = (weakref.ref(st), None)
            return
        r = self.reads.get(id(a))
        if r is None:
            self.reads[id(a)] = (a, [st])
        elif not any(s is st for s in r[1]):
            r[1].append(st)

    def materialize(self, st: Any) -> Any:
        """An uninitialised storage from before the capture, read inside it: it gets concrete zeros
        now, so that it is a static input (the user may fill it before a replay), not a constant."""
        if self._known(st):
            return None

        a = st._jx = jnp.zeros(st._shape, _dtypes.to_jax(st._dtype))
        return a

    def host_read(self) -> None:
        raise _refused(_host_op(), _HOST_WHY)

    def host_kernel(self, op: Any, args: tuple, kwargs: dict) -> None:
        """A hand-written kernel computes on the host or on concrete arrays: captured, its result
        would be frozen. Refused when it reads a tpu tensor (a factory such as arange is a constant)."""
        flat = list(args) + list(kwargs.values())
        flat += [y for x in flat if isinstance(x, (list, tuple)) for y in x]
        if not any(_storage.is_tpu(x) for x in flat):
            return
        name = str(op)
        if "_local_scalar_dense" in name or name.startswith("aten.equal"):
            raise _refused(f"{name} (a host read: .item(), bool(), torch.equal)", _HOST_WHY)
        if any(k in name for k in _DATA_DEPENDENT):
            raise _refused(name, "its output's shape depends on the tensor's values, and a captured graph has "
                                 "fixed shapes. Use a fixed-shape form (torch.where, masked_fill, a padded index)")
        raise _refused(name, "its kernel computes on the host, so the captured graph would replay its first "
                             "result. Move it out of the captured region")

    def on_flush(self, reason: str) -> bool:
        if reason == "sync":
            raise _refused(_host_op(), _HOST_WHY)
        return True  # step ends, length caps, compiled graphs: the capture stays one trace


def _check_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
    """CUDA refuses to capture an optimizer step with ``capturable=False``; so do we: its step count
    is a CPU tensor read on the host, so every replay would repeat the captured step's values."""
    for group in optimizer.param_groups:
        if group.get("capturable") is False and not group.get("fused"):
            raise _refused(
                f"{type(optimizer).__name__}.step() with capturable=False",
                "its step count lives on the host, so every replay would repeat the captured step's bias "
                f"correction. Create it with {type(optimizer).__name__}(..., capturable=True) (or fused=True), "
                "as CUDA graphs require",
            )


_active: list[TPUGraph] = []

_KEEP_EXECUTABLES = 32
_executables: dict[tuple, Any] = {}  # the compiled graphs by what they recorded (see TPUGraph._build)


def _constant_key(w: tuple) -> tuple:
    """A wiring entry for the executable cache: a frozen number by type and exact text (1, 1.0 and
    True are equal keys in a dict, and so are 0.0 and -0.0, but not in a program)."""
    return ("k", type(w[1]), repr(w[1])) if w[0] == "k" else w


def _arg_key(x: Any) -> tuple:
    return (tuple(np.shape(x)), str(x.dtype), getattr(x, "sharding", None))


def _kept_layouts(outputs: list, inputs: list, args: list, storages_of: Callable[[Any], Any]) -> list | None:
    """Per output, the layout of the sharded input whose storage it writes back (None: XLA's
    choice), or None where no input spans several devices. The executable takes its inputs in the
    layouts they had at capture, and a replay feeds it the last replay's outputs: a state XLA chose
    to split otherwise (an optimizer moment beside a batch-split activation) would no longer fit."""
    sharded = {}
    for p, st in inputs:
        layout = getattr(args[p], "sharding", None)
        if layout is not None and len(layout.device_set) > 1:
            sharded[id(st)] = layout
    if not sharded:
        return None
    return [next((sharded[id(st)] for st in storages_of(o) if id(st) in sharded), None) for o in outputs]


def is_current_stream_capturing() -> bool:
    """Whether a graph is being captured (tpu has one stream, so: whether any is)."""
    return bool(_active)


class _Pool:
    """The handle ``graph_pool_handle()`` returns. XLA owns device memory and a graph's outputs are
    ordinary arrays, so graphs given the same pool share nothing more than they would otherwise."""

    def __repr__(self) -> str:
        return "torch.tpu graph pool handle"


def graph_pool_handle() -> _Pool:
    """A token for ``graph(pool=...)``/``capture_begin(pool=...)``, accepted for CUDA code's sake."""
    return _Pool()


class TPUGraph:
    """A captured region: ``capture_begin()``/``capture_end()`` (or ``with torch.tpu.graph(g):``),
    then ``replay()``. See the module docstring for the semantics."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._exe: Any = None
        self._pool = None
        self._capture: _Capture | None = None
        self._opt_hook: Any = None

    # -- capture
    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if _active:
            raise RuntimeError("tpu graph capture: a capture is already in progress (captures do not nest)")
        if self._exe is not None:
            raise RuntimeError("tpu graph capture: this TPUGraph already holds a graph; call reset() first")
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        executor.synchronize()  # what ran before is not part of the graph
        self._pool = pool
        cap = self._capture = _Capture()
        _active.append(self)
        executor.begin_capture_recording()
        fused.capture_hook = cap.on_flush
        _rng.capture_log = cap.rng
        _storage._capture = cap
        settle.capturing = True
        self._opt_hook = register_optimizer_step_pre_hook(_check_optimizer)

    def _stop_recording(self) -> _Capture:
        cap = self._capture
        self._capture = None
        _storage._capture = None
        settle.capturing = False
        _rng.capture_log = None
        fused.capture_hook = None
        executor.end_capture_recording()
        if self._opt_hook is not None:
            self._opt_hook.remove()
            self._opt_hook = None
        _active.remove(self)
        return cap

    def capture_end(self) -> None:
        if self._capture is None:
            raise RuntimeError("tpu graph capture: capture_end() without capture_begin()")
        with fused._lock:
            cap = self._stop_recording()
            nodes, live = fused.take_pending()
            try:
                self._build(cap, nodes, live)
            except BaseException:
                _restore(cap, live, "the graph capture failed")
                raise

    def _abort(self, error: BaseException) -> None:
        """The region raised: nothing is kept, and the tensors it touched are as before."""
        with fused._lock:
            cap = self._stop_recording()
            _, live = fused.take_pending()
            _restore(cap, live, f"the graph capture failed: {type(error).__name__}: {error}")

    def _build(self, cap: _Capture, nodes: list, live: list) -> None:
        t0 = time.perf_counter()
        live_ids = {id(r): r for r in live}
        # the static outputs: storages the region made or wrote that now hold one of its values
        out_storages: dict[int, list] = {}
        constant_writes: list[tuple[Any, Any]] = []
        made_outputs: list[tuple[Any, Any]] = []
        for ref, old in list(cap.touched.values()):
            st = ref()
            if st is None:
                continue
            cur = st._jx
            if type(cur) is _Lazy and id(cur) in live_ids:
                out_storages.setdefault(id(cur), []).append(st)
                if old is _MADE:
                    made_outputs.append((st, cur))
                else:
                    st._jx = old  # the capture ran nothing
            elif old is not _MADE and cur is not old:  # a constant written in (a host upload)
                constant_writes.append((st, cur))
                st._jx = old
        cur = None
        # deferred value checks recorded in the region become outputs, re-queued after each replay
        check_entries = [c for c in checks._pending if id(c[0]) in live_ids and id(c[0]) not in cap.checks_before]
        checks._pending[:] = [c for c in checks._pending if not any(c is e for e in check_entries)]

        position = {id(n): i for i, n in enumerate(nodes)}
        rng_at = {id(x): (k, j) for k, pair in enumerate(cap.rng) for j, x in enumerate(pair)}
        args: list = []
        arg_pos: dict[int, int] = {}
        inputs: list[tuple[int, Any]] = []  # (position, storage)
        rng_args: list[tuple[int, int, int]] = []  # (position, draw, 0 seed | 1 counter)
        key = []
        for n in nodes:
            wiring = []
            for x in n.inputs:
                t = type(x)
                if t is fused._Ref:
                    wiring.append(("n", position[id(x.node)], x.index))
                    continue
                if t is float or t is int or t is bool or t is complex:
                    wiring.append(("k", x))  # frozen into the graph, as CUDA graphs freeze kernel arguments
                    continue
                p = arg_pos.get(id(x))
                if p is None:
                    p = arg_pos[id(x)] = len(args)
                    args.append(x)
                    read = cap.reads.get(id(x))
                    if read is not None:
                        inputs.append((p, read[1][0]))
                    elif id(x) in rng_at:
                        rng_args.append((p, *rng_at[id(x)]))
                wiring.append(("a", p))
            key.append((n.program, tuple(wiring)))
        sites = [n.site for n in nodes]

        # outputs: each live value that a storage or a check holds; a donated input's replacement first
        wanted: list[tuple[int, int]] = []
        lazy_at: dict[tuple[int, int], Any] = {}
        checked = {id(x) for c in check_entries for x in (c[0], *c[1])}
        for r in live:
            if r.node is not None and (id(r) in out_storages or id(r) in checked):
                o = (position[id(r.node)], r.index)
                wanted.append(o)
                lazy_at[o] = r
        wanted.sort()
        out_of_storage = {id(st): o for o in wanted for st in out_storages.get(id(lazy_at[o]), ())}
        donate: list[int] = []
        first: list[tuple[int, int]] = []
        for p, st in inputs:
            o = out_of_storage.get(id(st))
            a = args[p]
            if o is None or o in first or len(cap.reads[id(a)][1]) > 1:
                continue
            r = lazy_at[o]
            if tuple(r.shape) == tuple(a.shape) and r.dtype == a.dtype:
                donate.append(p)
                first.append(o)
        outputs = first + [o for o in wanted if o not in first]

        def replay(*a: Any) -> list:
            env: list = []
            for program, wiring in key:
                xs = [env[w[1]][w[2]] if w[0] == "n" else a[w[1]] if w[0] == "a" else w[1] for w in wiring]
                res = program.fn(*xs)
                env.append(res if program.multi else (res,))
            return [env[i][j] for i, j in outputs]

        # A capture that recorded what an earlier one did (the same ops, constants, inputs' shapes,
        # dtypes and layouts, donations and outputs) takes its executable: a training loop captures
        # its padded last batch, whose step differs from the others only in the mask's values.
        exe_key = (tuple((program, tuple(_constant_key(w) for w in wiring)) for program, wiring in key),
                   tuple(donate), tuple(outputs), tuple(_arg_key(x) for x in args))
        compiled = _executables.get(exe_key)
        if compiled is None:
            residency.before_compile()  # may drop the other programs; captured graphs keep theirs
            try:
                layouts = _kept_layouts(outputs, inputs, args, lambda o: out_storages.get(id(lazy_at[o]), ()))
                jitted = (jax.jit(replay, donate_argnums=tuple(donate)) if layouts is None
                          else jax.jit(replay, donate_argnums=tuple(donate), out_shardings=layouts))
                compiled = jitted.lower(*args).compile()
            except Exception as e:
                raise cache._trace_error(e, tuple(key), sites) from e
            if len(_executables) >= _KEEP_EXECUTABLES:
                _executables.pop(next(iter(_executables)))
            _executables[exe_key] = compiled
            seconds = time.perf_counter() - t0
            metrics.count_compile(f"tpu graph ({len(nodes)} ops)", seconds)
        else:
            seconds = 0.0

        slot = {o: i for i, o in enumerate(outputs)}
        bound = {p for p, _ in inputs}
        if target.active():  # also compiled for the target chip (runtime.target)
            first = next((s for s in sites if s is not None), None)
            compiled = target.watch(
                compiled, kind="graph", name=f"tpu graph ({len(nodes)} ops)", fn=replay,
                ops=[program.name for program, _ in key], site=lambda: cache._site_text(first) if first else None,
                donate=tuple(donate), fixed=True,
                parts=lambda specs: target.op_parts(key, lambda w: specs[w[1]] if w[0] == "a" else w[1],
                                                    [cache._site_text(s) for s in sites]))
        self._exe = compiled
        self._template = [None if p in bound else x for p, x in enumerate(args)]  # never a static input's array
        self._inputs = inputs
        # the same lists split, for replay's loops over them in C (map), not in bytecode: a training
        # step has a few hundred inputs and outputs, and at tens of ns each the loops are its Python
        self._input_at = [p for p, _ in inputs]
        self._input_storages = [st for _, st in inputs]
        self._input_avals = {p: (tuple(args[p].shape), args[p].dtype) for p, _ in inputs}
        self._rng = rng_args
        self._draws = len(cap.rng)
        self._donate = donate
        self._bind = [(slot[o], st) for o in outputs for st in out_storages.get(id(lazy_at[o]), ())]
        self._bind_from = [i for i, _ in self._bind]
        self._bind_storages = [st for _, st in self._bind]
        self._constant_writes = constant_writes
        # a check: (flag, (first bad value, its index), error, site), each value an output slot
        self._checks = [(slot[(position[id(c[0].node)], c[0].index)],
                         tuple(slot[(position[id(x.node)], x.index)] for x in c[1]), c[2], c[3]) for c in check_entries]
        self.ops = len(nodes)
        self.compile_seconds = seconds
        # created outputs read as zeros until the first replay (CUDA leaves them uninitialised)
        for st, r in made_outputs:
            st._jx = jnp.zeros(r.shape, r.dtype)
        for r in live:
            r.node, r.error = None, RuntimeError("a value computed inside a captured tpu graph: replay() computes it")
        del args, live, nodes

    # -- replay
    def replay(self) -> None:
        """Runs the captured graph once: one executable call, then the static outputs rebound."""
        exe = self._exe
        if exe is None:
            raise RuntimeError("tpu graph: replay() before a capture ended")
        if _active:
            raise RuntimeError("tpu graph: replay() during a graph capture")
        with fused._lock:
            if fused._pending or fused._step_ended:
                fused.flush()  # ops recorded since (a copy_ into a static input) run first
            args = self._template.copy()
            values = list(map(_array_of, self._input_storages))
            kinds = set(map(type, values))
            if _Lazy in kinds or _NoneType in kinds:  # pending or never written: made concrete first
                values = [fused.concrete(_storage.base_array(st)) if type(a) is _Lazy or a is None else a
                          for a, st in zip(values, self._input_storages)]
            any(map(args.__setitem__, self._input_at, values))  # setitem answers None: runs them all
            del values
            if self._draws:
                with _rng._lock:
                    base = _rng._counter
                    _rng._counter = base + self._draws
                    seed = _rng._seed
                for p, k, which in self._rng:
                    args[p] = np.uint32(seed & 0xFFFF_FFFF if which == 0 else (base + k + 1) & 0xFFFF_FFFF)
            # references to a donated array: args, its storage, getrefcount's argument; more means
            # another tensor holds it too, which keeps its value: it gets a copy to donate instead
            counts = list(map(sys.getrefcount, map(args.__getitem__, self._donate)))
            if counts and max(counts) > 3:
                for p, n in zip(self._donate, counts):
                    if n > 3:
                        args[p] = jnp.array(args[p], copy=True)
            try:
                prof = metrics.profile
                outs = exe(*args) if prof is None else prof.timed(f"tpu graph ({self.ops} ops)", exe, *args)
            except Exception as e:
                raise self._call_error(e, args) from e
            any(map(setattr, self._bind_storages, itertools.repeat("_jx"), map(outs.__getitem__, self._bind_from)))
            for st, c in self._constant_writes:
                st._jx = c
            if self._checks:
                for fi, vis, error, site in self._checks:
                    checks._pending.append((outs[fi], tuple(outs[v] for v in vis), error, site))
                checks._settle_ready()

    def _call_error(self, e: Exception, args: list) -> Exception:
        for p, _ in self._inputs:
            a = args[p]
            shape, dtype = self._input_avals[p]
            if tuple(a.shape) != shape or a.dtype != dtype:
                return RuntimeError(
                    f"tpu graph replay: a static input changed from {dtype}{list(shape)} to "
                    f"{a.dtype}{list(a.shape)}; refresh static inputs with copy_, keeping their shape and dtype"
                )
        return RuntimeError(f"tpu graph replay failed: {type(e).__name__}: {e}")

    def reset(self) -> None:
        """Drops the graph and its references to the static tensors."""
        self._exe = None
        self._template = self._inputs = self._bind = self._constant_writes = self._checks = []
        self._input_at = self._input_storages = self._bind_from = self._bind_storages = []

    def pool(self) -> _Pool:
        """The pool handle the graph was captured with (see :func:`graph_pool_handle`)."""
        return self._pool if self._pool is not None else _Pool()

    def enable_debug_mode(self) -> None:
        """Accepted for CUDA code's sake: ``debug_dump`` works without it."""

    def debug_dump(self, debug_path: str) -> None:
        """Writes the compiled graph's HLO text to ``debug_path``."""
        if self._exe is None:
            raise RuntimeError("tpu graph: debug_dump() before a capture ended")
        with open(debug_path, "w") as f:
            f.write(self._exe.as_text())


def _restore(cap: _Capture, live: list, why: str) -> None:
    """After a failed capture: every storage touched holds its value from before, and values of the
    region say why they were never computed."""
    for ref, old in cap.touched.values():
        st = ref()
        if st is not None:
            st._jx = None if old is _MADE else old
    for r in live:
        r.node, r.error = None, RuntimeError(why)


class graph:
    """``with torch.tpu.graph(g):`` captures the body into ``g`` (CUDA's ``torch.cuda.graph``).
    ``pool`` and ``stream`` are accepted for CUDA code; tpu has one stream and XLA owns memory."""

    def __init__(self, tpu_graph: TPUGraph, pool: Any = None, stream: Any = None,
                 capture_error_mode: str = "global") -> None:
        self.tpu_graph = tpu_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode

    def __enter__(self) -> None:
        self.tpu_graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.tpu_graph._abort(exc)
            return
        self.tpu_graph.capture_end()


__all__ = ["TPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing"]
