"""A target TPU chip: every program that runs here is also compiled for it, and projected.

libtpu (a PyPI package) with JAX's compile-only TPU topology compiles a program for a real TPU chip
on a machine that has none. The result is XLA:TPU's own executable: what fails to compile there fails
on a TPU, and its cost and memory analyses are the TPU compiler's own figures. With a target set
(``TORCH_TPU_TARGET=v5e``, or :func:`set_target`), each program the executor compiles for the local
platform (an op's program, a fused trace, a captured graph, a ``torch.compile`` graph) is compiled
for the target too, once per input signature, on a worker thread: a TPU compile takes from 0.1 s to
tens of seconds on a CPU, and the run does not wait for it. :func:`report` waits for the pending
compiles, then gives per program XLA:TPU's cost and memory analysis, each failure with its ops and
the user's line, and, over the steps marked with :func:`step`, the projected device ms, the host ms
measured here, the projected steps/s and MFU, and whether a step is host- or device-bound.

A program that does not compile for the target is reported once, as a warning naming its ops and
the user's line (as a CPU fallback is); ``TORCH_TPU_TARGET_STRICT=1`` waits for each compile and
raises :class:`TargetCompileError` instead.

Programs are wrapped where they are compiled (:func:`watch`), so that nothing is added to the
executor's path while no target is set; setting or changing the target drops the compiled programs
(they compile again, from JAX's persistent cache), so that all of them are watched.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np

from torch_tpu.core import devices
from torch_tpu.runtime import residency


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's published per-chip figures: the roofline's peaks and the HBM to fit in."""

    name: str
    topology: str  # the smallest slice JAX's compile-only topology knows for it
    peak_flops: float  # dense bfloat16, per chip
    hbm_bytes: int
    hbm_bytes_per_s: float


CHIPS = {
    "v4": Chip("v4", "v4:2x2x1", 275e12, 32 * 2**30, 1.2e12),
    "v5e": Chip("v5e", "v5e:2x2", 197e12, 16 * 2**30, 819e9),
    "v5p": Chip("v5p", "v5p:2x2x1", 459e12, 95 * 2**30, 2.765e12),
    "v6e": Chip("v6e", "v6e:2x2", 918e12, 32 * 2**30, 1.64e12),
}


class TargetCompileError(RuntimeError):
    """A program did not compile for the target chip (``TORCH_TPU_TARGET_STRICT=1``)."""


@dataclasses.dataclass
class Result:
    """One program compiled for the target, for one input signature."""

    kind: str  # "op", "fused", "graph"
    name: str
    ops: list[str]
    site: str | None
    calls: int = 0
    ok: bool | None = None  # None while the compile is pending
    error: str = ""
    blamed: list[str] = dataclasses.field(default_factory=list)  # of a failed trace: the ops that fail alone
    cost: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)
    chips: int = 1  # the chips an SPMD program is partitioned over; its figures are per chip
    x64: dict = dataclasses.field(default_factory=dict)  # its 64-bit ops (see x64_figures)
    future: Any = None
    # inputs the program refuses on the local platform as well (a graph replayed with a static
    # input of another shape): the call raises its own error there, and there is nothing to compile
    refused: bool = False

    def device_seconds(self, chip: Chip) -> tuple[float, str]:
        """XLA:TPU's own time estimate where it gives one, else the roofline of its flops and bytes."""
        xla = self.cost.get("optimal_seconds", -1.0)
        if xla is not None and xla > 0:
            return float(xla), "xla"
        return roofline(self.cost.get("flops", 0.0), self.cost.get("bytes accessed", 0.0), chip), "roofline"


def roofline(flops: float, bytes_accessed: float, chip: Chip) -> float:
    """The time a program needs at the chip's peak compute or peak HBM bandwidth, whichever binds."""
    return max(flops / chip.peak_flops, bytes_accessed / chip.hbm_bytes_per_s)


class Target:
    """A chip and a topology, with the one-chip sharding programs are compiled for, and the slice's
    chips that a program sharded over several local devices is placed on."""

    def __init__(self, spec: str) -> None:
        spec = spec.strip().lower()
        chip_name, _, shape = spec.partition(":")
        if chip_name not in CHIPS:
            raise ValueError(f"TORCH_TPU_TARGET={spec!r}: expected one of {', '.join(CHIPS)}, or a topology "
                             "such as 'v5e:2x4'")
        self.chip = CHIPS[chip_name]
        self.topology = spec if shape else self.chip.topology
        self._on_chip: Any = None
        self.devices: list = []  # the topology's chips, in JAX's order

    def on_chip(self) -> Any:
        if self._on_chip is None:
            from jax.experimental import topologies
            from jax.sharding import Mesh, NamedSharding, PartitionSpec

            devices.quiet_libtpu_without_a_tpu()  # libtpu's compile-only client, with no TPU to ask about
            try:
                topo = topologies.get_topology_desc(topology_name=self.topology, platform="tpu")
            except Exception as e:  # noqa: BLE001 - no libtpu, or a topology it does not know
                raise RuntimeError(f"tpu target {self.topology}: JAX's compile-only TPU topology is unavailable "
                                   f"({type(e).__name__}: {e}); it needs libtpu (pip install libtpu)") from e
            _client_loaded[0] = True
            _keep_tpu_executables_out_of_the_persistent_cache()
            self.devices = list(topo.devices)
            self._on_chip = NamedSharding(Mesh(np.array(self.devices[:1]), ("chip",)), PartitionSpec())
        return self._on_chip

    def place(self, specs: list) -> tuple[list, int]:
        """``specs`` (the program's inputs as shape structs, a sharded one with its local sharding)
        placed on the target, and the number of chips the program spans.

        With no input spread over several local devices, every input goes on one chip. Otherwise the
        local devices the inputs span map, in their local order, onto the topology's first chips,
        each sharding keeps its mesh's shape, axis names and partition spec there, and an input on
        one device is left for XLA to place (as jit does with an uncommitted array beside sharded
        ones). A program over more devices than the topology has chips raises, naming both."""
        sharded = [s for s in _leaves(specs) if isinstance(s, jax.ShapeDtypeStruct) and s.sharding is not None]
        if not sharded:
            one = self.on_chip()
            return _map_leaves(specs, lambda x: _spec(x, one)), 1
        self.on_chip()
        local = {d: i for i, d in enumerate(jax.devices())}
        spanned = sorted({d for s in sharded for d in s.sharding.device_set}, key=lambda d: local.get(d, d.id))
        if len(spanned) > len(self.devices):
            raise ValueError(f"the program is sharded over {len(spanned)} devices, and the target topology "
                             f"{self.topology} has {len(self.devices)} chips: set a larger one "
                             f"(TORCH_TPU_TARGET={self.chip.name}:2x4, for example)")
        chip_of = {d: self.devices[i] for i, d in enumerate(spanned)}

        def placed(x: Any) -> Any:
            if not isinstance(x, jax.ShapeDtypeStruct) or x.sharding is None:
                return _spec(x, None)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type,
                                        sharding=_moved(x.sharding, chip_of, len(x.shape)))

        return _map_leaves(specs, placed), len(spanned)

    def __repr__(self) -> str:
        return f"Target({self.topology})"


def _moved(sharding: Any, chip_of: dict, ndim: int) -> Any:
    """A local multi-device sharding re-made over the chips ``chip_of`` maps its devices to."""
    from jax.sharding import Mesh, NamedSharding

    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        chips = np.vectorize(chip_of.__getitem__, otypes=[object])(mesh.devices)
        return NamedSharding(Mesh(chips, mesh.axis_names, axis_types=mesh.axis_types), sharding.spec,
                             memory_kind=None)
    from jax._src.sharding_impls import GSPMDSharding  # the other shardings jit's outputs carry

    return GSPMDSharding([chip_of[d] for d in sharding._device_assignment], sharding._to_xla_hlo_sharding(ndim))


def _leaves(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [leaf for y in x for leaf in _leaves(y)]
    if isinstance(x, dict):
        return [leaf for y in x.values() for leaf in _leaves(y)]
    return [x]


def _map_leaves(x: Any, f: Callable[[Any], Any]) -> Any:
    if isinstance(x, (list, tuple)):
        return type(x)(_map_leaves(y, f) for y in x)
    if isinstance(x, dict):
        return {k: _map_leaves(v, f) for k, v in x.items()}
    return f(x)


def _local_spec(x: Any) -> Any:
    """An input as a shape struct, carrying its sharding where it spans several local devices."""
    sharding = getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
    if sharding is not None and len(sharding.device_set) < 2:
        sharding = None
    return _spec(x, sharding)


_client_loaded = [False]  # libtpu's compile-only client was made in this process (see runtime.profiler)
_target: Target | None = None
_strict = os.environ.get("TORCH_TPU_TARGET_STRICT", "") == "1"
_lock = threading.Lock()
_results: list[Result] = []
_generation = [0]  # bumped by reset(): each watched program's results belong to one generation
_unreported: list[Result] = []
_host_ops: dict[str, int] = {}  # op -> calls run on the host for want of a TPU kernel
_steps: list[tuple[float, dict[int, int]]] = []  # (host seconds, {result index: calls}) per marked step
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def client_loaded() -> bool:
    """Whether this process made libtpu's compile-only client (it stays loaded for the process)."""
    return _client_loaded[0]


def active() -> bool:
    return _target is not None


def current() -> Target | None:
    return _target


def available() -> bool:
    """Whether libtpu is installed, which a TPU target needs."""
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def set_target(spec: str | None) -> contextlib.AbstractContextManager:
    """Sets the target chip (``"v5e"``, ``"v5e:2x4"``; None: none) from now on; also a context
    manager that restores the previous target on exit. The programs compiled so far are dropped, so
    that each compiles again (from JAX's persistent cache) and is watched."""
    global _target
    previous = _target
    target = None if spec is None else Target(spec)
    if target is not None:
        target.on_chip()  # fails now, naming what is missing, not on the worker thread
    _target = target
    reset()
    residency.drop_programs()

    @contextlib.contextmanager
    def restore() -> Iterator[Target | None]:
        global _target
        try:
            yield target
        finally:
            _target = previous
            residency.drop_programs()

    return restore()


def configure_from_env() -> None:
    """``TORCH_TPU_TARGET``, read once at import."""
    spec = os.environ.get("TORCH_TPU_TARGET", "").strip()
    if spec:
        set_target(spec)


def note_host_op(name: str) -> None:
    """An op that ran on the host because XLA has no TPU kernel for it (eig): named in the report."""
    _host_ops[name] = _host_ops.get(name, 0) + 1


def reset() -> None:
    """Forgets every result and step (the target stays)."""
    with _lock:
        _host_ops.clear()
        _results.clear()
        _generation[0] += 1
        _unreported.clear()
        _steps.clear()


def _spec(x: Any, sharding: Any) -> Any:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, (bool, int, float, complex)):  # a Python number: weakly typed, as jit sees it
        dtype = jax.dtypes.canonicalize_dtype(type(x))
        return jax.ShapeDtypeStruct((), dtype, weak_type=True, sharding=sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type, sharding=sharding)
    if isinstance(x, (list, tuple)):
        return type(x)(_spec(y, sharding) for y in x)
    if isinstance(x, dict):  # a pytree of arrays (a JAX program's weights)
        return {k: _spec(v, sharding) for k, v in x.items()}
    return x


def _refused_here(fn: Callable, specs: list) -> bool:
    """Whether ``fn`` fails to trace for these inputs whatever the platform (an input of a shape the
    program was not built for): the local call raises its own error, and no TPU compile is due."""
    try:
        jax.eval_shape(fn, *specs)
    except Exception:  # noqa: BLE001 - any error: the inputs are the caller's mistake
        return True
    return False


def _signature(args: tuple) -> tuple:
    """Shapes and dtypes, and the layout of an input spread over several devices: a program run on
    sharded inputs is another program for the target than the same one on whole arrays."""
    return tuple((x.shape, str(x.dtype), None if isinstance(getattr(x, "sharding", None), _one_device)
                  else getattr(x, "sharding", None)) if hasattr(x, "shape") else type(x) for x in args)


_one_device = jax.sharding.SingleDeviceSharding


def _compile(target: Target, result: Result, fn: Callable, specs: list, donate: tuple,
             parts: Callable[[list], list[tuple[str, Callable, list]]] | None) -> None:
    """The worker's job: lower and compile ``fn`` for the target chip, and keep its analyses."""
    try:
        placed, result.chips = target.place(specs)
        lowered = jax.jit(fn, donate_argnums=donate).lower(*placed)
        text = lowered.as_text()
        result.x64 = x64_figures(text)
        path = _analysis_path(target, text)
        if path is not None and path.exists():  # compiled by an earlier process
            known = json.loads(path.read_text())
            result.cost, result.memory, result.error = known["cost"], known["memory"], known["error"]
            if not result.error:
                result.ok = True
                return
            raise RuntimeError(result.error)
        try:
            compiled = lowered.compile()
        except Exception as e:
            if path is not None:
                _save(path, {"cost": {}, "memory": {}, "error": _error_text(e)})
            raise
    except Exception as e:  # noqa: BLE001 - XLA:TPU's refusal, kept as the report's reason
        if _refused_here(fn, specs):
            result.refused = True
            return
        result.error = result.error or _error_text(e)
        if parts is not None:  # a trace of several ops: which of them fail on their own
            try:
                each = parts(specs)
            except Exception:  # noqa: BLE001 - the trace as a whole stays the one named
                each = []
            for op_name, op_fn, op_args in each:
                try:
                    jax.jit(op_fn).lower(*target.place(op_args)[0]).compile()
                except Exception:  # noqa: BLE001
                    if op_name not in result.blamed:
                        result.blamed.append(op_name)
        result.ok = False
        with _lock:
            _unreported.append(result)
        return
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    result.cost = {k: float(v) for k, v in (cost or {}).items()
                   if k in ("flops", "bytes accessed", "transcendentals", "optimal_seconds")}
    mem = compiled.memory_analysis()
    if mem is not None:
        result.memory = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
                         for k in ("argument", "output", "temp", "alias", "generated_code")}
        result.memory["peak"] = int(getattr(mem, "peak_memory_in_bytes", 0) or 0) or (
            result.memory["argument"] + result.memory["output"] + result.memory["temp"] - result.memory["alias"])
    if path is not None:
        _save(path, {"cost": result.cost, "memory": result.memory, "error": ""})
    result.ok = True


_X64_TENSOR = re.compile(r"tensor<((?:\d+x)*)(i64|ui64|f64|complex<f64>)>")


def x64_figures(text: str) -> dict:
    """The 64-bit ops of a program (its StableHLO text, before XLA's passes): how many ops give
    int64, uint64, float64 or complex128 results, and the bytes those results take.

    XLA:TPU emulates these types with pairs of 32-bit values, and its cost model has no figure for
    the emulated ops: each one turns XLA's time estimate of the whole program into a sentinel (about
    -1 s per op), so the projection of such a program falls back to the roofline. These figures say
    what the 64-bit part is against the program's bytes accessed, which is what the emulation
    multiplies (a 64-bit op moves 8 bytes per element, where a 32-bit one moves 4)."""
    ops = nbytes = 0
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("%") or " = " not in line:
            continue
        results = line.rsplit("->", 1)[1] if "->" in line else line.rsplit(" : ", 1)[-1]
        found = _X64_TENSOR.findall(results)
        if found:
            ops += 1
            for dims, kind in found:
                nbytes += math.prod(int(d) for d in dims.split("x") if d) * (16 if kind.startswith("complex") else 8)
    return {"ops": ops, "bytes": nbytes}


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"


def _keep_tpu_executables_out_of_the_persistent_cache() -> None:
    """JAX's persistent cache would store each TPU executable, which only a client with a TPU can
    read back: every later process would warn and compile again. Its compile-only runtime is marked
    unsupported there (and the note JAX logs of that is dropped); what the report needs of an
    executable, its analyses, is cached instead (:func:`_analysis_path`)."""
    try:
        from jax._src import compilation_cache
    except ImportError:  # another jax: its cache warns, and compiles anyway
        return
    runtimes = getattr(compilation_cache, "_UNSUPPORTED_RUNTIMES", None)
    if isinstance(runtimes, set) and "compile_only_runtime" not in runtimes:
        runtimes.add("compile_only_runtime")
        logging.getLogger(compilation_cache.__name__).addFilter(
            lambda record: "compile_only_runtime" not in record.getMessage())


def _analysis_path(target: Target, text: str) -> Path | None:
    """Where a program's analyses for the target are kept across processes: a file per target,
    versions and program text, under the cache directory (``TORCH_TPU_CACHE_DIR``; ``off``: none)."""
    root = os.environ.get("TORCH_TPU_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "torch_tpu"))
    if root.lower() == "off":
        return None
    digest = hashlib.sha256(f"{target.topology} {jax.__version__} {_libtpu_version()}\n".encode())
    digest.update(text.encode())
    return Path(root) / "target" / f"{digest.hexdigest()[:32]}.json"


@functools.cache
def _libtpu_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _save(path: Path, figures: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(figures))
        tmp.replace(path)
    except OSError:  # a read-only cache: the figures are only not kept
        pass


def _submit(result: Result, fn: Callable, specs: list, donate: tuple, parts: Callable | None) -> None:
    """Queues ``fn``'s compile for the target on the worker thread (and waits for it under
    ``TORCH_TPU_TARGET_STRICT``, raising if it fails). ``specs``: its inputs' shapes and placements."""
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch_tpu-target")
    result.future = _pool.submit(_compile, _target, result, fn, specs, donate, parts)
    if _strict:
        result.future.result()
        if result.ok is False:
            with _lock:
                if result in _unreported:
                    _unreported.remove(result)
            raise TargetCompileError(_failure_text(result))


def _failure_text(r: Result) -> str:
    ops = ", ".join(r.blamed or r.ops[:8]) + (" ..." if not r.blamed and len(r.ops) > 8 else "")
    where = f" at {r.site}" if r.site else ""
    return f"tpu target {_target.topology if _target else '?'}: {r.name} ({ops}){where} does not compile: {r.error}"


def _tell() -> None:
    """Warns, on the caller's thread, of each failure the worker found since the last call."""
    with _lock:
        failed, _unreported[:] = list(_unreported), []
    for r in failed:
        warnings.warn(_failure_text(r) + " (see torch_tpu.target_report())", UserWarning, stacklevel=3)


def op_parts(key: Any, decode: Callable[[tuple], Any], where: list[str]) -> list[tuple[str, Callable, list]]:
    """Each op of a trace or captured graph (``key``: its (program, wiring) pairs) as (its name and
    user line, its program, its inputs' shapes), to blame the ops of a failed trace that fail on their
    own. A wiring entry ``("n", i, j)`` is output ``j`` of op ``i``; ``decode`` gives the others."""
    env: list = []
    parts = []
    for i, (program, wiring) in enumerate(key):
        xs = [env[w[1]][w[2]] if w[0] == "n" else decode(w) for w in wiring]
        out = jax.eval_shape(program.fn, *xs)
        env.append(out if program.multi else (out,))
        parts.append((f"{program.name} at {where[i] if i < len(where) else '<unknown>'}", program.fn, xs))
    return parts


class _Watched:
    """A compiled program's callable, counting its calls and compiling each new input signature
    for the target."""

    __slots__ = ("_run", "_kind", "_name", "_fn", "_ops", "_site", "_donate", "_parts", "_fixed", "_seen",
                 "__weakref__")

    def __init__(self, run: Callable, kind: str, name: str, fn: Callable, ops: list[str],
                 site: Callable[[], str | None], donate: tuple, parts: Callable | None, fixed: bool) -> None:
        self._run, self._kind, self._name, self._fn, self._ops = run, kind, name, fn, ops
        self._site, self._donate, self._parts, self._fixed = site, donate, parts, fixed
        self._seen: tuple[int, dict] = (_generation[0], {})  # input signature -> its Result, since the last reset

    def __call__(self, *args: Any) -> Any:
        if _target is None:
            return self._run(*args)
        generation, seen = self._seen
        if generation != _generation[0]:  # a reset since: compiled (and counted) anew
            self._seen = generation, seen = _generation[0], {}
        key = None if self._fixed else _signature(args)
        result = seen.get(key)
        if result is None:
            result = Result(self._kind, self._name, self._ops, self._site())
            specs = _map_leaves(list(args), _local_spec)  # now: a donated input is gone after the call
            if _strict:  # raises at the op, before it runs
                self._register(seen, key, result, specs)
                out = self._run(*args)
            else:
                # the local call first: its own trace of the program is then the first (a lowering
                # that traces torch code, a custom op's body, does so once, on this thread), and a
                # call the program refuses raises here with no target compile due
                out = self._run(*args)
                self._register(seen, key, result, specs)
        else:
            out = self._run(*args)
        result.calls += 1
        if _unreported:
            _tell()
        return out

    def _register(self, seen: dict, key: Any, result: Result, specs: list) -> None:
        seen[key] = result
        with _lock:
            _results.append(result)
        _submit(result, self._fn, specs, self._donate, self._parts)

    def __getattr__(self, name: str) -> Any:  # the executable's own methods (as_text, ...)
        return getattr(self._run, name)


def watch(run: Callable, *, kind: str, name: str, fn: Callable, ops: list[str], site: Callable[[], str | None],
          donate: tuple = (), parts: Callable | None = None, fixed: bool = False) -> Callable:
    """``run`` (a jitted function or a compiled executable of ``fn``), counted and compiled for the
    target per input signature (once, when ``fixed``); ``run`` itself where no target is set.
    ``parts`` lists a trace's ops as (name, fn, args) to blame the ones that fail alone."""
    if _target is None:
        return run
    return _Watched(run, kind, name, fn, ops, site, donate, parts, fixed)


@contextlib.contextmanager
def step() -> Iterator[None]:
    """Marks one training or decode step: its host time is measured here, and its device time is
    projected from the target programs it ran."""
    before = {id(r): r.calls for r in _results}
    t0 = time.perf_counter()
    try:
        yield
    finally:
        seconds = time.perf_counter() - t0
        with _lock:
            index = {id(r): i for i, r in enumerate(_results)}
            calls = {index[id(r)]: r.calls - before.get(id(r), 0) for r in _results
                     if r.calls - before.get(id(r), 0)}
            _steps.append((seconds, calls))


class TargetReport(dict):
    """What :func:`report` returns: a dict, whose ``str()`` is a readable summary."""

    def __str__(self) -> str:
        lines = [f"tpu target {self['topology']} ({self['chip']}): {self['programs']['compiled']} programs "
                 f"compiled, {self['programs']['failed']} failed, {self['programs']['pending']} pending"]
        for f in self["failures"]:
            lines.append(f"  FAILED {f['program']} ({', '.join(f['ops'][:8])}) at {f['site']}: {f['error']}")
        for op, calls in self["host_fallbacks"].items():
            lines.append(f"  on the host (no TPU kernel in XLA): {op}, {calls} call(s)")
        s = self.get("step")
        if s:
            lines.append(
                f"per step ({s['steps']} measured): device {s['device_ms_per_step']:.3f} ms ({s['device_ms_source']}), "
                f"host {s['host_ms_per_step']:.3f} ms here -> {s['projected_steps_per_s']:.1f} steps/s, "
                f"MFU {s['projected_mfu']:.1%}, {s['bound']}-bound; peak HBM {s['peak_hbm_bytes'] / 2**20:.1f} MiB "
                f"{f'per chip of {n} ' if (n := s.get('chips', 1)) > 1 else ''}({s['peak_hbm_share']:.1%} of "
                f"{self['chip']}'s); 64-bit values {s.get('x64_share', 0.0):.2%} of the bytes accessed")
        top = sorted(self["per_program"], key=lambda p: -p["device_ms"] * max(p["calls"], 1))[:10]
        if top:
            lines.append("programs (by projected device time, all calls):")
            for p in top:
                lines.append(f"  {p['calls']:6d} x {p['device_ms']:.4f} ms ({p['device_ms_source']}) "
                             f"{p['flops']:.3g} flops, {p['bytes_accessed']:.3g} B, "
                             f"peak {p['peak_bytes'] / 2**20:.2f} MiB"
                             f"{f' per chip of {c}' if (c := p['chips']) > 1 else ''}  {p['program'][:90]}")
        return "\n".join(lines)


def report(wait: bool = True) -> TargetReport:
    """The target's figures (see the module); waits for the pending compiles unless ``wait=False``."""
    if _target is None:
        raise RuntimeError("no tpu target is set: TORCH_TPU_TARGET=v5e, or torch_tpu.set_target('v5e')")
    chip = _target.chip
    if wait:
        _wait_pending()
    _tell()
    with _lock:
        results = list(_results)
        steps = list(_steps)
    per_program, failures = [], []
    for r in results:
        if r.ok is False:
            failures.append({"program": r.name, "kind": r.kind, "ops": r.blamed or r.ops, "site": r.site,
                             "error": r.error})
        if not r.ok:
            continue
        seconds, source = r.device_seconds(chip)
        peak = r.memory.get("peak", 0)
        per_program.append({
            "program": r.name, "kind": r.kind, "chips": r.chips, "calls": r.calls, "device_ms": seconds * 1e3,
            "device_ms_source": source, "flops": r.cost.get("flops", 0.0),
            "bytes_accessed": r.cost.get("bytes accessed", 0.0), "transcendentals": r.cost.get("transcendentals", 0.0),
            "xla_ms": r.cost["optimal_seconds"] * 1e3 if r.cost.get("optimal_seconds", -1) > 0 else None,
            "x64_ops": r.x64.get("ops", 0), "x64_bytes": r.x64.get("bytes", 0),
            **{f"{k}_bytes": r.memory.get(k, 0) for k in ("argument", "output", "temp", "alias")},
            "peak_bytes": peak, "peak_hbm_share": peak / chip.hbm_bytes,
        })
    out = TargetReport(
        chip=chip.name, topology=_target.topology,
        programs={"compiled": sum(r.ok is True for r in results), "failed": len(failures),
                  "pending": sum(r.ok is None and not r.refused for r in results)},
        failures=failures, per_program=per_program, host_fallbacks=dict(_host_ops), step=None,
    )
    if steps:
        out["step"] = project(results, steps, chip)
    return out


def snapshot() -> dict[int, int]:
    """The calls counted so far per program: :func:`since` projects the steps run after it. Waits
    for the pending compiles first, so that a benchmark's timed steps, which begin here, do not
    share the machine's cores with the worker thread still compiling the warm-up's programs (on
    two cores that more than doubled a decoding token's process CPU time)."""
    _wait_pending()
    with _lock:
        return {i: r.calls for i, r in enumerate(_results)}


def _wait_pending() -> None:
    for r in list(_results):
        if r.future is not None:
            r.future.result()


def since(snap: dict[int, int], steps: int, host_s: float) -> dict:
    """The projection of ``steps`` steps run since ``snap``, whose host seconds per step were
    measured by the caller (a benchmark's own host clock); waits for the pending compiles. Adds the
    chip, its HBM and the failed programs' count (the benchmark's ``"target"`` object)."""
    if _target is None:
        raise RuntimeError("no tpu target is set")
    _wait_pending()
    with _lock:
        results = list(_results)
    calls = {i: r.calls - snap.get(i, 0) for i, r in enumerate(results) if r.calls - snap.get(i, 0)}
    out = _project_calls(results, calls, steps, host_s, _target.chip)
    return {"chip": _target.topology, **out, "hbm_bytes": _target.chip.hbm_bytes,
            "failed_programs": sum(r.ok is False for r in results)}


def _project_calls(results: list[Result], calls: dict[int, int], steps: int, host_s: float, chip: Chip) -> dict:
    device = flops = moved = x64 = 0.0
    sources = set()
    peak, chips = 0, 1
    for i, n in calls.items():
        r = results[i]
        if not r.ok:
            continue
        seconds, source = r.device_seconds(chip)
        sources.add(source)
        device += n * seconds
        flops += n * r.cost.get("flops", 0.0)
        moved += n * r.cost.get("bytes accessed", 0.0)
        x64 += n * r.x64.get("bytes", 0)
        peak = max(peak, r.memory.get("peak", 0))
        chips = max(chips, r.chips)
    steps = max(steps, 1)
    return {**projection(device / steps, host_s, flops / steps, chip, steps=steps, peak=peak,
                         source="xla" if sources == {"xla"} else "roofline" if sources == {"roofline"}
                         else "xla+roofline"),
            "chips": chips, "x64_share": x64 / moved if moved else 0.0}


def project(results: list[Result], steps: list[tuple[float, dict[int, int]]], chip: Chip) -> dict:
    """Per step, from the steps marked: the first is left out where there are more (it compiles)."""
    measured = steps[1:] if len(steps) > 1 else steps
    host = statistics.median(s for s, _ in measured)
    _, calls = measured[-1]  # the steady state: the programs of the last step
    return {**_project_calls(results, calls, 1, host, chip), "steps": len(measured)}


def projection(device_s: float, host_s: float, flops: float, chip: Chip, steps: int = 1, peak: int = 0,
               source: str = "xla") -> dict:
    """The projected figures of one step from its device and host seconds and its flops: a step
    takes the longer of the two, as the host queues the next step while the device runs this one."""
    step_s = max(device_s, host_s)
    return {
        "steps": steps, "device_ms_per_step": device_s * 1e3, "device_ms_source": source,
        "host_ms_per_step": host_s * 1e3, "projected_steps_per_s": 1.0 / step_s if step_s > 0 else float("inf"),
        "projected_mfu": flops / (step_s * chip.peak_flops) if step_s > 0 else 0.0,
        "bound": "host" if host_s >= device_s else "device",
        "peak_hbm_bytes": peak, "peak_hbm_share": peak / chip.hbm_bytes,
    }
