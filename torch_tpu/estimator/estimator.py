"""TPUEstimator: ``fit``, ``evaluate``, ``predict`` and ``generate`` for a plain ``nn.Module``.

The estimator is also the device it drives: ``model.to(est)``, ``tensor.to(est)`` and
``torch.device(est)`` work because its class defines ``__torch_function__``, which torch consults
for every argument of ``Tensor.to``, ``Module.to`` and ``torch.device`` before parsing it, and in
which we swap the estimator for its ``torch.device``. (``torch.device`` itself cannot be
subclassed.)

A training step (forward, loss, backward, clipping, optimizer, scheduler) is one XLA program. By
default (``mode="auto"``) each shape bucket's step is captured once and replayed, which leaves the
host one executable call per step; the fused eager mode records it (``fused.flush`` cuts the trace
at the end of each step) for warm-up and when a step cannot be captured; or
``torch.compile(backend="tpu")`` compiles the step function. Shapes stay the same every step
because the last partial batch is padded and its padded rows masked out of the loss.

The parts, each in its module: :mod:`.placement` (the mesh, the model and batches on it),
:mod:`.losses` (which loss, exact on padded batches), :mod:`.step` (the step function and its
per-bucket runners), :mod:`.replay` (capture and replay), :mod:`.checkpoint` (resume, save,
Ctrl-C), :mod:`.loop` (the train loop), :mod:`.generation` (bucketed batch decoding).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import torch
from torch import nn

from torch_tpu.core.devices import platform
from torch_tpu.estimator.callbacks import Callback, EarlyStopping, as_callbacks
from torch_tpu.estimator.checkpoint import Checkpointer
from torch_tpu.estimator.data import batch_size, bucket_for, map_tensors, shapes_of, tensors_in
from torch_tpu.estimator.execution import Execution
from torch_tpu.estimator.generation import BatchGenerator
from torch_tpu.estimator.history import History
from torch_tpu.estimator.loop import BatchError, FitConfig, TrainLoop
from torch_tpu.estimator.losses import BatchLoss, Loss, LossConfigError, batch_loss
from torch_tpu.estimator.metrics import metric_parts, named_metrics
from torch_tpu.estimator.placement import Placement
from torch_tpu.estimator.replay import ReplayFallback
from torch_tpu.estimator.step import StepBuilder

__all__ = ["BatchError", "BatchLoss", "Callback", "EarlyStopping", "LossConfigError", "ReplayFallback", "TPUEstimator",
           "batch_loss"]

_MODES = ("auto", "compile", "fused", "strict")
_PRECISIONS = ("fp32", "bf16")


# ---------------------------------------------------------------------- the estimator
class TPUEstimator:
    """Trains, evaluates and predicts with a ``torch.nn.Module`` on the tpu device.

    ``devices``: None (every local device), a count, or a list of indices; with more than one,
    batches are sharded over them when :mod:`torch_tpu.distributed` is available.
    ``precision``: ``"fp32"`` or ``"bf16"`` (bf16 autocast, fp32 master weights).
    ``mode``: ``"auto"`` (each step bucket captured once and replayed, as CUDA graphs are; fused
    mode when the step cannot be captured, with a :class:`ReplayFallback` warning saying why: see
    :mod:`torch_tpu.estimator.replay`), ``"fused"`` (each step recorded and run as one program),
    ``"compile"`` (``torch.compile(backend="tpu")`` of the whole step), or ``"strict"`` (op by op,
    for debugging). ``History.execution`` says which ran.
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
                raise ValueError(f"devices={devices}: there are {len(local)} local {platform()} devices")
            chosen = local[:devices]
        else:
            idx = list(devices)
            bad = [i for i in idx if not 0 <= i < len(local)]
            if bad or not idx:
                raise ValueError(f"devices={idx}: indices must be in 0..{len(local) - 1}")
            chosen = [local[i] for i in idx]
        self._jax_devices = chosen
        self.precision = precision
        self.mode = mode
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
        self.last_generate_stats: dict[str, Any] = {}
        self.execution = Execution("fused" if mode == "auto" else mode, precision, replay=mode == "auto")
        self.placement = Placement(chosen, sharding, self.bucket_lengths, self.device)
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
            f"TPUEstimator(platform={platform()!r}, devices={n}, precision={self.precision!r}, "
            f"mode={self.mode!r})"
        )

    # ------------------------------------------------------------------ plumbing
    def _to_device(self, model: nn.Module) -> None:
        """Moves ``model`` to the tpu unless it is there already (a no-op move would still swap every
        parameter, which fails once torch.compile holds weak references to them)."""
        if any(t.device.type != "tpu" for t in (*model.parameters(), *model.buffers())):
            model.to(self.device)

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

        ``loss_fn``: ``loss_fn(outputs, target)``, any torch criterion (``nn.CrossEntropyLoss()``,
        ``F.mse_loss``) or function of the model's output and the batch's target (the last element
        of a tuple batch, or ``"labels"`` of a dict batch); or ``batch_loss(fn)`` for
        ``fn(outputs, batch)``, a loss over the whole batch. Default: the model's own loss, else
        cross entropy for integer targets and MSE for float ones. A per-sample loss
        (``reduction="none"``) is masked on the padded last batch; a scalar one runs that batch
        again on its real rows (see :mod:`torch_tpu.estimator.losses`).
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
        loss = Loss(loss_fn)
        self._to_device(model)
        if isinstance(loss_fn, nn.Module):  # a criterion's buffers (CrossEntropyLoss's weight)
            self._to_device(loss_fn)
        opt = self._make_optimizer(model, optimizer)
        sched = self._make_scheduler(scheduler, opt)
        self.stop_training = False
        # Padding rows would enter BatchNorm's batch statistics: such a model runs its last partial
        # batch unpadded (one more program) rather than train on different numbers.
        padding = self.pad_last_batch and not any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                                                  for m in model.modules())
        feeder = self.placement.feeder(model, self._loader_batch_size(train_loader), padding)
        loop = TrainLoop(
            self, model, opt, sched, train_loader,
            feeder=feeder,
            make_builder=lambda: StepBuilder(model, opt, loss, clip_grad_norm, self.execution, lambda: feeder.mesh),
            checkpointer=Checkpointer(checkpoint_dir, self.keep_checkpoints, resume),
            callbacks=as_callbacks(callbacks),
            config=FitConfig(epochs, max_steps, grad_accum_steps, log_every, val_loader, metrics, loss_fn),
        )
        return loop.run()

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
        named = named_metrics(metrics)
        loss = Loss(loss_fn)
        self._to_device(model)
        if isinstance(loss_fn, nn.Module):
            self._to_device(loss_fn)
        model.eval()
        feed = self.placement.feeder(model, self._loader_batch_size(loader), self.pad_last_batch)
        sums: dict[str, list] = {}
        seen = 0
        forward = self.execution.forward(model)
        ctx = contextlib.nullcontext() if _nested else self.execution.eager_mode()
        with ctx, torch.no_grad():
            for i, raw in enumerate(loader):
                b = feed(raw)
                seen += 1
                try:
                    with self.execution.autocast():
                        out = forward(*b.args, **b.kwargs)
                except (RuntimeError, ValueError, TypeError, AttributeError) as e:
                    raise BatchError(f"evaluation failed on batch {i} with shapes {shapes_of(raw)}: {e}") from e
                parts: dict[str, tuple[Any, Any]] = {}
                loss_parts = loss.eval_parts(model, out, b)
                if loss_parts is not None:
                    parts["loss"] = loss_parts
                for name, m in named.items():
                    parts[name] = metric_parts(name, m, out, b)
                for k, (s, w) in parts.items():
                    acc = sums.setdefault(k, [0.0, 0.0])
                    acc[0] = acc[0] + s
                    acc[1] = acc[1] + w
                self.execution.end_step()
        if seen == 0:
            raise ValueError("the evaluation loader is empty: it yields no batches")
        return {k: float(_host(s)) / max(float(_host(w)), 1e-12) for k, (s, w) in sums.items()}

    def predict(self, model: nn.Module, loader: Iterable) -> Any:
        """Runs ``model`` over ``loader`` without gradients and returns its outputs as CPU tensors,
        concatenated in loader order (a list of per-batch tensors when their shapes differ beyond the
        batch dim, as variable-length sequences do). Batches follow ``fit``'s forms; a tuple ``(inputs..., target)``
        drops its last element, a 1-tuple or single tensor is all input. The last partial batch is
        padded (one program for every batch) and the padding cut from the result, on the host. In
        compile mode the forward runs under ``torch.compile``: one program per shape bucket.
        Throughput and latency land in ``est.last_predict_stats``."""
        self._to_device(model)
        model.eval()
        feed = self.placement.feeder(model, self._loader_batch_size(loader), self.pad_last_batch,
                                     any_form=True, with_mask=False)
        outs: list[Any] = []
        pending: list[tuple[Any, int, Any]] = []
        forward = self.execution.forward(model)
        t0 = time.perf_counter()
        rows = batches = 0
        with self.execution.eager_mode(), torch.no_grad():
            for i, raw in enumerate(loader):
                n = batch_size(raw)
                b = feed(raw)
                try:
                    with self.execution.autocast():
                        out = forward(*b.args, **b.kwargs)
                except (RuntimeError, ValueError, TypeError, AttributeError) as e:
                    raise BatchError(f"prediction failed on batch {i} with shapes {shapes_of(raw)}: {e}") from e
                self.execution.end_step()
                cut = None  # (the length, its bucket): the sequence padding to cut off the outputs
                if self.bucket_lengths:
                    lengths = [t.shape[1] for t in tensors_in(raw) if t.dim() >= 2]
                    if lengths:
                        cut = lengths[0], bucket_for(lengths[0], self.bucket_lengths)
                pending.append((out, n, cut))
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


    def generate(self, model: nn.Module, prompts_loader: Iterable, *, max_new_tokens: int,
                 **generate_kwargs: Any) -> torch.Tensor:
        """Decodes every batch of ``prompts_loader`` with ``model.generate`` (a transformers causal
        LM) and returns the new token ids, ``[prompts, max_new_tokens]`` on the CPU, in loader order.

        A batch is a ``[batch, length]`` tensor of token ids, a dict with ``"input_ids"`` (and
        ``"attention_mask"``), or a tuple ``(ids, mask)``. Prompts are padded on the left to their
        bucket (``bucket_lengths``; without them each prompt length is its own bucket) and a short
        last batch to the full batch size, so each bucket compiles its prefill and its decode step
        once, with a static KV cache of its own (:mod:`torch_tpu.estimator.generation`).
        ``generate_kwargs`` go to ``generate()`` (``do_sample``, ``temperature``, ``eos_token_id``,
        ``pad_token_id``, ...). A row that ends early is filled with the pad token id. Figures land in
        ``est.last_generate_stats``."""
        self._to_device(model)
        model.eval()
        return BatchGenerator(self, model, max_new_tokens, generate_kwargs).run(prompts_loader)


# ---------------------------------------------------------------------- helpers
def _host(x: Any) -> float:
    return x.item() if isinstance(x, torch.Tensor) else x


def _to_cpu_rows(out: Any, n: int, cut: tuple[int, int] | None) -> Any:
    """The real rows (and real sequence positions) of a batch's outputs on the host: copied whole,
    then cut on the host, so a short last batch or a short sequence adds no device program."""
    def host(t: torch.Tensor) -> torch.Tensor:
        t = t.cpu()
        if not t.dim():
            return t
        t = t[:n]
        if cut is not None and t.dim() >= 2 and t.shape[1] == cut[1]:
            t = t[:, : cut[0]]
        return t

    return map_tensors(out, host)


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
