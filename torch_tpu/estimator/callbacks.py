"""Hooks into ``fit``: :class:`Callback`, :class:`EarlyStopping`, and plain step-end functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_tpu.estimator.estimator import TPUEstimator


class Callback:
    """Hooks into :meth:`TPUEstimator.fit`. ``logs`` holds what the step, epoch or validation
    measured. Set ``est.stop_training = True`` to stop after the current step."""

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


def as_callbacks(callbacks: Any) -> list[Callback]:
    return [c if isinstance(c, Callback) else StepEndCallable(c) for c in callbacks]
