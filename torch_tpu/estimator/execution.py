"""How the estimator's steps run: the eager mode, bf16 autocast, and where a step's trace ends."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_tpu.runtime import fused, metrics
from torch_tpu.runtime.executor import set_eager_mode
from torch_tpu.tensor import storage as _storage


class Execution:
    """``mode``: ``"fused"`` (each step recorded as one trace and run as one program),
    ``"compile"`` (``torch.compile(backend="tpu")`` of the step; what Dynamo leaves outside its
    graphs runs op by op) or ``"strict"`` (op by op). ``precision``: ``"fp32"`` or ``"bf16"``.
    ``replay``: training steps are captured and replayed (``mode="auto"``; ``mode`` is then
    ``"fused"``, what warm-up, fallback, evaluation and prediction run in)."""

    def __init__(self, mode: str, precision: str, replay: bool = False) -> None:
        self.mode, self.precision, self.replay = mode, precision, replay
        self._compiled: weakref.WeakKeyDictionary[nn.Module, Callable] = weakref.WeakKeyDictionary()

    def forward(self, model: nn.Module) -> Callable[..., Any]:
        """What ``evaluate`` and ``predict`` call: the model, or in compile mode the model under
        ``torch.compile`` (one program per shape bucket instead of one per op), made once."""
        if self.mode != "compile":
            return model
        fn = self._compiled.get(model)
        if fn is None:
            fn = self._compiled[model] = torch.compile(model, backend="tpu", dynamic=False)
        return fn

    def eager_mode(self) -> contextlib.AbstractContextManager:
        return set_eager_mode("fused" if self.mode == "fused" else "strict")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(device_type="tpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def end_step(self) -> None:
        """Cuts the fused trace: what the step recorded runs now, as one program, asynchronously."""
        if self.mode == "fused":
            fused.flush("step")


def compile_counters() -> tuple[int, float]:
    """Programs compiled so far and the seconds spent, fused traces and per-op programs together:
    ``torch_tpu.metrics()``'s two figures, without copying its other counters (twice a step)."""
    if fused._step_ended:
        fused.finish_step()  # what was recorded runs first, so its compilation is counted (as metrics() does)
    if fused._pending and _storage._capture is None:
        fused.flush(reason="metrics()")
    count, seconds = metrics.compile_totals
    return count, round(seconds, 4)
