"""One executor, three policies.

Everything that computes on the device, a lowered ATen op, a strided read or a write into a view,
is a :class:`Program`: a pure function of jax arrays, specialised on static parameters. The
executor decides how a program runs; it never knows what the program means.

* ``DEBUG``: jit, run, and wait for the result, so a failure surfaces at the op that caused it.
* ``STRICT`` (default): jit and run asynchronously; XLA's queue overlaps host and device.
* ``FUSED``: record; at a sync point the recorded programs run as one XLA program
  (:mod:`torch_tpu.runtime.fused`).

The mode is process-wide, not per thread: autograd runs backward on its own thread.
"""

from __future__ import annotations

import contextlib
import enum
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax

from torch_tpu.runtime import cache, checks, fused, metrics, residency, target
from torch_tpu.runtime.errors import raise_named


class EagerMode(enum.Enum):
    """How tpu ops execute. See the module docstring."""

    DEBUG = "debug"
    STRICT = "strict"
    FUSED = "fused"


def _mode_from_env() -> EagerMode:
    if os.environ.get("TORCH_TPU_LAUNCH_BLOCKING", "0") not in ("", "0"):
        return EagerMode.DEBUG
    name = os.environ.get("TORCH_TPU_EAGER_MODE", "strict").lower()
    try:
        return EagerMode(name)
    except ValueError:
        raise ValueError(f"TORCH_TPU_EAGER_MODE={name!r}: expected one of debug, strict, fused") from None


_mode = _mode_from_env()


def get_eager_mode() -> EagerMode:
    """The mode in force."""
    return _mode


def recording() -> bool:
    """True when programs are recorded, not run: in fused mode, and in strict mode while compiled
    graphs are pending (see :func:`deferred`); never inside an :func:`eager_section`."""
    return _mode is EagerMode.FUSED or (_mode is EagerMode.STRICT and not _outer and fused.graphs_pending())


fused.is_recording = recording


class _ModeSetter:
    """Returned by :func:`set_eager_mode`: the switch has happened; as a context it restores."""

    def __init__(self, previous: EagerMode) -> None:
        self._previous = previous

    def __enter__(self) -> _ModeSetter:
        return self

    def __exit__(self, *exc: object) -> None:
        set_eager_mode(self._previous)


def set_eager_mode(mode: EagerMode | str) -> _ModeSetter:
    """Switches the eager mode, after running whatever the old mode had queued.

    Usable plainly, or as ``with torch_tpu.set_eager_mode(EagerMode.DEBUG): ...``.
    """
    global _mode
    mode = EagerMode(mode) if isinstance(mode, str) else mode
    previous = _mode
    fused.flush()
    _mode = mode
    fused.step_boundary(mode is EagerMode.FUSED)
    return _ModeSetter(previous)


@contextlib.contextmanager
def eager_section() -> Iterator[None]:
    """Runs the body op by op (as in strict mode) even in fused mode, with every value concrete:
    for hand-written kernels that compute on arrays directly or read values on the host."""
    global _mode
    previous = _mode
    _outer.append(previous)
    _mode = EagerMode.STRICT
    try:
        yield
    finally:
        _outer.pop()
        _mode = previous


_outer: list[EagerMode] = []


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Records the body's programs into the pending trace in strict mode too (debug mode still runs
    them at once): for compiled graphs, so that a step's forward, backward and optimizer graphs
    become one XLA program. Until that trace runs, strict mode records the eager ops between the
    graphs as well (a loss, an optimizer step outside the compiled region), so they join the
    program; a host read, or the next step's first graph, runs it."""
    previous = defer()
    try:
        yield
    finally:
        undefer(previous)


def defer() -> EagerMode:
    """:func:`deferred`'s entry, without a context manager (whose generator costs a compiled
    graph's call more than the rest of the switch): returns what :func:`undefer` restores."""
    global _mode
    previous = _mode
    if previous is EagerMode.STRICT:
        _mode = EagerMode.FUSED
    return previous


def undefer(previous: EagerMode) -> None:
    global _mode
    _mode = previous


_before_capture: list[EagerMode] = []


def begin_capture_recording() -> None:
    """Records every program from now on, whatever the mode, until :func:`end_capture_recording`:
    a captured graph (:mod:`torch_tpu.device.graphs`) is one trace, never run op by op."""
    global _mode
    _before_capture.append(_mode)
    _mode = EagerMode.FUSED


def end_capture_recording() -> None:
    global _mode
    _mode = _before_capture.pop()


@contextlib.contextmanager
def outer_mode() -> Iterator[None]:
    """Inside an :func:`eager_section`, runs the body in the mode the section interrupted: for a
    check that would rather record its program with the step than run it on the spot."""
    global _mode
    previous = _mode
    _mode = _outer[-1] if _outer else _mode
    try:
        yield
    finally:
        _mode = previous


class Program:
    """A pure function of jax arrays, compiled by XLA the first time it runs.

    ``name`` is what errors and metrics show: the ATen op and the input signature.
    ``multi``: the function returns a tuple of arrays (fused mode finds out with ``jax.eval_shape``).
    ``key``: what the program is specialised on, as ``(label, value)`` pairs (an op's arguments by
    name, a view's geometry): the recompilation explainer names the first that differs between two
    programs, since their names may not show it (a view's offset, the storage it reads).
    """

    __slots__ = ("name", "fn", "multi", "fixed", "shapes", "key", "host_follows", "_jitted", "_donating",
                 "__weakref__")

    def __init__(self, name: str, fn: Callable[..., Any], multi: bool = False, avals: list | None = None,
                 key: tuple | None = None) -> None:
        self.name = name
        self.fn = fn
        self.multi = multi
        self.key = key
        self.fixed = avals  # the outputs' shapes and dtypes when the program has one input signature
        self.shapes: dict[tuple, list] = {}  # fused mode: input signature -> output shapes and dtypes
        # an ATen op's program that may run on the host when its inputs are there (host_placement)
        self.host_follows = False
        self._jitted: Callable[..., Any] | None = None
        self._donating: dict[tuple[int, ...], Callable[..., Any]] = {}  # see run_donating

    def _compile_and_run(self, *inputs: Any) -> Any:
        residency.before_compile()
        jitted = jax.jit(self.fn)
        if target.active():  # also compiled for the target chip, per input signature (runtime.target)
            jitted = target.watch(jitted, kind="program", name=self.name, fn=self.fn, ops=[self.name], site=user_line)
        self._jitted = jitted
        _compiled.add(self)
        t0 = time.perf_counter()
        out = self._jitted(*inputs)  # traces and compiles on first call
        metrics.count_compile(self.name, time.perf_counter() - t0)
        cache.note_program_compile(self, fused.user_site())
        return out

    def __call__(self, *inputs: Any) -> Any:
        jitted = self._jitted
        if jitted is None:
            return self._compile_and_run(*inputs)
        return jitted(*inputs)

    def run_donating(self, donate: tuple[int, ...], *inputs: Any) -> Any:
        """Runs the program now, letting XLA write its outputs over the buffers of the inputs at
        ``donate``, which the caller holds nowhere else: a compiled decoding step's KV cache is then
        updated in place, as fused mode's traces update theirs, without a copy of the cache per
        token. One executable per set of donated inputs; its errors name the program. The caller
        holds one program per input signature (a compiled graph's, per its key), so a target
        compiles it once, with no signature built per call."""
        jitted = self._donating.get(donate)
        try:
            if jitted is not None:
                return jitted(*inputs)
            residency.before_compile()
            jitted = jax.jit(self.fn, donate_argnums=donate)
            if target.active():
                jitted = target.watch(jitted, kind="program", name=self.name, fn=self.fn, ops=[self.name],
                                      site=user_line, donate=donate, fixed=True)
            self._donating[donate] = jitted
            _compiled.add(self)
            t0 = time.perf_counter()
            out = jitted(*inputs)
            metrics.count_compile(self.name, time.perf_counter() - t0)
            cache.note_program_compile(self, fused.user_site())
            return out
        except Exception as e:
            raise_named(e, self.name)

    def __repr__(self) -> str:
        return f"Program({self.name})"


def user_line() -> str | None:
    """The user's line running now, as ``file:line`` (None outside user code): the site a target
    compile failure names."""
    site = fused.user_site()
    return f"{site[0]}:{site[1]}" if site else None


_compiled: weakref.WeakSet[Program] = weakref.WeakSet()  # the programs holding an executable


def _drop_compiled() -> None:
    for program in list(_compiled):
        program._jitted = None
        program._donating.clear()
    _compiled.clear()


residency.on_evict(_drop_compiled)


def execute(program: Program, *inputs: Any) -> Any:
    """Runs ``program`` under the current mode and returns its jax outputs (or placeholders)."""
    if recording():
        return fused.record(program, inputs)
    try:  # outside fused mode storages hold concrete arrays (_storage.base_array sees to it)
        prof = metrics.profile
        out = program(*inputs) if prof is None else prof.timed(program.name, program, *inputs)
        if _mode is EagerMode.DEBUG:
            jax.block_until_ready(out)
    except Exception as e:  # a lowering or runtime failure: its own type, with the op named
        raise_named(e, program.name)
    return out


def run_now(program: Program, inputs: list) -> Any:
    """:func:`execute` for a caller that has just found nothing recording (an op's kernel): in
    strict mode a compiled program's executable is called directly, two Python frames fewer per
    op, which is most of what an op costs the host beyond JAX's own dispatch (decoding loops run
    dozens of tiny ops per token outside the compiled forward). Anything else (debug mode, a
    profile, a first call that compiles) goes through :func:`execute`."""
    jitted = program._jitted
    if jitted is None or _mode is not EagerMode.STRICT or metrics.profile is not None:
        return execute(program, *inputs)
    try:
        return jitted(*inputs)
    except Exception as e:  # as execute: its own type, with the op named
        raise_named(e, program.name)


def runs_at_once() -> bool:
    """True when a program called now would run at once, op by op: strict mode with nothing
    recorded, and no profile timing each program (a compiled decoding step then calls its
    executable itself, see :meth:`Program.run_donating`)."""
    return _mode is EagerMode.STRICT and not recording() and metrics.profile is None


def synchronize() -> None:
    """Runs anything recorded, waits until every queued device computation is done, and raises
    a failed value check (an out-of-range index) found on the device meanwhile."""
    fused.flush()
    for d in jax.local_devices():
        try:
            d.synchronize_all_activity()
        except AttributeError:  # older jaxlib
            jax.effects_barrier()
            break
    checks.raise_pending()
