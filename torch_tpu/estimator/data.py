"""Batches: their forms, moving them to the device, and padding the last partial batch.

A batch is a tuple or list ``(inputs..., target)``, a dict passed to the model as keyword
arguments, or a single tensor. The last batch of an epoch is usually smaller; a smaller shape is a
new XLA program, so it is padded to the full size and the padded rows are masked out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_tpu.tensor import storage as _storage
from torch_tpu.tensor import transfer as _transfer


@dataclass
class Batch:
    """One batch as the estimator sees it.

    ``args``/``kwargs``: what the model is called with. ``target``: the target, when the batch has
    one. ``size``: the number of real rows; ``mask``: float ones for real rows and zeros for padding
    (None when the batch was not padded), on the device.
    """

    args: tuple
    kwargs: dict
    target: Any
    size: int
    raw: Any
    mask: torch.Tensor | None = None
    padded_to: int | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch (inputs, target, mask) in a fixed order, found once: a step's
        bucket and a replay's inputs come from it. (``dataclasses.replace`` makes a new batch,
        which finds its own.)"""
        flat = self.__dict__.get("_flat")
        if flat is None:
            args, target, mask = self.args, self.target, self.mask
            if not self.kwargs and all(type(a) is torch.Tensor for a in args) and type(target) in _PLAIN:
                # the usual (inputs, target) batch: its list made directly, the nest's walk costs
                # more than the rest of a replayed step's bookkeeping on the batch
                flat = [*args, *([] if target is None else [target]), *([] if mask is None else [mask])]
            else:
                flat = tensors_in((args, self.kwargs, target, mask))
            self.__dict__["_flat"] = flat
        return flat


_PLAIN = (torch.Tensor, type(None))


def map_tensors(obj: Any, fn: Any) -> Any:
    """Applies ``fn`` to every tensor in a nest of tuples, lists and dicts."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(obj, lambda t: found.append(t) or t)
    return found


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for v in items:
        t = _first_tensor(v)
        if t is not None:
            return t
    return None


def batch_size(raw: Any) -> int:
    """Rows in a batch: the leading size of its first tensor."""
    t = _first_tensor(raw)
    if t is None or t.dim() == 0:
        raise TypeError(f"a batch must hold tensors with a batch dimension, got {type(raw).__name__}")
    return int(t.shape[0])


def shapes_of(raw: Any) -> Any:
    """The shapes in a batch, for error messages."""
    return map_tensors(raw, lambda t: tuple(t.shape))


def pad_rows(raw: Any, rows: int) -> Any:
    """Pads every tensor in ``raw`` to ``rows`` along dim 0 by repeating its first row.

    Repeating a real row (not zeros) keeps padded inputs valid: integer targets stay valid class
    indices and nothing divides by zero. Their loss is masked out anyway.
    """

    def pad(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] if t.dim() else 0
        if t.dim() == 0 or n >= rows:
            return t
        return torch.cat([t, t[:1].expand(rows - n, *t.shape[1:])], 0)

    return map_tensors(raw, pad)


_STRIDED = torch.strided


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t.to(device, non_blocking=True)``; a plain CPU tensor goes to tpu without torch's dispatch
    (half the cost of a small batch's copy, paid for every tensor of every batch)."""
    if type(t) is torch.Tensor and t.is_cpu and device.type == "tpu" and t.layout is _STRIDED \
            and not t.requires_grad:
        return _storage.new_tensor(tuple(t.shape), t.dtype, _transfer.host_to_device(t))
    return t.to(device, non_blocking=True)


def split(raw: Any, device: Any, with_target: bool = True, n: int | None = None) -> Batch:
    """Moves a raw batch to ``device`` (without blocking) and splits it into model inputs and target.
    ``n``: the batch's row count, when the caller has it."""
    if n is None:
        n = batch_size(raw)
    device = torch.device(device)
    if type(raw) is tuple and all(type(t) is torch.Tensor for t in raw):  # the usual (inputs, target)
        moved: Any = tuple([to_device(t, device) for t in raw])
    else:
        moved = map_tensors(raw, lambda t: to_device(t, device))
    if isinstance(moved, dict):
        return Batch((), moved, None, n, moved)
    if isinstance(moved, (tuple, list)):
        if with_target and len(moved) >= 2:
            return Batch(tuple(moved[:-1]), {}, moved[-1], n, moved)
        return Batch(tuple(moved), {}, None, n, moved)
    return Batch((moved,), {}, None, n, moved)


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``length``."""
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"a sequence of length {length} is longer than the largest bucket {max(buckets)}")


def pad_sequences(raw: Any, buckets: Sequence[int]) -> Any:
    """Pads dim 1 of every tensor with at least 2 dims up to its bucket, so variable-length
    batches make a few programs instead of one per length.

    The target (the last element of a tuple, or ``"labels"`` of a dict) is padded with -100, the
    index cross entropy ignores; everything else with 0 (a pad token id, or "masked" in an
    attention mask). Right padding leaves a causal model's outputs at real positions unchanged.
    """

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        if t.dim() < 2:
            return t
        n = bucket_for(t.shape[1], buckets)
        if n == t.shape[1]:
            return t
        filler = torch.full((t.shape[0], n - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
        return torch.cat([t, filler], 1)

    if isinstance(raw, dict):
        return {k: (pad(v, -100 if k == "labels" else 0) if isinstance(v, torch.Tensor) else v) for k, v in raw.items()}
    if isinstance(raw, (tuple, list)):
        last = len(raw) - 1
        out = [pad(v, -100 if i == last and last > 0 and not v.is_floating_point() else 0)
               if isinstance(v, torch.Tensor) else v for i, v in enumerate(raw)]
        return type(raw)(out) if not hasattr(raw, "_fields") else type(raw)(*out)
    return pad(raw, 0) if isinstance(raw, torch.Tensor) else raw
