"""The queue of deferred value checks: device-side asserts raised at the next host read.

A check whose values are on the device runs as a small program with the step
(:func:`torch_tpu.tensor.value_checks.check_values` makes it); its (failed flag, first bad value) wait here, and
the first failed one raises, naming the op's call site, where the host next reads device values
(``raise_pending``, called by the executor and the storage layer). Only the queue lives in the
runtime: the tensor-level checks sit above the storage layer, which this module must not import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from torch_tpu.runtime import fused, host_reads

_pending: list[tuple[Any, Any, Callable[[Any], Exception], str]] = []
_MAX_PENDING = 256  # past this many unread checks, resolve them (a sync) rather than grow
_queued = 0  # checks ever queued: an op's mark, so the checks of an op that then fails can go


def defer(flag: Any, first: Any, error: Callable[..., Exception], site: str) -> None:
    """Queues a check run on the device: ``flag`` (any bad element), ``first`` (the first bad value
    and its flat index, both device values); ``error(value, index)`` builds the exception. With
    ``first`` None (several checks read as one flag), ``error()`` finds what failed itself."""
    global _queued
    _settle_ready()
    _pending.append((flag, first, error, site))
    _queued += 1
    if len(_pending) > _MAX_PENDING:
        if host_reads.mode:
            host_reads.synchronizing(f"{len(_pending)} deferred value checks (index bounds) read at once")
        raise_pending()


def mark() -> int:
    """A point in the queue, taken before an op runs its value checks (see :func:`drop_since`)."""
    return _queued


def drop_since(point: int) -> None:
    """Forgets the checks queued since ``point``: the op that queued them then failed (its meta
    kernel refused a shape, as CPU does before it reads any value), so it never ran, and its checks
    must not raise later, at an unrelated host read, in words CPU never says for that call."""
    n = _queued - point
    if n > 0:
        del _pending[max(len(_pending) - n, 0):]


def _settle_ready() -> None:
    """Resolves the oldest checks whose results the device has already produced (no waiting),
    so a loop that never reads the host keeps few pending checks."""
    while _pending:
        flag = _pending[0][0]
        value = flag.value if type(flag) is fused.Lazy else flag
        if value is None or not value.is_ready():
            return
        _raise_failed([_pending.pop(0)])


def raise_pending() -> None:
    """Raises the first failed deferred check, if any (called where the host reads device values)."""
    if not _pending:
        return
    checks = list(_pending)
    _pending.clear()
    _raise_failed(checks)


def _raise_failed(checks: list) -> None:
    for flag, first, error, site in checks:
        if bool(np.asarray(fused.concrete(flag))):
            if first is None:
                e = error()
            else:
                value, at = (np.asarray(fused.concrete(x)).item() for x in first)
                e = error(value, at)
            note = (f" (found on the device after the op, called at {site}; "
                    "TORCH_TPU_EAGER_MODE=debug raises at the op itself)")
            raise type(e)(f"{e}{note}") from None
