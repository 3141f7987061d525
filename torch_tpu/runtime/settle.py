"""Finish the step, then report: what the counters call before they answer.

A fused trace, an ended training step or a deferred compiled graph may be recorded but not yet
run; ``metrics()``, ``cache_stats()`` and a profile must count them as part of the call they
belong to. The reporting modules call :func:`finished` instead of importing the fused trace, so
they sit below it in the runtime's import order (errors, metrics, settle, cache, fused, checks,
executor, profiler, graphs), with no cycle. The fused trace registers what finishing means when
it is imported; until then nothing is recorded, so there is nothing to finish.
"""

from __future__ import annotations

from collections.abc import Callable

_finishers: list[Callable[[bool], None]] = []
capturing = False  # a graph capture is in progress: nothing runs until it ends (set by runtime.graphs)


def register(finish: Callable[[bool], None]) -> None:
    """``finish(pending)`` runs a training step that ended, and with ``pending`` whatever else is
    recorded; it is called with ``pending=False`` while a graph is being captured."""
    _finishers.append(finish)


def finished(pending: bool = True) -> None:
    """Runs what was recorded before a report: an ended step always, the rest of the pending
    trace when ``pending`` (``metrics()``) and no capture is in progress."""
    for finish in _finishers:
        finish(pending and not capturing)
