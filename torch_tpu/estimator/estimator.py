"""TPUEstimator: ``fit``, ``evaluate`` and ``predict`` for a plain ``nn.Module``.

The estimator is also the device it drives: ``model.to(est)``, ``tensor.to(est)`` and
``torch.device(est)`` work because its class defines ``__torch_function__``, which torch consults
for every argument of ``Tensor.to``, ``Module.to`` and ``torch.device`` before parsing it, and in
which we swap the estimator for its ``torch.device``. (``torch.device`` itself cannot be
subclassed.)

A training step (forward, loss, backward, clipping, optimizer, scheduler) is one XLA program: the
fused eager mode records it and ``fused.flush`` cuts the trace at the end of each step, or
``torch.compile(backend="tpu")`` compiles the step function. Shapes stay the same every step
because the last partial batch is padded and its padded rows masked out of the loss.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import torch
import torch.nn.functional as F
from torch import nn

import torch_tpu
from torch_tpu.estimator import checkpoint as ckpt
from torch_tpu.estimator.data import (
    Batch,
    batch_size,
    bucket_for,
    map_tensors,
    pad_rows,
    pad_sequences,
    shapes_of,
    split,
    tensors_in,
)
from torch_tpu.estimator.history import History
from torch_tpu.runtime import fused

log = logging.getLogger("torch_tpu.estimator")

_MODES = ("auto", "compile", "fused", "strict")
_PRECISIONS = ("fp32", "bf16")


class BatchError(RuntimeError):
    """A batch the model or the loss could not take; names the batch index and its shapes."""


class LossConfigError(TypeError):
    """No loss can be formed from what the batch and model give: pass ``loss_fn``."""


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


class _StepEndCallable(Callback):
    def __init__(self, fn: Callable[[TPUEstimator, dict], Any]) -> None:
        self.fn = fn

    def on_step_end(self, est: TPUEstimator, logs: dict[str, Any]) -> None:
        self.fn(est, logs)


# ---------------------------------------------------------------------- losses and metrics
def _own_loss(out: Any) -> Any:
    """The loss a model computed itself (Hugging Face style), or None."""
    if isinstance(out, dict):
        return out.get("loss")
    return getattr(out, "loss", None)


def _prediction(out: Any) -> torch.Tensor:
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


def _classes_last(pred: torch.Tensor, target: torch.Tensor) -> bool:
    """Logits of shape (..., C) for targets (...) with more than one leading dim: a language model."""
    return pred.dim() == target.dim() + 1 and pred.dim() > 2 and tuple(pred.shape[:-1]) == tuple(target.shape)


def _row_weights(target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weight of each loss element: the row mask, and zero for ``ignore_index`` (-100) class targets."""
    m = mask.reshape(-1, *([1] * (target.dim() - 1)))
    if target.is_floating_point():
        return mask
    return m * (target != -100).to(mask.dtype)


def _elementwise_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Unreduced default loss: cross entropy per target element for integer targets, else squared
    error averaged over each row."""
    if not target.is_floating_point():
        if _classes_last(pred, target):
            ce = F.cross_entropy(pred.reshape(-1, pred.shape[-1]).float(), target.reshape(-1), reduction="none")
            return ce.reshape(target.shape)
        return F.cross_entropy(pred.float(), target, reduction="none")
    if pred.shape != target.shape:
        if pred.numel() != target.numel():
            raise ValueError(f"prediction shape {tuple(pred.shape)} and target shape {tuple(target.shape)} differ")
        target = target.reshape(pred.shape)
    sq = (pred.float() - target.float()) ** 2
    return sq.reshape(sq.shape[0], -1).mean(1)


def _accuracy_parts(pred: torch.Tensor, target: torch.Tensor, weight: torch.Tensor) -> tuple[Any, Any]:
    if target.is_floating_point():  # binary predictions against 0/1 targets
        hit = ((pred.reshape(target.shape) > 0).to(target.dtype) == target).float()
        hit = hit.reshape(hit.shape[0], -1).mean(1)
    else:
        cls = pred.argmax(-1) if _classes_last(pred, target) or pred.dim() == 2 else pred.argmax(1)
        hit = (cls == target).float()
    return (hit * weight).sum(), weight.sum()


def _mse_parts(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> tuple[Any, Any]:
    sq = (pred.float() - target.reshape(pred.shape).float()) ** 2
    return (sq.reshape(sq.shape[0], -1).mean(1) * mask).sum(), mask.sum()


BUILTIN_METRICS = ("accuracy", "mse")


# ---------------------------------------------------------------------- the estimator
class TPUEstimator:
    """Trains, evaluates and predicts with a ``torch.nn.Module`` on the tpu device.

    ``devices``: None (every local device), a count, or a list of indices; with more than one,
    batches are sharded over them when :mod:`torch_tpu.distributed` is available.
    ``precision``: ``"fp32"`` or ``"bf16"`` (bf16 autocast, fp32 master weights).
    ``mode``: ``"auto"`` (fused), ``"fused"``, ``"compile"`` (``torch.compile(backend="tpu")`` of the
    whole step), or ``"strict"`` (op by op, for debugging).
    ``seed``: seeds torch (CPU and tpu) now, so model initialisation is reproducible too.
    ``verbose``: progress bar and compile log lines (only when stderr is a terminal).
    ``sharding``: with several devices, ``"dp"`` replicates parameters and splits each batch;
    ``"fsdp"`` also splits parameters and optimizer state along their first dim (where it divides).
    ``bucket_lengths``: pad dim 1 (the sequence) of batch tensors up to the next of these lengths,
    targets with -100 (ignored by the loss), so variable-length batches compile a few programs.
    ``checkpoint_every``: save every N steps (epoch ends and interrupts always save when fit has a
    ``checkpoint_dir``). ``keep_checkpoints``: how many to keep. ``stop_on_nonfinite``: a NaN or inf
    loss raises ``FloatingPointError`` naming the step (else it is only recorded).
    """

    def __init__(
        self,
        devices: None | int | Sequence[int] = None,
        precision: str = "fp32",
        mode: str = "auto",
        seed: int | None = None,
        *,
        verbose: bool = True,
        checkpoint_every: int | None = None,
        keep_checkpoints: int = 2,
        stop_on_nonfinite: bool = True,
        pad_last_batch: bool = True,
        bucket_lengths: Sequence[int] | None = None,
        sharding: str = "dp",
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r}: expected one of {', '.join(_MODES)}")
        if sharding not in ("dp", "fsdp"):
            raise ValueError(f"sharding={sharding!r}: expected 'dp' (replicated parameters) or 'fsdp' (sharded)")
        if precision not in _PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {', '.join(_PRECISIONS)}")
        local = list(jax.local_devices())
        if devices is None:
            chosen = local
        elif isinstance(devices, int):
            if not 1 <= devices <= len(local):
                raise ValueError(f"devices={devices}: there are {len(local)} local {torch_tpu.platform()} devices")
            chosen = local[:devices]
        else:
            idx = list(devices)
            bad = [i for i in idx if not 0 <= i < len(local)]
            if bad or not idx:
                raise ValueError(f"devices={idx}: indices must be in 0..{len(local) - 1}")
            chosen = [local[i] for i in idx]
        self._jax_devices = chosen
        self.precision = precision
        self.mode = "fused" if mode == "auto" else mode
        self.requested_mode = mode
        self.seed = seed
        self.verbose = verbose
        self.checkpoint_every = checkpoint_every
        self.keep_checkpoints = keep_checkpoints
        self.stop_on_nonfinite = stop_on_nonfinite
        self.pad_last_batch = pad_last_batch
        self.bucket_lengths = sorted(bucket_lengths) if bucket_lengths else None
        self.sharding = sharding
        self.stop_training = False
        self.last_predict_stats: dict[str, float] = {}
        self._warned_uneven = False
        self._ones: dict[int, torch.Tensor] = {}
        self._mesh_obj: Any = None
        self._mesh_key: tuple | None = None
        if seed is not None:
            torch.manual_seed(seed)

    # ------------------------------------------------------------------ the estimator as a device
    @property
    def device(self) -> torch.device:
        """The torch device tensors live on (always ``tpu:0``; other devices are reached by sharding)."""
        return torch.device("tpu", 0)

    @property
    def devices(self) -> list[Any]:
        """The jax devices this estimator uses."""
        return list(self._jax_devices)

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def sub(a: Any) -> Any:
            return a.device if isinstance(a, TPUEstimator) else a

        return func(*(sub(a) for a in args), **{k: sub(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        n = len(self._jax_devices)
        return (
            f"TPUEstimator(platform={torch_tpu.platform()!r}, devices={n}, precision={self.precision!r}, "
            f"mode={self.mode!r})"
        )

    # ------------------------------------------------------------------ data parallel
    def _data_mesh(self, rows: int | None) -> Any:
        """A 1-D ``"data"`` mesh over this estimator's devices when there are several and the batch
        divides evenly among them; else None (one device)."""
        if len(self._jax_devices) < 2:
            return None
        if rows is not None and rows % len(self._jax_devices):
            if not self._warned_uneven:
                self._warned_uneven = True
                log.warning("batch size %d does not divide over %d devices: running on one device",
                            rows, len(self._jax_devices))
            return None
        try:
            from torch_tpu import distributed
        except ImportError:  # pragma: no cover - the distributed module is optional
            return None
        key = tuple(id(d) for d in self._jax_devices)
        if self._mesh_key != key:
            self._mesh_obj, self._mesh_key = distributed.mesh(len(self._jax_devices), "data",
                                                              devices=self._jax_devices), key
        return self._mesh_obj

    def _place_model(self, model: nn.Module, mesh: Any) -> None:
        """Parameters and buffers on the mesh: replicated (``dp``) or split along dim 0 (``fsdp``)."""
        if mesh is None:
            return
        from torch_tpu import distributed

        if self.sharding == "dp":
            distributed.replicate_module(model, mesh)
            return
        for t in (*model.parameters(), *model.buffers()):
            self._shard_rows(t, mesh)

    def _shard_rows(self, t: torch.Tensor, mesh: Any) -> None:
        from torch_tpu import distributed

        if t.dim() and t.shape[0] % mesh.devices.size == 0:
            distributed.shard(t, mesh, ("data",))
        else:
            distributed.replicate(t, mesh)

    def _place_optimizer_state(self, opt: torch.optim.Optimizer, mesh: Any) -> None:
        """``fsdp``: the optimizer state (made on the first step) split like its parameters."""
        if mesh is None or self.sharding != "fsdp":
            return
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.device.type == "tpu" and v.dim():
                    self._shard_rows(v, mesh)

    @staticmethod
    def _shard_batch(b: Batch, mesh: Any) -> None:
        """Splits every batch tensor along its rows over the mesh: XLA then reduces the gradients."""
        if mesh is None:
            return
        from torch_tpu import distributed

        n = mesh.devices.size

        def place(t: torch.Tensor) -> torch.Tensor:
            if t.dim() and t.shape[0] % n == 0:
                distributed.shard(t, mesh, ("data",))
            return t

        map_tensors((b.args, b.kwargs, b.target, b.mask), place)

    # ------------------------------------------------------------------ plumbing
    def _to_device(self, model: nn.Module) -> None:
        """Moves ``model`` to the tpu unless it is there already (a no-op move would still swap every
        parameter, which fails once torch.compile holds weak references to them)."""
        if any(t.device.type != "tpu" for t in (*model.parameters(), *model.buffers())):
            model.to(self.device)

    def _eager_mode(self) -> contextlib.AbstractContextManager:
        # Compile mode runs what Dynamo leaves outside its graphs op by op (strict).
        return torch_tpu.set_eager_mode("fused" if self.mode == "fused" else "strict")

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(device_type="tpu", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _end_step(self) -> None:
        """Cuts the fused trace: what the step recorded runs now, as one program, asynchronously."""
        if self.mode == "fused":
            fused.flush("step")

    @staticmethod
    def _compile_counters() -> tuple[int, float]:
        m = torch_tpu.metrics()  # counts every program compiled, fused traces (cache_stats' misses) included
        return m["compile_count"], m["compile_seconds"]

    def _progress(self, total: int | None, desc: str) -> Any:
        from tqdm.auto import tqdm

        quiet = not self.verbose or not sys.stderr.isatty()
        return tqdm(total=total, desc=desc, disable=quiet, leave=True, unit="step")

    def _say(self, bar: Any, text: str) -> None:
        log.info(text)
        if self.verbose and sys.stderr.isatty():
            bar.write(text)

    @staticmethod
    def _make_optimizer(model: nn.Module, optimizer: Any) -> torch.optim.Optimizer:
        if optimizer is None:
            return torch.optim.AdamW(model.parameters(), lr=1e-3)
        if isinstance(optimizer, torch.optim.Optimizer):
            mine = {id(p) for p in model.parameters()}
            theirs = [p for g in optimizer.param_groups for p in g["params"]]
            if theirs and not any(id(p) in mine for p in theirs):
                raise ValueError(
                    "the optimizer holds none of the model's parameters: Module.to(tpu) replaces them, so create "
                    "the optimizer after model.to(est), or pass a factory such as lambda p: torch.optim.SGD(p, lr=0.1)"
                )
            return optimizer
        if callable(optimizer):
            return optimizer(model.parameters())
        raise TypeError(f"optimizer: expected an Optimizer or a factory of parameters, got {type(optimizer)}")

    @staticmethod
    def _make_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
        if scheduler is None or hasattr(scheduler, "step"):
            return scheduler
        if callable(scheduler):
            return scheduler(optimizer)
        raise TypeError(f"scheduler: expected an LRScheduler or a factory of the optimizer, got {type(scheduler)}")

    @staticmethod
    def _loader_batch_size(loader: Iterable) -> int | None:
        return getattr(loader, "batch_size", None)

    def _prepare(self, raw: Any, full: int | None, padding: bool, with_target: bool = True, mesh: Any = None) -> Batch:
        """Pads a partial batch on the host (when the loss can mask it), then sends it to the device."""
        n = batch_size(raw)
        if self.bucket_lengths:
            raw = pad_sequences(raw, self.bucket_lengths)
        padded = padding and full is not None and n < full and isinstance(raw, (tuple, list)) and len(raw) >= 2
        if padded:
            raw_dev = pad_rows(raw, full)
        else:
            raw_dev = raw
        b = split(raw_dev, self.device, with_target=with_target)
        rows = full if padded else n
        b.size = n
        b.padded_to = full if padded else None
        if n == rows:  # a full batch: one mask of ones, sent once
            if self._ones.get(rows) is None:
                self._ones[rows] = torch.ones(rows).to(self.device)
            b.mask = self._ones[rows]
        else:
            b.mask = (torch.arange(rows) < n).float().to(self.device, non_blocking=True)
        b.raw = raw  # the host batch without row padding, for custom losses and error messages
        self._shard_batch(b, mesh)
        return b

    # ------------------------------------------------------------------ the step
    def _micro_loss(self, model: nn.Module, b: Batch, loss_fn: Callable | None, total: Any) -> tuple[Any, bool]:
        """Forward and loss of one micro-batch: (the loss, whether it is the default masked loss).

        The default loss weights each element by its row mask and divides by the whole group's
        weight ``total``, so a padded batch and gradient accumulation both give exactly the mean
        over real elements."""
        with self._autocast():
            out = model(*b.args, **b.kwargs)
            loss = _unmaskable_loss(model, out, b, loss_fn)
            if loss is not None:
                return loss, False
            if b.target is None:
                raise LossConfigError(
                    "the batch has no target and the model returned no loss: pass loss_fn(outputs, batch), "
                    "or batches (inputs..., target)"
                )
            if total is None:
                raise TypeError("a batch without a target in a group of batches with targets")
            per = _elementwise_loss(_prediction(out), b.target)
            return (per * _row_weights(b.target, b.mask)).sum() / total, True

    def _step_fn(self, model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable | None,
                 clip: float | None) -> Callable:
        """The whole optimizer step over a group of micro-batches, as one function (compiled as one
        graph in compile mode; recorded as one trace in fused mode)."""

        def forward_backward(micro: list[Batch]) -> torch.Tensor:
            k = len(micro)
            total = None
            if loss_fn is None and all(b.target is not None for b in micro):
                total = _row_weights(micro[0].target, micro[0].mask).sum()
                for b in micro[1:]:
                    total = total + _row_weights(b.target, b.mask).sum()
                total = total.clamp(min=1.0)
            report = None
            for b in micro:
                loss, masked = self._micro_loss(model, b, loss_fn, total)
                if not masked:
                    loss = loss / k
                loss.backward()
                report = loss.detach() if report is None else report + loss.detach()
            return report.float()

        def finish_step() -> None:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)

        def step_many(micro: list[Batch]) -> torch.Tensor:
            report = forward_backward(micro)
            finish_step()
            return report

        def step_one(b: Batch) -> torch.Tensor:
            # Straight-line code for the usual single micro-batch: Dynamo gives up on a whole
            # function when a graph break (backward) falls inside a loop, so this path has none.
            total = None
            if loss_fn is None and b.target is not None:
                total = _row_weights(b.target, b.mask).sum().clamp(min=1.0)
            loss, _ = self._micro_loss(model, b, loss_fn, total)
            report = loss.detach().float()  # before the graph break, so in the forward's graph
            loss.backward()
            finish_step()
            return report

        if self.mode == "compile":
            # Dynamo specialises on a Python-float learning rate and would recompile whenever a
            # scheduler changes it; as a 0-dim tensor it is a graph input.
            for g in opt.param_groups:
                if not isinstance(g["lr"], torch.Tensor):
                    g["lr"] = torch.tensor(float(g["lr"]))
            step_one = torch.compile(step_one, backend="tpu")
            step_many = torch.compile(step_many, backend="tpu")
        return lambda micro: step_one(micro[0]) if len(micro) == 1 else step_many(micro)

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        model: nn.Module,
        train_loader: Iterable,
        *,
        loss_fn: Callable | None = None,
        optimizer: Any = None,
        epochs: int = 1,
        max_steps: int | None = None,
        val_loader: Iterable | None = None,
        metrics: Sequence[str | Callable] | dict[str, str | Callable] | None = None,
        scheduler: Any = None,
        grad_accum_steps: int = 1,
        clip_grad_norm: float | None = None,
        callbacks: Sequence[Callback | Callable] = (),
        checkpoint_dir: str | None = None,
        resume: bool = True,
        log_every: int = 50,
    ) -> History:
        """Trains ``model`` and returns its :class:`History`.

        ``metrics`` are measured on ``val_loader`` after each epoch (as ``val_<name>``).
        ``optimizer``: an Optimizer, or a factory called with the parameters (default AdamW, lr 1e-3).
        ``scheduler``: an LRScheduler or a factory called with the optimizer; stepped every step.
        ``callbacks``: :class:`Callback` objects, or callables ``fn(est, logs)`` run at each step end.
        ``checkpoint_dir``: checkpoints at each epoch end, every ``checkpoint_every`` steps and on
        KeyboardInterrupt; with ``resume=True`` a run continues from the newest one there.
        """
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps={grad_accum_steps}: must be at least 1")
        if hasattr(train_loader, "__len__") and len(train_loader) == 0:
            raise ValueError("train_loader is empty: it yields no batches")
        self._to_device(model)
        opt = self._make_optimizer(model, optimizer)
        sched = self._make_scheduler(scheduler, opt)
        cbs = [c if isinstance(c, Callback) else _StepEndCallable(c) for c in callbacks]
        run = _Run(history=History())
        self.stop_training = False
        resumed: dict[str, Any] | None = None
        if checkpoint_dir and resume:
            path = ckpt.latest(checkpoint_dir)
            if path is not None:
                resumed = ckpt.load(path, model)
                opt.load_state_dict(resumed["optimizer"])
                if sched is not None and resumed.get("scheduler") is not None:
                    sched.load_state_dict(resumed["scheduler"])
                run.history = History.from_dict(resumed["history"])
                run.step, run.epoch, run.batch = resumed["step"], resumed["epoch"], resumed["batch"]
                self._say_plain(f"resumed from {path} at epoch {run.epoch}, step {run.step}")
        history = run.history
        first_step = run.step
        full = self._loader_batch_size(train_loader)
        # Padding rows would enter BatchNorm's batch statistics: such a model runs its last partial
        # batch unpadded (one more program) rather than train on different numbers.
        padding = self.pad_last_batch and not any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                                  for m in model.modules())
        mesh: Any = _UNSET
        compiles0, seconds0 = self._compile_counters()
        base_compiles, base_seconds = history.programs_compiled, history.compile_seconds

        def count_compiles() -> None:
            c, s = self._compile_counters()
            history.programs_compiled = base_compiles + c - compiles0
            history.compile_seconds = round(base_seconds + s - seconds0, 4)

        def finish(entry: dict, value: torch.Tensor) -> None:
            v = float(value.item())
            entry["loss"] = v
            if not math.isfinite(v) and self.stop_on_nonfinite:
                raise FloatingPointError(
                    f"the loss is {v} at step {entry['step']} (epoch {entry['epoch']}, batch {entry['batch']}); "
                    "training stopped. The last checkpoint, if any, is intact."
                )

        def drain() -> None:
            while run.pending:
                finish(*run.pending.pop(0))

        def save() -> None:
            if not checkpoint_dir:
                return
            drain()
            count_compiles()
            state = {
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict() if sched is not None else None,
                "cpu_rng": torch.get_rng_state(),
                "tpu_rng": torch.tpu.get_rng_state(),
                "epoch_rng": run.epoch_rng,
                "step": run.step,
                "epoch": run.epoch,
                "batch": run.batch,
                "history": history.to_dict(),
            }
            ckpt.save(checkpoint_dir, model, state, run.step, keep=self.keep_checkpoints)

        old_handler = None
        if checkpoint_dir and threading.current_thread() is threading.main_thread():
            # Ctrl-C mid-step would leave half-updated weights: note it, and stop between steps.
            def on_sigint(signum: int, frame: Any) -> None:
                if run.interrupted:  # a second Ctrl-C stops at once
                    raise KeyboardInterrupt
                run.interrupted = True

            old_handler = signal.signal(signal.SIGINT, on_sigint)
        model.train()
        for c in cbs:
            c.on_fit_start(self, {"step": run.step, "epoch": run.epoch})
        try:
            with self._eager_mode():
                step_fn = self._step_fn(model, opt, loss_fn, clip_grad_norm)
                while run.epoch < epochs and not (max_steps is not None and run.step >= max_steps):
                    epoch = run.epoch
                    # The data position: the CPU RNG as the epoch began (the loader's shuffle draws
                    # from it), then the batches already consumed are skipped.
                    if resumed is not None and run.batch:
                        torch.set_rng_state(resumed["epoch_rng"])
                    elif resumed is not None:
                        torch.set_rng_state(resumed["cpu_rng"])
                    run.epoch_rng = torch.get_rng_state()
                    it = iter(train_loader)
                    for _ in range(run.batch):
                        next(it)
                    if resumed is not None:
                        torch.tpu.set_rng_state(resumed["tpu_rng"])
                        resumed = None
                    n_batches = len(train_loader) if hasattr(train_loader, "__len__") else None
                    total = None if n_batches is None else math.ceil((n_batches - run.batch) / grad_accum_steps)
                    bar = self._progress(total, f"epoch {epoch + 1}/{epochs}")
                    t_epoch = t_prev = time.perf_counter()
                    samples, index, group = 0, run.batch, []
                    raw_next = _safe_next(it)
                    if raw_next is _END and run.batch == 0:
                        raise ValueError("train_loader is empty: it yields no batches")
                    while raw_next is not _END:
                        raw = raw_next
                        if full is None:
                            full = batch_size(raw)
                        if mesh is _UNSET:
                            mesh = self._data_mesh(full)
                            self._place_model(model, mesh)
                        b = self._prepare(raw, full, padding, mesh=mesh)
                        b.index, index = index, index + 1
                        group.append(b)
                        raw_next = _safe_next(it)  # the next batch loads while this step runs
                        if len(group) < grad_accum_steps and raw_next is not _END:
                            continue
                        c0 = self._compile_counters()
                        try:
                            value = step_fn(group)
                            self._end_step()
                        except (RuntimeError, ValueError, TypeError) as e:
                            if isinstance(e, (BatchError, LossConfigError)):
                                raise
                            where = "; ".join(f"batch {g.index} with shapes {shapes_of(g.raw)}" for g in group)
                            raise BatchError(f"training failed on {where}: {type(e).__name__}: {e}") from e
                        if run.step == first_step and mesh is not _UNSET:
                            self._place_optimizer_state(opt, mesh)
                        lr = float(opt.param_groups[0]["lr"])  # the rate this step used
                        if sched is not None:
                            sched.step()
                        run.step += 1
                        rows = sum(g.size for g in group)
                        samples += rows
                        entry = {"step": run.step, "epoch": epoch, "batch": group[-1].index, "lr": lr}
                        run.pending.append((entry, value))
                        # the host reads step N-2's loss while N-1 and N are queued: the device never
                        # waits for Python between steps (a NaN still stops training two steps later)
                        while len(run.pending) > _STEPS_IN_FLIGHT:
                            finish(*run.pending.pop(0))
                        c1 = self._compile_counters()
                        if c1[0] > c0[0]:
                            self._say(bar, f"compiled {c1[0] - c0[0]} program(s) in {c1[1] - c0[1]:.2f} s "
                                      f"at step {run.step}")
                        now = time.perf_counter()
                        entry["samples_per_s"] = rows / (now - t_prev) if now > t_prev else float("nan")
                        t_prev = now
                        history.steps.append(entry)
                        run.batch = group[-1].index + 1
                        group = []
                        bar.update(1)
                        if run.step % max(log_every, 1) == 0:
                            drain()
                            bar.set_postfix(loss=f"{entry['loss']:.4g}", samples_s=f"{samples / (now - t_epoch):.0f}")
                        if cbs:
                            drain()
                            for c in cbs:
                                c.on_step_end(self, dict(entry))
                        if run.interrupted:
                            raise KeyboardInterrupt
                        if self.checkpoint_every and run.step % self.checkpoint_every == 0:
                            save()
                        if self.stop_training or (max_steps is not None and run.step >= max_steps):
                            break
                    drain()
                    seconds = time.perf_counter() - t_epoch
                    if history.steps and "loss" in history.steps[-1]:
                        bar.set_postfix(loss=f"{history.steps[-1]['loss']:.4g}", samples_s=f"{samples / seconds:.0f}")
                    bar.close()
                    ep_losses = [s["loss"] for s in history.steps if s["epoch"] == epoch]
                    logs: dict[str, Any] = {
                        "epoch": epoch,
                        "loss": sum(ep_losses) / len(ep_losses) if ep_losses else float("nan"),
                        "samples": samples,
                        "seconds": round(seconds, 4),
                        "samples_per_s": samples / seconds if seconds > 0 else float("nan"),
                        "last_step": run.step,
                    }
                    if val_loader is not None:
                        val = self.evaluate(model, val_loader, metrics=metrics, loss_fn=loss_fn, _nested=True)
                        model.train()
                        logs.update({f"val_{k}": v for k, v in val.items()})
                        for c in cbs:
                            c.on_validation_end(self, dict(val))
                    history.epochs.append(logs)
                    for c in cbs:
                        c.on_epoch_end(self, logs)
                    if raw_next is _END:  # the epoch ran to its end
                        run.epoch, run.batch = epoch + 1, 0
                    save()
                    if self.stop_training:
                        history.stopped_early = True
                        break
        except KeyboardInterrupt:
            if checkpoint_dir:
                save()
                self._say_plain(f"interrupted: saved a checkpoint at step {run.step} in {checkpoint_dir}")
            raise
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
        count_compiles()
        for c in cbs:
            c.on_fit_end(self, history.to_dict())
        return history

    def _say_plain(self, text: str) -> None:
        log.info(text)
        if self.verbose and sys.stderr.isatty():
            print(text, file=sys.stderr)

    # ------------------------------------------------------------------ evaluate and predict
    def evaluate(
        self,
        model: nn.Module,
        loader: Iterable,
        metrics: Sequence[str | Callable] | dict[str, str | Callable] | None = None,
        *,
        loss_fn: Callable | None = None,
        _nested: bool = False,
    ) -> dict[str, float]:
        """The mean loss over ``loader`` and each metric: ``"accuracy"``, ``"mse"`` or a callable
        ``metric(outputs, target) -> number`` (averaged over batches, weighted by rows)."""
        named = _named_metrics(metrics)
        self._to_device(model)
        model.eval()
        full = self._loader_batch_size(loader)
        sums: dict[str, list] = {}
        seen = 0
        mesh: Any = _UNSET
        ctx = contextlib.nullcontext() if _nested else self._eager_mode()
        with ctx, torch.no_grad():
            for i, raw in enumerate(loader):
                if full is None:
                    full = batch_size(raw)
                if mesh is _UNSET:
                    mesh = self._data_mesh(full)
                    self._place_model(model, mesh)
                b = self._prepare(raw, full, self.pad_last_batch, mesh=mesh)
                seen += 1
                try:
                    with self._autocast():
                        out = model(*b.args, **b.kwargs)
                except (RuntimeError, ValueError, TypeError) as e:
                    raise BatchError(f"evaluation failed on batch {i} with shapes {shapes_of(raw)}: {e}") from e
                parts: dict[str, tuple[Any, Any]] = {}
                loss = _unmaskable_loss(model, out, b, loss_fn)
                if loss is not None:
                    parts["loss"] = (loss.float() * b.size, b.size)
                elif b.target is not None:
                    w = _row_weights(b.target, b.mask)
                    parts["loss"] = ((_elementwise_loss(_prediction(out), b.target) * w).sum(), w.sum())
                for name, m in named.items():
                    if b.target is None:
                        raise TypeError(f"metric {name!r} needs batches (inputs..., target)")
                    pred = _prediction(out)
                    if m == "accuracy":
                        parts[name] = _accuracy_parts(pred, b.target, _row_weights(b.target, b.mask))
                    elif m == "mse":
                        parts[name] = _mse_parts(pred, b.target, b.mask)
                    else:
                        n = b.size
                        v = m(pred[:n], b.target[:n])
                        parts[name] = (v * n, n)
                for k, (s, w) in parts.items():
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] = acc[0] + s
                    acc[1] = acc[1] + w
                self._end_step()
        if seen == 0:
            raise ValueError("the evaluation loader is empty: it yields no batches")
        return {k: float(_host(s)) / max(float(_host(w)), 1e-12) for k, (s, w) in sums.items()}

    def predict(self, model: nn.Module, loader: Iterable) -> Any:
        """Runs ``model`` over ``loader`` without gradients and returns its outputs as CPU tensors,
        concatenated in loader order (a list of per-batch tensors when their shapes differ beyond the
        batch dim, as variable-length sequences do). Batches follow ``fit``'s forms; a tuple ``(inputs..., target)``
        drops its last element, a 1-tuple or single tensor is all input. The last partial batch is
        padded (one program for every batch) and the padding cut from the result.
        Throughput and latency land in ``est.last_predict_stats``."""
        self._to_device(model)
        model.eval()
        full = self._loader_batch_size(loader)
        outs: list[Any] = []
        pending: list[tuple[Any, int]] = []
        t0 = time.perf_counter()
        rows = batches = 0
        mesh: Any = _UNSET
        with self._eager_mode(), torch.no_grad():
            for i, raw in enumerate(loader):
                n = batch_size(raw)
                if full is None:
                    full = n
                if mesh is _UNSET:
                    mesh = self._data_mesh(full)
                    self._place_model(model, mesh)
                host = pad_sequences(raw, self.bucket_lengths) if self.bucket_lengths else raw
                host = pad_rows(host, full) if self.pad_last_batch and n < full else host
                b = split(host, self.device, with_target=True)
                self._shard_batch(b, mesh)
                try:
                    with self._autocast():
                        out = model(*b.args, **b.kwargs)
                except (RuntimeError, ValueError, TypeError) as e:
                    raise BatchError(f"prediction failed on batch {i} with shapes {shapes_of(raw)}: {e}") from e
                self._end_step()
                if self.bucket_lengths:  # cut the sequence padding back off the outputs
                    lengths = [t.shape[1] for t in tensors_in(raw) if t.dim() >= 2]
                    if lengths:
                        padded_len = bucket_for(lengths[0], self.bucket_lengths)
                        out = map_tensors(out, lambda t, L=lengths[0], P=padded_len:
                                          t[:, :L] if t.dim() >= 2 and t.shape[1] == P else t)
                pending.append((out, n))
                if len(pending) > 1:  # copy batch i-1 to the host while batch i runs
                    outs.append(_to_cpu_rows(*pending.pop(0)))
                rows += n
                batches += 1
            while pending:
                outs.append(_to_cpu_rows(*pending.pop(0)))
        if not outs:
            raise ValueError("the prediction loader is empty: it yields no batches")
        seconds = time.perf_counter() - t0
        self.last_predict_stats = {
            "batches": batches,
            "samples": rows,
            "seconds": seconds,
            "samples_per_s": rows / seconds if seconds > 0 else float("nan"),
            "ms_per_batch": 1000 * seconds / batches,
        }
        return _concat(outs)


# ---------------------------------------------------------------------- helpers
_END = object()
_UNSET = object()


def _safe_next(it: Any) -> Any:
    try:
        return next(it)
    except StopIteration:
        return _END


@dataclass
class _Run:
    """Where a fit run stands: the data position a checkpoint records, and unread step losses."""

    history: History
    step: int = 0
    epoch: int = 0
    batch: int = 0
    epoch_rng: Any = None
    interrupted: bool = False
    pending: list = field(default_factory=list)


_STEPS_IN_FLIGHT = 2


def _unmaskable_loss(model: nn.Module, out: Any, b: Batch, loss_fn: Callable | None) -> Any:
    """The mean loss over the real rows from a custom ``loss_fn`` or the model's own loss; None when
    neither applies (the default loss, which weights rows itself).

    A ``loss_fn`` returning one loss per sample is masked: the padded rows of the last batch drop
    out, with no new program. A scalar loss (the model's own, or such a ``loss_fn``) cannot be
    masked, so a padded batch runs again on its real rows: one more program, for that batch only.
    """
    if loss_fn is not None:
        loss = loss_fn(out, _device_raw(b))
        if isinstance(loss, torch.Tensor) and loss.dim() > 0 and b.mask is not None and len(loss) == len(b.mask):
            per = loss.reshape(loss.shape[0], -1).float().mean(1)
            return (per * b.mask).sum() / b.mask.sum()
        if b.padded_to is not None:
            real = _cut_rows(b)
            return loss_fn(model(*real.args, **real.kwargs), _device_raw(real))
        return loss
    own = _own_loss(out)
    if own is not None and b.padded_to is not None:
        real = _cut_rows(b)
        own = _own_loss(model(*real.args, **real.kwargs))
    return own


def _cut_rows(b: Batch) -> Batch:
    """The batch without its padding rows (a new shape: one more program, for the last batch only)."""
    cut = lambda t: t[: b.size] if t.dim() else t
    args, kwargs, target = map_tensors((b.args, b.kwargs, b.target), cut)
    return replace(b, args=args, kwargs=kwargs, target=target, mask=None, padded_to=None)


def _device_raw(b: Batch) -> Any:
    """The batch as the model saw it, on the device, for a custom ``loss_fn(outputs, batch)``."""
    if b.kwargs:
        return b.kwargs
    if b.target is not None:
        return (*b.args, b.target)
    return b.args[0] if len(b.args) == 1 and not isinstance(b.raw, (tuple, list)) else tuple(b.args)


def _named_metrics(metrics: Any) -> dict[str, Any]:
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


def _host(x: Any) -> float:
    return x.item() if isinstance(x, torch.Tensor) else x


def _to_cpu_rows(out: Any, n: int) -> Any:
    return map_tensors(out, lambda t: t[:n].cpu() if t.dim() else t.cpu())


def _concat(outs: list[Any]) -> Any:
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if any(o.shape[1:] != first.shape[1:] for o in outs):
            return outs  # variable-length outputs: one tensor per batch
        return torch.cat(outs, 0)
    if isinstance(first, dict):
        return {k: _concat([o[k] for o in outs]) for k in first}
    if isinstance(first, (tuple, list)):
        return type(first)(_concat([o[i] for o in outs]) for i in range(len(first)))
    return outs
