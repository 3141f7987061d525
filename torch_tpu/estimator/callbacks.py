"""Hooks into ``fit``: :class:`Callback`, :class:`EarlyStopping`, and plain step-end functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# the estimator's type, named rather than imported: estimator.py imports this module
TPUEstimator = Any


class Callback:
    """Hooks into :meth:`TPUEstimator.fit`. ``logs`` holds what the step, epoch or validation
    measured; at a step's end it is a :class:`StepLogs`, whose loss is read from the device only
    when the callback looks at it (so the device keeps running ahead of a callback that does not).
    Set ``est.stop_training = True`` to stop after the current step."""

    def on_fit_start(self, est: TPUEstimator, logs: dict[str, Any]) -> None: ...

    def on_step_end(self, est: TPUEstimator, logs: dict[str, Any]) -> None: ...

    def on_epoch_end(self, est: TPUEstimator, logs: dict[str, Any]) -> None: ...

    def on_validation_end(self, est: TPUEstimator, logs: dict[str, Any]) -> None: ...

    def on_fit_end(self, est: TPUEstimator, logs: dict[str, Any]) -> None: ...


class EarlyStopping(Callback):
    """Stops when ``monitor`` (an epoch value such as ``"val_loss"`` or ``"val_accuracy"``) has not
    improved by ``min_delta`` for ``patience`` epochs. ``mode``: ``"min"``, ``"max"``, or ``"auto"``
    (max for names containing ``acc``, else min)."""

    def __init__(self, monitor: str = "val_loss", patience: int = 3, min_delta: float = 0.0, mode: str = "auto"):
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.mode = ("max" if "acc" in monitor else "min") if mode == "auto" else mode
        self.best: float | None = None
        self.wait = 0

    def on_epoch_end(self, est: TPUEstimator, logs: dict[str, Any]) -> None:
        value = logs.get(self.monitor)
        if value is None:
            raise KeyError(f"EarlyStopping: {self.monitor!r} is not among the epoch values {sorted(logs)}")
        better = (
            self.best is None
            or (self.mode == "min" and value < self.best - self.min_delta)
            or (self.mode == "max" and value > self.best + self.min_delta)
        )
        if better:
            self.best, self.wait = value, 0
        else:
            self.wait += 1
            if self.wait >= self.patience:
                est.stop_training = True


class StepEndCallable(Callback):
    """A plain ``fn(est, logs)`` run at each step end."""

    def __init__(self, fn: Callable[[TPUEstimator, dict], Any]) -> None:
        self.fn = fn

    def on_step_end(self, est: TPUEstimator, logs: dict[str, Any]) -> None:
        self.fn(est, logs)


class StepLogs(dict):
    """The ``logs`` of ``on_step_end``: the step's values, its loss read from the device only when
    a callback looks at the logs. Reading it waits for the step to finish; a callback that only
    counts steps or times them leaves the device running ahead, as it does without callbacks."""

    __slots__ = ("_fetch",)

    def __init__(self, entry: dict[str, Any], fetch: Callable[[], dict[str, Any]] | None) -> None:
        super().__init__(entry)
        self._fetch = fetch

    def _resolve(self) -> None:
        fetch = self._fetch
        if fetch is not None:
            self._fetch = None
            dict.update(self, fetch())

    def __missing__(self, key: str) -> Any:
        if self._fetch is None:
            raise KeyError(key)
        self._resolve()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        self._resolve()
        return dict.get(self, key, default)

    def __contains__(self, key: object) -> bool:
        self._resolve()
        return dict.__contains__(self, key)

    def __iter__(self) -> Any:
        self._resolve()
        return dict.__iter__(self)

    def __len__(self) -> int:
        self._resolve()
        return dict.__len__(self)

    def __eq__(self, other: object) -> bool:
        self._resolve()
        return dict.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._resolve()
        return dict.__repr__(self)

    def keys(self) -> Any:
        self._resolve()
        return dict.keys(self)

    def values(self) -> Any:
        self._resolve()
        return dict.values(self)

    def items(self) -> Any:
        self._resolve()
        return dict.items(self)

    def copy(self) -> dict[str, Any]:
        self._resolve()
        return dict(dict.items(self))

    def pop(self, key: str, *default: Any) -> Any:
        self._resolve()
        return dict.pop(self, key, *default)

    def __reduce__(self) -> Any:
        return dict, (self.copy(),)


def steps_hooked(callbacks: list[Callback]) -> list[Callback]:
    """The callbacks whose ``on_step_end`` does something (the base class's does nothing)."""
    return [c for c in callbacks if type(c).on_step_end is not Callback.on_step_end]


def as_callbacks(callbacks: Any) -> list[Callback]:
    return [c if isinstance(c, Callback) else StepEndCallable(c) for c in callbacks]
