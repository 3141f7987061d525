"""Checks on tensor values that CPU torch makes at the op: index bounds, class targets, ranges.

CPU torch sees every value, so an out-of-range index raises at the op. On an accelerator the
values live on the device, and reading them at every op would stop the host until the device
has caught up: a sync per embedding lookup. So a check runs where the values already are:

- values uploaded from the host keep their host copy (``storage.remember_host_copy``): the check
  runs there, at the op, with no device read. This covers batches of token ids and targets;
- in debug mode the values are read from the device (a sync), and the check raises at the op;
- otherwise (indices the device computes, such as ``torch.arange(T, device="tpu")``) the check
  runs on the device, and its error is raised at the next host read (``.item()``, ``.cpu()``,
  ``torch_tpu.sync()``), naming the op and the line that called it, as CUDA reports a
  device-side assert. Debug mode gives the exact place. In strict mode the op's own program
  computes the check with its results (:func:`run_joined`: one executable call per op, not two);
  in fused mode the check's small program is recorded with the step;
- in a compiled graph (``torch.compile(backend="tpu")``) the same checks are found when the graph
  is lowered (:func:`collecting`) and computed by the graph's own program as extra outputs
  (:func:`first_bad`), then deferred like the eager ones (:func:`defer_found`): no program more.

The values' checks, above the storage layer (they read tensors); the queue of deferred ones is
:mod:`torch_tpu.runtime.checks`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.runtime import checks as pending
from torch_tpu.runtime import executor, fused
from torch_tpu.runtime.executor import EagerMode, Program, execute
from torch_tpu.tensor.storage import host_copy, passed_checks, read, to_numpy

# A predicate marks bad elements: bad(xp, values, *params) -> bool array, with xp numpy or jax.numpy.
Predicate = Callable[..., Any]


def outside(xp: Any, a: Any, lo: int, hi: int) -> Any:
    """Values outside [lo, hi)."""
    return (a < lo) | (a >= hi)


def outside_closed(xp: Any, a: Any, lo: int, hi: int) -> Any:
    """Values outside [lo, hi]."""
    return (a < lo) | (a > hi)


def outside_unless(xp: Any, a: Any, lo: int, hi: int, allowed: int) -> Any:
    """Values outside [lo, hi), except the value ``allowed`` (an ``ignore_index``)."""
    return (a != allowed) & ((a < lo) | (a >= hi))


def first_bad(bad: Predicate, params: tuple, a: Any) -> tuple:
    """On the device: (any element of ``a`` marked by ``bad``, the first such value, its flat
    index), the three values a deferred check waits on."""
    m = bad(jnp, a, *params).reshape(-1)
    flat = jnp.asarray(a).reshape(-1)
    at = jnp.argmax(m)
    return jnp.any(m), flat[at], at


@functools.cache
def _program(bad: Predicate, params: tuple) -> Program:
    return Program(f"value check {bad.__name__}{params}", functools.partial(first_bad, bad, params), multi=True)


# While a graph is lowered: the checks its ops' own checks ask for, collected instead of made
_collected: list | None = None


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    """Within: :func:`check_values` makes no check but appends ``(tensor, predicate, params,
    error, position)`` to the list given. The compile backend runs an op's eager check on the
    traced (fake) values of its node's arguments in here, to learn which of them to check and
    how; a graph's program then computes the check with the step (:func:`first_bad`)."""
    global _collected
    previous, _collected = _collected, []
    try:
        yield _collected
    finally:
        _collected = previous


def defer_found(flag: Any, first: Any, at: Any, error: Callable[..., Exception], position: bool = False) -> None:
    """A check a compiled graph computed (:func:`first_bad`'s three values): raised at the next
    host read, as an eager check on device values is; at once in debug mode."""
    site = fused.user_site()
    make = error if position else (lambda v, _at: error(v))
    pending.defer(flag, (first, at), make, f"{site[0]}:{site[1]}" if site else "?")
    if executor.get_eager_mode() is EagerMode.DEBUG:
        pending.raise_pending()


def defer_found_any(flag: Any, found: list[tuple]) -> None:
    """Several checks a compiled graph computed, each as :func:`defer_found`'s arguments, deferred
    as one: ``flag``, computed with them, says whether any failed, so the host reads one value per
    call rather than one per check. The first failed one, in graph order, raises, as it would
    have alone."""
    site = fused.user_site()

    def make() -> Exception:
        for failed, first, at, error, position in found:
            if bool(np.asarray(fused.concrete(failed))):
                value, index = (np.asarray(fused.concrete(x)).item() for x in (first, at))
                return error(value, index) if position else error(value)
        raise AssertionError("a failed group of value checks without a failed member")

    pending.defer(flag, None, make, f"{site[0]}:{site[1]}" if site else "?")
    if executor.get_eager_mode() is EagerMode.DEBUG:
        pending.raise_pending()


def check_on_host(
    t: torch.Tensor, bad: Predicate, params: tuple, error: Callable[..., Exception], position: bool = False
) -> bool:
    """:func:`check_values` where ``t``'s values are at hand on the host (a CPU tensor, an upload's
    host copy, or any tensor in debug mode): checked there, raising if bad, and True. False, with
    nothing done, where only the device has them."""
    passed = sig = None
    if t.device.type == "cpu":  # a CPU index where CPU torch allows one
        values = _dtypes.cpu_to_numpy(t)
    else:
        passed = passed_checks(t)
        if passed is not None:
            sig = (bad, params, t.storage_offset(), t.shape, t.stride())
            if sig in passed:
                return True
        values = host_copy(t)
    if values is None and executor.get_eager_mode() is EagerMode.DEBUG:
        values = to_numpy(t)
    if values is None:
        return False
    m = np.asarray(bad(np, values, *params)).reshape(-1)
    if m.any():
        at = int(np.argmax(m))
        value = np.asarray(values).reshape(-1)[at].item()
        e = error(value, at) if position else error(value)
        e.tpu_value_check = True  # the op's kernel lets its meta kernel's shape refusal go first
        raise e
    if passed is not None:
        passed.add(sig)
    return True


def check_values(
    t: torch.Tensor, bad: Predicate, params: tuple, error: Callable[..., Exception], position: bool = False
) -> None:
    """Raises ``error(first bad value)`` if ``bad`` marks any element of tpu tensor ``t``: now when
    the values are on the host (or in debug mode), else at the next host read. ``position``:
    ``error(value, flat index of the value)``, for messages that name where it is (embedding_bag)."""
    if t.numel() == 0:
        return
    if _collected is not None:
        _collected.append((t, bad, params, error, position))
        return
    if check_on_host(t, bad, params, error, position):
        if _joining is not None and t.device.type != "cpu":  # see run_joined: the program's inputs
            _joining.append((t, bad, params, error, position, False))
        return
    if _joining is not None:  # computed by the op's own program (run_joined)
        _joining.append((t, bad, params, error, position, True))
        return
    _check_on_device(read(t), bad, params, error, position)


def _check_on_device(values: Any, bad: Predicate, params: tuple, error: Callable[..., Exception],
                     position: bool) -> None:
    with executor.outer_mode():  # in fused mode: recorded with the step, not run on the spot
        flag, first, at = execute(_program(bad, params), values)
    site = fused.user_site()
    make = error if position else (lambda v, _at: error(v))
    pending.defer(flag, (first, at), make, f"{site[0]}:{site[1]}" if site else "?")


# While a strict-mode op makes its checks: each check of a tpu tensor, kept so that those only the
# device can make are computed by the op's own program (run_joined), not a program of their own
_joining: list | None = None
# (op program, the checks' predicates, parameters and value shapes) -> the program computing both
_joined: dict[tuple, Program] = {}
# the same key -> how many calls that needed the device ran the op's own program and the checks'
# programs apart (all three compiled before, for other calls: see run_joined)
_apart: dict[tuple, int] = {}
# After this many such calls the joined program is compiled after all: a loop repeats the call, and
# then runs one executable per call instead of two. A compile costs tenths of a second, an executable
# call tens of microseconds more: the joined program pays for itself after a few thousand calls, and
# a loop that reaches this count is likely to make them. A few calls (a test's loop over padding
# values, whose three embedding ops share one check program) compile nothing more.
JOIN_AFTER = 64


def start_joining() -> list | None:
    """From here to :func:`stop_joining`, :func:`check_values` keeps each check of a tpu tensor,
    made on the host or not, and runs no program for one that needs the device (values the host
    does not have): a strict-mode op then computes those with its own results
    (:func:`run_joined`), one executable call instead of two per checked op (a decoding loop's
    ``index_copy_`` at a position the device computed). Returns what :func:`stop_joining` restores."""
    global _joining
    previous, _joining = _joining, []
    return previous


def stop_joining(previous: list | None) -> list:
    """Ends :func:`start_joining`: the checks kept, each ``(tensor, predicate, params, error,
    position, needs the device)``, for :func:`run_joined` or, where the op does not run its program
    after all, :func:`run_alone`."""
    global _joining
    found, _joining = _joining, previous
    return found


def run_alone(found: list) -> None:
    """The checks :func:`stop_joining` returned that need the device, each run as its own program,
    as :func:`check_values` runs them outside an op: for an op that ran elsewhere (on the host, or
    recorded)."""
    for t, bad, params, error, position, on_device in found:
        if on_device:
            _check_on_device(read(t), bad, params, error, position)


def run_joined(program: Program, inputs: list, found: list) -> Any:
    """Runs op ``program`` on ``inputs`` now, with its checks (:func:`stop_joining`) that need the
    device computed by the same executable (:func:`first_bad` of each as extra outputs), deferred
    as :func:`check_values` defers them. Returns the program's own outputs.

    The joined program takes the values of every check of the call, those the host made too (their
    results unread), so that one op signature has one program whichever of its index tensors the
    host holds on a given call (an embedding's indices computed now on the device, now on the
    host): it is compiled when a call first needs the device for a check and the op's own program
    has not been compiled, and used for every later call that needs the device, or that does not
    while the op's own program still has not been compiled. It is also compiled when the op's own
    program exists but a check's own program does not, as in a decoding loop whose first position
    the host uploaded (checked there) and whose later ones the device computes (``index_copy_`` at
    ``position + 1``): running them apart would compile that check program instead. Otherwise (all
    compiled) the calls run the op's program and the checks' apart: no program is compiled that
    the separate ones would not have compiled, until such a call repeats :data:`JOIN_AFTER` times:
    a loop, which then runs the joined program from its next call."""
    needs = [f for f in found if f[5]]
    if not needs and program._jitted is not None:
        return executor.run_now(program, inputs)
    key = (program, tuple([(bad, params, tuple(t.shape), t.dtype) for t, bad, params, _, _, _ in found]))
    joined = _joined.get(key)
    if joined is None:
        if not needs:
            return executor.run_now(program, inputs)
        if (program._jitted is not None and _apart.get(key, 0) < JOIN_AFTER
                and all(_program(f[1], f[2])._jitted is not None for f in needs)):
            _apart[key] = _apart.get(key, 0) + 1
            run_alone(needs)
            return executor.run_now(program, inputs)
        _apart.pop(key, None)
        joined = _joined[key] = _joined_program(program, key[1], len(inputs))
    outs, flags = executor.run_now(joined, [*inputs, *[read(f[0]) for f in found]])
    for (_, _, _, error, position, on_device), (flag, first, at) in zip(found, flags):
        if on_device:
            defer_found(flag, first, at, error, position)
    return outs


def _joined_program(program: Program, specs: tuple, n: int) -> Program:
    fn = program.fn

    def both(*inputs: Any) -> tuple:
        checked = tuple(first_bad(bad, params, v) for (bad, params, _, _), v in zip(specs, inputs[n:]))
        return fn(*inputs[:n]), checked

    names = ", ".join(f"{bad.__name__}{params}" for bad, params, _, _ in specs)
    return Program(f"{program.name} checking {names}", both, multi=True, key=program.key)
