"""One executor, three policies.

Everything that computes on the device, a lowered ATen op, a strided read or a write into a view,
is a :class:`Program`: a pure function of jax arrays, specialised on static parameters. The
executor decides how a program runs; it never knows what the program means.

* ``DEBUG``: jit, run, and wait for the result, so a failure surfaces at the op that caused it.
* ``STRICT`` (default): jit and run asynchronously; XLA's queue overlaps host and device.
* ``FUSED``: deferred into one XLA program per sync point (the fused-mode issue; not built yet).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from torch_tpu.runtime import metrics


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
        return _check_mode(EagerMode(name))
    except ValueError:
        raise ValueError(f"TORCH_TPU_EAGER_MODE={name!r}: expected one of debug, strict, fused") from None


def _check_mode(mode: EagerMode) -> EagerMode:
    if mode is EagerMode.FUSED:
        raise NotImplementedError(
            "torch_tpu: EagerMode.FUSED (deferred execution into one XLA program) is not built yet; "
            "use EagerMode.STRICT or EagerMode.DEBUG"
        )
    return mode


class _State(threading.local):
    def __init__(self) -> None:
        self.mode = _DEFAULT_MODE


_DEFAULT_MODE = _mode_from_env()
_state = _State()


def get_eager_mode() -> EagerMode:
    """The mode in force on this thread."""
    return _state.mode


class _ModeSetter:
    """Returned by :func:`set_eager_mode`: the switch has happened; as a context it restores."""

    def __init__(self, previous: EagerMode) -> None:
        self._previous = previous

    def __enter__(self) -> _ModeSetter:
        return self

    def __exit__(self, *exc: object) -> None:
        set_eager_mode(self._previous)


def set_eager_mode(mode: EagerMode | str) -> _ModeSetter:
    """Switches the eager mode for the whole process (autograd's backward runs on other threads).

    Usable plainly, or as ``with torch_tpu.set_eager_mode(EagerMode.DEBUG): ...``.
    """
    global _DEFAULT_MODE
    mode = _check_mode(EagerMode(mode) if isinstance(mode, str) else mode)
    previous = _state.mode
    synchronize()
    _DEFAULT_MODE = mode
    _state.mode = mode
    return _ModeSetter(previous)


class Program:
    """A pure function of jax arrays, compiled by XLA the first time it runs.

    ``name`` is what errors and metrics show: the ATen op and the input signature.
    """

    __slots__ = ("name", "fn", "_jitted")

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        self.name = name
        self.fn = fn
        self._jitted: Callable[..., Any] | None = None

    def _compile_and_run(self, *inputs: Any) -> Any:
        self._jitted = jax.jit(self.fn)
        t0 = time.perf_counter()
        out = self._jitted(*inputs)  # traces and compiles on first call
        metrics.count_compile(self.name, time.perf_counter() - t0)
        return out

    def __call__(self, *inputs: Any) -> Any:
        jitted = self._jitted
        if jitted is None:
            return self._compile_and_run(*inputs)
        return jitted(*inputs)


def execute(program: Program, *inputs: Any) -> Any:
    """Runs ``program`` under the current mode and returns its jax outputs."""
    try:
        out = program(*inputs)
        if _state.mode is EagerMode.DEBUG:
            jax.block_until_ready(out)
    except Exception as e:  # a lowering or runtime failure: name the op, never a bare jax trace
        raise RuntimeError(f"tpu: {program.name} failed: {type(e).__name__}: {e}") from e
    return out


def synchronize() -> None:
    """Waits until every queued device computation is done (``torch.tpu.synchronize``)."""
    for d in jax.local_devices():
        try:
            d.synchronize_all_activity()
        except AttributeError:  # older jaxlib: fall back to an effects barrier
            jax.effects_barrier()
            return
