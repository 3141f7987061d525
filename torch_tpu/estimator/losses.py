"""What ``fit`` and ``evaluate`` minimise, and how each loss stays exact on a padded batch.

Four sources of a loss, in this order:

* ``loss_fn(outputs, target)``: any torch criterion (``nn.CrossEntropyLoss()``, ``F.mse_loss``)
  or a function of the model's output and the batch's target (the last element of a tuple batch,
  or ``"labels"`` of a dict batch);
* ``loss_fn=batch_loss(fn)``: ``fn(outputs, batch)``, a loss over the whole batch as the loader
  gave it (on the device), for batches without a target or losses that need more of the batch;
* the model's own loss (``out.loss`` or ``out["loss"]``, Hugging Face style);
* the default: cross entropy for integer targets, mean squared error for float ones.

The last batch of an epoch is padded to the full size (one program for every step) and its padded
rows must not count. A loss of one value per sample (``reduction="none"``) is masked: the padded
rows drop out and the mean is taken over the real ones, in the same program. A scalar loss (a
criterion's default ``reduction="mean"``, or the model's own) cannot be unmixed, so that batch's
forward and loss run again on its real rows only: CPU's result for the real samples, at the cost
of one more program, for the last batch only. The default loss weights each element itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torch_tpu.estimator.data import Batch, map_tensors


class LossConfigError(TypeError):
    """No loss can be formed from what the batch and model give, or ``loss_fn`` cannot be called
    with it: the message names the expected signatures."""


SIGNATURES = (
    "loss_fn takes loss_fn(outputs, target), as every torch criterion does (nn.CrossEntropyLoss(), "
    "F.mse_loss), where target is the last element of a batch (inputs..., target) or 'labels' of a dict "
    "batch; or, for a loss over the whole batch, loss_fn=torch_tpu.estimator.batch_loss(fn) with "
    "fn(outputs, batch)"
)


@dataclass(frozen=True)
class BatchLoss:
    """A loss over the whole batch: ``fn(outputs, batch)``, ``batch`` as the loader gave it, on
    the device. Made by :func:`batch_loss`; a plain ``loss_fn`` takes ``(outputs, target)``."""

    fn: Callable[[Any, Any], Any]

    def __call__(self, outputs: Any, batch: Any) -> Any:
        return self.fn(outputs, batch)


def batch_loss(fn: Callable[[Any, Any], Any]) -> BatchLoss:
    """Marks ``fn(outputs, batch)`` as a loss over the whole batch, for ``fit(loss_fn=...)``: an
    autoencoder's ``lambda out, x: ((out - x) ** 2).mean()`` on single-tensor batches, or a loss
    that reads several elements of the batch."""
    if not callable(fn):
        raise TypeError(f"batch_loss: expected a function fn(outputs, batch), got {type(fn).__name__}")
    return BatchLoss(fn)


# ---------------------------------------------------------------------- the default loss
def own_loss(out: Any) -> Any:
    """The loss a model computed itself (Hugging Face style), or None."""
    if isinstance(out, dict):
        return out.get("loss")
    return getattr(out, "loss", None)


def prediction(out: Any) -> torch.Tensor:
    """The tensor the default loss and the metrics compare with the target."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "logits" in out:
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot take a prediction from a model output of type {type(out).__name__}; pass loss_fn")


def classes_last(pred: torch.Tensor, target: torch.Tensor) -> bool:
    """Logits of shape (..., C) for targets (...) with more than one leading dim: a language model."""
    return pred.dim() == target.dim() + 1 and pred.dim() > 2 and tuple(pred.shape[:-1]) == tuple(target.shape)


def row_weights(target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weight of each loss element: the row mask, and zero for ``ignore_index`` (-100) class targets."""
    m = mask.reshape(-1, *([1] * (target.dim() - 1)))
    if target.is_floating_point():
        return mask
    return m * (target != -100).to(mask.dtype)


def elementwise_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Unreduced default loss: cross entropy per target element for integer targets, else squared
    error averaged over each row."""
    if not target.is_floating_point():
        if classes_last(pred, target):
            ce = F.cross_entropy(pred.reshape(-1, pred.shape[-1]).float(), target.reshape(-1), reduction="none")
            return ce.reshape(target.shape)
        return F.cross_entropy(pred.float(), target, reduction="none")
    if pred.shape != target.shape:
        if pred.numel() != target.numel():
            raise ValueError(f"prediction shape {tuple(pred.shape)} and target shape {tuple(target.shape)} differ")
        target = target.reshape(pred.shape)
    sq = (pred.float() - target.float()) ** 2
    return sq.reshape(sq.shape[0], -1).mean(1)


# ---------------------------------------------------------------------- the loss of a run
class Loss:
    """The loss of one ``fit`` or ``evaluate`` run, built once from the user's ``loss_fn``.

    ``group_totals`` and ``contribution`` split a step's loss over its micro-batches (gradient
    accumulation) so that their sum is the mean over the real samples of the whole step.
    """

    def __init__(self, loss_fn: Callable | None) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise LossConfigError(f"loss_fn: expected a callable, got {type(loss_fn).__name__}. {SIGNATURES}")
        self.fn = loss_fn
        self.whole_batch = isinstance(loss_fn, BatchLoss)

    # ------------------------------------------------------------------ the user's loss
    def _call(self, out: Any, b: Batch) -> torch.Tensor:
        if self.whole_batch:
            what, args = "fn(outputs, batch)", (out, device_batch(b))
        else:
            target = b.target if b.target is not None else (b.kwargs.get("labels") if b.kwargs else None)
            if target is None:
                raise LossConfigError(
                    f"loss_fn(outputs, target) needs a target, but this batch {_describe(b.raw)} has none "
                    f"(a single tensor, a 1-tuple, or a dict without 'labels'). {SIGNATURES}"
                )
            what, args = "loss_fn(outputs, target)", (out, target)
        try:
            loss = self.fn(*args)
        except (AttributeError, TypeError) as e:
            if isinstance(e, LossConfigError):
                raise
            raise LossConfigError(
                f"{what} cannot be called with what the batch holds: it got outputs={_describe(args[0])} "
                f"and {'batch' if self.whole_batch else 'target'}={_describe(args[1])}, and raised "
                f"{type(e).__name__}: {e}. {SIGNATURES}"
            ) from e
        if not isinstance(loss, torch.Tensor):
            raise LossConfigError(f"{what} returned {type(loss).__name__}: expected a tensor, a scalar or one "
                                  "loss per sample")
        return loss

    def _per_sample(self, loss: torch.Tensor, b: Batch) -> torch.Tensor | None:
        """One value per row (the mean of each row's elements), or None for a scalar loss."""
        if loss.dim() == 0:
            return None
        rows = b.mask.shape[0] if b.mask is not None else b.size
        if loss.shape[0] % rows:
            raise LossConfigError(
                f"loss_fn returned a loss of shape {tuple(loss.shape)} for a batch of {rows}"
                " rows: expected a scalar, or one loss per sample"
                f" (leading dim {rows}, or {rows} x k flattened row by row)"
            )
        return loss.reshape(rows, -1).float().mean(1)

    def real_rows_mean(self, model: nn.Module, out: Any, b: Batch,
                       rows_weight: torch.Tensor | None = None) -> tuple[torch.Tensor | None, bool]:
        """The loss from ``loss_fn`` or the model's own loss over ``b``'s real rows, and whether it
        is divided by ``rows_weight`` already (a masked per-sample loss: the real rows of the whole
        step, default this batch's). ``(None, False)`` when the default loss applies."""
        if self.fn is not None:
            loss = self._call(out, b)
            per = self._per_sample(loss, b)
            if per is not None:
                if b.mask is None:
                    return per.mean(), False
                weight = b.mask.sum() if rows_weight is None else rows_weight
                return (per * b.mask).sum() / weight, rows_weight is not None
            if b.padded_to is not None:
                real = cut_rows(b)
                return self._call(model(*real.args, **real.kwargs), real), False
            return loss, False
        own = own_loss(out)
        if own is not None and b.padded_to is not None:
            real = cut_rows(b)
            own = own_loss(model(*real.args, **real.kwargs))
        return own, False

    # ------------------------------------------------------------------ one step's share
    def group_totals(self, micro: list[Batch]) -> tuple[int, torch.Tensor | None, torch.Tensor | None]:
        """What a step's micro-batches share: their real rows (a number, for scalar losses), the
        same as a tensor (for masked per-sample losses; None when there is one micro-batch), and
        the default loss's total element weight (None unless the default loss may apply)."""
        rows = sum(b.size for b in micro)
        rows_weight = None
        if self.fn is not None and len(micro) > 1 and all(b.mask is not None for b in micro):
            rows_weight = micro[0].mask.sum()
            for b in micro[1:]:
                rows_weight = rows_weight + b.mask.sum()
        weight = None
        if self.fn is None and all(b.target is not None for b in micro):
            weight = row_weights(micro[0].target, micro[0].mask).sum()
            for b in micro[1:]:
                weight = weight + row_weights(b.target, b.mask).sum()
            weight = weight.clamp(min=1.0)
        return rows, rows_weight, weight

    def contribution(self, model: nn.Module, out: Any, b: Batch,
                     totals: tuple[int, torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
        """This micro-batch's share of the step's mean loss over real samples."""
        rows, rows_weight, weight = totals
        loss, normalised = self.real_rows_mean(model, out, b, rows_weight)
        if loss is not None:
            # rows / b.size is exactly k for k equal micro-batches: the same as dividing by k
            return loss if normalised or rows == b.size else loss / (rows / b.size)
        if b.target is None:
            raise LossConfigError(
                "the batch has no target and the model returned no loss: pass batches (inputs..., target), or a loss_fn"
                f". {SIGNATURES}"
            )
        if weight is None:
            raise TypeError("a batch without a target in a group of batches with targets")
        per = elementwise_loss(prediction(out), b.target)
        return (per * row_weights(b.target, b.mask)).sum() / weight

    def eval_parts(self, model: nn.Module, out: Any, b: Batch) -> tuple[Any, Any] | None:
        """(weighted loss sum, weight) of one evaluation batch, or None when no loss applies."""
        loss, _ = self.real_rows_mean(model, out, b)
        if loss is not None:
            return loss.float() * b.size, b.size
        if b.target is None:
            return None
        w = row_weights(b.target, b.mask)
        return (elementwise_loss(prediction(out), b.target) * w).sum(), w.sum()


def cut_rows(b: Batch) -> Batch:
    """The batch without its padding rows (a new shape: one more program, for the last batch only)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[: b.size] if t.dim() else t

    args, kwargs, target = map_tensors((b.args, b.kwargs, b.target), cut)
    return replace(b, args=args, kwargs=kwargs, target=target, mask=None, padded_to=None)


def device_batch(b: Batch) -> Any:
    """The batch as the loader gave it, on the device, for ``batch_loss(fn)``."""
    if b.kwargs:
        return b.kwargs
    if b.target is not None:
        return (*b.args, b.target)
    return b.args[0] if len(b.args) == 1 and not isinstance(b.raw, (tuple, list)) else tuple(b.args)


def _describe(x: Any) -> str:
    """A value's structure for error messages: tensors as dtype[shape]."""
    if isinstance(x, torch.Tensor):
        return f"Tensor({str(x.dtype).removeprefix('torch.')}{list(x.shape)})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_describe(v) for v in x)
        return f"{type(x).__name__}({inner})"
    return type(x).__name__
