"""The train loop of ``fit``: epochs of steps, the losses read back late, progress, callbacks,
validation and checkpoints.

Step losses stay on the device: the host reads them a few at a time, as one sync point, once
``STEPS_IN_FLIGHT`` are pending, leaving the last ``STEPS_QUEUED`` unread (and all of them at
``log_every`` steps, before checkpoints, and when a step-end callback looks at its logs), so the
device never waits for Python between steps, and the host pays one read per few steps.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch_tpu.estimator.callbacks import Callback, StepLogs, steps_hooked
from torch_tpu.estimator.checkpoint import Checkpointer, RunState
from torch_tpu.estimator.data import Batch, shapes_of
from torch_tpu.estimator.execution import compile_counters
from torch_tpu.estimator.history import History
from torch_tpu.estimator.losses import LossConfigError
from torch_tpu.estimator.placement import Feeder
from torch_tpu.estimator.step import StepBuilder
from torch_tpu.tensor import storage as _storage

# the estimator's type, named rather than imported: estimator.py imports this module
TPUEstimator = Any

log = logging.getLogger("torch_tpu.estimator")

# Losses not yet read: past STEPS_IN_FLIGHT, all but the last STEPS_QUEUED are read at once. A
# read per step (the last two left queued) made the host wait on the device at every step
# (docs/performance.md has gpt-tiny's replayed step measured both ways). A NaN loss still stops
# training, naming its step, at most STEPS_IN_FLIGHT steps later (at once where a checkpoint is
# due: save() reads them all).
STEPS_IN_FLIGHT = 16
STEPS_QUEUED = 2
_END = object()


class BatchError(RuntimeError):
    """A batch the model or the loss could not take; names the batch index and its shapes."""


@dataclass
class FitConfig:
    """The arguments of one ``fit`` call that shape its loop."""

    epochs: int
    max_steps: int | None
    grad_accum_steps: int
    log_every: int
    val_loader: Iterable | None
    metrics: Any
    loss_fn: Any


@dataclass
class _Epoch:
    """The running figures of the epoch in progress."""

    index: int
    bar: Any
    t_start: float
    t_prev: float
    samples: int = 0
    ran_to_end: bool = False


def say(est: TPUEstimator, text: str, bar: Any = None) -> None:
    """A log line, and on a terminal (when verbose) a line on stderr."""
    log.info(text)
    if est.verbose and sys.stderr.isatty():
        if bar is not None:
            bar.write(text)
        else:
            print(text, file=sys.stderr)


class TrainLoop:
    """One ``fit`` run: its model, optimizer, loss, batches, step and checkpoints, and the loop."""

    def __init__(self, est: TPUEstimator, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
                 loader: Iterable, feeder: Feeder, make_builder: Any, checkpointer: Checkpointer,
                 callbacks: list[Callback], config: FitConfig) -> None:
        self.est, self.model, self.opt, self.sched = est, model, opt, sched
        self.loader, self.feeder, self.make_builder = loader, feeder, make_builder
        self.checkpointer, self.callbacks, self.config = checkpointer, callbacks, config
        self._step_callbacks = steps_hooked(callbacks)
        self.run_state = RunState()
        self.pending: list[tuple[dict, torch.Tensor]] = []  # steps whose loss the host has not read
        self._placed_optimizer = False

    @property
    def history(self) -> History:
        return self.run_state.history

    # ------------------------------------------------------------------ the run
    def run(self) -> History:
        run = self.run_state
        path = self.checkpointer.resume(self.model, self.opt, self.sched, run)
        if path is not None:
            say(self.est, f"resumed from {path} at epoch {run.epoch}, step {run.step}")
        self._compiles0 = compile_counters()
        self._base = (self.history.programs_compiled, self.history.compile_seconds)
        self._replay_base = (self.history.replayed_steps, self.history.graphs_captured)
        self.model.train()
        for c in self.callbacks:
            c.on_fit_start(self.est, {"step": run.step, "epoch": run.epoch})
        with self.checkpointer.interrupts(run, self.save, lambda text: say(self.est, text)):
            with self.est.execution.eager_mode():
                self.builder: StepBuilder = self.make_builder()
                while run.epoch < self.config.epochs and not self._at_max_steps():
                    self._epoch()
                    if self.est.stop_training:
                        self.history.stopped_early = True
                        break
        self._count_compiles()
        for c in self.callbacks:
            c.on_fit_end(self.est, self.history.to_dict())
        return self.history

    def _record_execution(self) -> None:
        """How the steps ran, in the history: replayed, or in which mode and (fallen back) why."""
        h, plan = self.history, getattr(getattr(self, "builder", None), "replay", None)
        if plan is None:
            h.execution = self.est.execution.mode
            return
        h.execution = "replay" if plan.fallback is None else "fused"
        h.replay_fallback = plan.fallback
        h.replayed_steps = self._replay_base[0] + plan.replays
        h.graphs_captured = self._replay_base[1] + plan.captures

    def _at_max_steps(self) -> bool:
        return self.config.max_steps is not None and self.run_state.step >= self.config.max_steps

    # ------------------------------------------------------------------ one epoch
    def _epoch(self) -> None:
        run, cfg = self.run_state, self.config
        self.checkpointer.restore_loader_rng()
        run.epoch_rng = torch.get_rng_state()  # the loader's shuffle draws from it
        it = iter(self.loader)
        for _ in range(run.batch):  # the batches a resumed run consumed already
            next(it)
        self.checkpointer.restore_device_rng()
        n_batches = len(self.loader) if hasattr(self.loader, "__len__") else None
        total = None if n_batches is None else math.ceil((n_batches - run.batch) / cfg.grad_accum_steps)
        now = time.perf_counter()
        ep = _Epoch(run.epoch, self._progress(total, f"epoch {run.epoch + 1}/{cfg.epochs}"), now, now)
        for group in self._groups(it, ep):
            self._step(group, ep)
            if self.est.stop_training or self._at_max_steps():
                break
        self._end_epoch(ep)

    def _groups(self, it: Iterator, ep: _Epoch) -> Iterator[list[Batch]]:
        """The batches of the rest of the epoch on the device, ``grad_accum_steps`` per step. The
        next batch loads before a step runs, so the step's device work overlaps it."""
        index = self.run_state.batch
        raw_next = next(it, _END)
        if raw_next is _END and index == 0:
            raise ValueError("train_loader is empty: it yields no batches")
        group: list[Batch] = []
        while raw_next is not _END:
            b = self.feeder(raw_next)
            b.index, index = index, index + 1
            group.append(b)
            raw_next = next(it, _END)
            if len(group) < self.config.grad_accum_steps and raw_next is not _END:
                continue
            ep.ran_to_end = raw_next is _END
            yield group
            group = []

    # ------------------------------------------------------------------ one step
    def _step(self, group: list[Batch], ep: _Epoch) -> None:
        run, est = self.run_state, self.est
        c0 = compile_counters()
        try:
            value = self.builder.runner(group).run(group)
        except (RuntimeError, ValueError, TypeError, AttributeError) as e:
            if isinstance(e, (BatchError, LossConfigError)):
                raise
            self.builder.explain_failure(group)
            where = "; ".join(f"batch {g.index} with shapes {shapes_of(g.raw)}" for g in group)
            raise BatchError(f"training failed on {where}: {type(e).__name__}: {e}") from e
        if not self._placed_optimizer:  # its state exists from the first step on
            est.placement.place_optimizer_state(self.opt, self.feeder.mesh)
            self._placed_optimizer = True
        lr = float(self.opt.param_groups[0]["lr"])  # the rate this step used
        if self.sched is not None:
            self.sched.step()
        run.step += 1
        rows = sum(g.size for g in group)
        ep.samples += rows
        entry = {"step": run.step, "epoch": ep.index, "batch": group[-1].index, "lr": lr}
        self.pending.append((entry, value))
        if len(self.pending) > STEPS_IN_FLIGHT:
            self._drain(keep=STEPS_QUEUED)
        c1 = compile_counters()
        if c1[0] > c0[0]:
            say(est, f"compiled {c1[0] - c0[0]} program(s) in {c1[1] - c0[1]:.2f} s at step {run.step}", ep.bar)
        now = time.perf_counter()
        entry["samples_per_s"] = rows / (now - ep.t_prev) if now > ep.t_prev else float("nan")
        ep.t_prev = now
        self.history.steps.append(entry)
        run.batch = group[-1].index + 1
        ep.bar.update(1)
        if run.step % max(self.config.log_every, 1) == 0:
            self._drain()
            ep.bar.set_postfix(loss=f"{entry['loss']:.4g}", samples_s=f"{ep.samples / (now - ep.t_start):.0f}")
        if self._step_callbacks:
            def fetch() -> dict[str, Any]:
                self._drain()
                return {"loss": entry["loss"]}

            for c in self._step_callbacks:
                c.on_step_end(est, StepLogs(entry, None if "loss" in entry else fetch))
        if run.interrupted:
            raise KeyboardInterrupt
        if est.checkpoint_every and run.step % est.checkpoint_every == 0:
            self.save()

    def _read_losses(self, pending: list[tuple[dict, torch.Tensor]]) -> None:
        # the steps' losses are tpu tensors: read straight from their arrays, all at one sync
        # point (counted as an item() is), without an op dispatch per step
        values = [v for _, v in pending]
        if all(v.device.type == "tpu" for v in values):
            read = [float(a.item()) for a in _storage.to_numpy_many(values)]
        else:
            read = [float(v.item()) for v in values]
        for (entry, _), v in zip(pending, read):
            entry["loss"] = v
            if not math.isfinite(v) and self.est.stop_on_nonfinite:
                raise FloatingPointError(
                    f"the loss is {v} at step {entry['step']} (epoch {entry['epoch']}, batch {entry['batch']}); "
                    "training stopped. The last checkpoint, if any, is intact."
                )

    def _drain(self, keep: int = 0) -> None:
        """Reads the pending losses, oldest first, all but the last ``keep``."""
        n = len(self.pending) - keep
        if n > 0:
            ready, self.pending = self.pending[:n], self.pending[n:]
            self._read_losses(ready)

    # ------------------------------------------------------------------ the epoch's end
    def _end_epoch(self, ep: _Epoch) -> None:
        run, history = self.run_state, self.history
        self._drain()
        seconds = time.perf_counter() - ep.t_start
        if history.steps and "loss" in history.steps[-1]:
            ep.bar.set_postfix(loss=f"{history.steps[-1]['loss']:.4g}", samples_s=f"{ep.samples / seconds:.0f}")
        ep.bar.close()
        losses = [s["loss"] for s in history.steps if s["epoch"] == ep.index]
        logs: dict[str, Any] = {
            "epoch": ep.index,
            "loss": sum(losses) / len(losses) if losses else float("nan"),
            "samples": ep.samples,
            "seconds": round(seconds, 4),
            "samples_per_s": ep.samples / seconds if seconds > 0 else float("nan"),
            "last_step": run.step,
        }
        if self.config.val_loader is not None:
            val = self.est.evaluate(self.model, self.config.val_loader, metrics=self.config.metrics,
                                    loss_fn=self.config.loss_fn, _nested=True)
            self.model.train()
            logs.update({f"val_{k}": v for k, v in val.items()})
            for c in self.callbacks:
                c.on_validation_end(self.est, dict(val))
        history.epochs.append(logs)
        for c in self.callbacks:
            c.on_epoch_end(self.est, logs)
        if ep.ran_to_end:
            run.epoch, run.batch = ep.index + 1, 0
        self.save()

    # ------------------------------------------------------------------ checkpoints and counts
    def save(self) -> None:
        """A checkpoint now (when fit has a ``checkpoint_dir``), every step's loss read first."""
        if not self.checkpointer.directory:
            return
        self._drain()
        self._count_compiles()
        self.checkpointer.save(self.model, self.opt, self.sched, self.run_state)

    def _count_compiles(self) -> None:
        self._record_execution()
        c, s = compile_counters()
        base_compiles, base_seconds = self._base
        self.history.programs_compiled = base_compiles + c - self._compiles0[0]
        self.history.compile_seconds = round(base_seconds + s - self._compiles0[1], 4)

    def _progress(self, total: int | None, desc: str) -> Any:
        from tqdm.auto import tqdm

        quiet = not self.est.verbose or not sys.stderr.isatty()
        return tqdm(total=total, desc=desc, disable=quiet, leave=True, unit="step")
