"""Evaluation metrics: the built-in ``"accuracy"`` and ``"mse"``, and user callables.

Each metric gives (weighted sum, weight) per batch, so the value over a loader is exact whatever
the batch sizes, and the padded rows of the last batch weigh nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu.estimator.data import Batch
from torch_tpu.estimator.losses import classes_last, prediction, row_weights

BUILTIN_METRICS = ("accuracy", "mse")


def named_metrics(metrics: Any) -> dict[str, Any]:
    """``metrics`` (a list of names and callables, or a dict name -> metric) as a dict, checked."""
    if metrics is None:
        return {}
    items = metrics.items() if isinstance(metrics, dict) else ((_metric_name(m), m) for m in metrics)
    out = {}
    for name, m in items:
        if isinstance(m, str) and m not in BUILTIN_METRICS:
            raise ValueError(f"unknown metric {m!r}: built in are {', '.join(BUILTIN_METRICS)}; or pass a callable")
        out[name] = m
    return out


def _metric_name(m: Any) -> str:
    return m if isinstance(m, str) else getattr(m, "__name__", type(m).__name__)


def accuracy_parts(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[Any, Any]:
    if target.is_floating_point():  # binary predictions against 0/1 targets
        hit = ((pred.reshape(target.shape) > 0).to(target.dtype) == target).float()
        hit = hit.reshape(hit.shape[0], -1).mean(1)
    else:
        cls = pred.argmax(-1) if classes_last(pred, target) or pred.dim() == 2 else pred.argmax(1)
        hit = (cls == target).float()
    return (hit * weight).sum(), weight.sum()


def mse_parts(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> tuple[Any, Any]:
    sq = (pred.float() - target.reshape(pred.shape).float()) ** 2
    return (sq.reshape(sq.shape[0], -1).mean(1) * mask).sum(), mask.sum()


def metric_parts(name: str, m: Any, out: Any, b: Batch) -> tuple[Any, Any]:
    """(weighted sum, weight) of metric ``m`` on one batch."""
    if b.target is None:
        raise TypeError(f"metric {name!r} needs batches (inputs..., target)")
    pred = prediction(out)
    if m == "accuracy":
        return accuracy_parts(pred, b.target, row_weights(b.target, b.mask))
    if m == "mse":
        return mse_parts(pred, b.target, b.mask)
    n = b.size
    return m(pred[:n], b.target[:n]) * n, n
