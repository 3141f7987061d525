"""The training step: forward, loss, backward, clipping and the optimizer, as one function, and
the runners that run it, one per shape bucket.

:class:`StepBuilder` builds the step function once per ``fit`` run (compiled as one graph in
compile mode; recorded as one trace in fused mode). :meth:`StepBuilder.runner` hands out one
:class:`StepRunner` per shape bucket (the shapes and dtypes of a step's batches), built on the
bucket's first step. A runner's ``run(group) -> loss`` is the only way the train loop runs a
step: in ``mode="auto"`` the runners are :class:`~torch_tpu.estimator.replay.ReplayRunner`, which
capture a bucket's step once and replay it (see :mod:`torch_tpu.estimator.replay`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torch_tpu.estimator.data import Batch
from torch_tpu.estimator.execution import Execution
from torch_tpu.estimator.losses import Loss, LossConfigError
from torch_tpu.estimator.replay import ReplayPlan, ReplayRunner

StepFn = Callable[[list[Batch]], torch.Tensor]


def bucket_key(group: list[Batch]) -> tuple:
    """The shapes and dtypes a step's program depends on: the same key, the same program."""
    # torch.Size is a tuple: it hashes and compares as one, so it goes in the key as it is
    return tuple((b.padded_to is not None, tuple([(t.shape, t.dtype) for t in b.tensors()])) for b in group)


class StepRunner:
    """Runs the optimizer step of one shape bucket: ``run(group)`` returns the step's mean loss
    (a detached float32 device tensor, not read on the host) with the weights updated.

    ``steps`` counts the steps run. :class:`~torch_tpu.estimator.replay.ReplayRunner` is the
    capturing one: the plain step for warm-up, one capture, then a replay per step of the bucket.
    """

    def __init__(self, key: tuple, step: StepFn, end_step: Callable[[], None]) -> None:
        self.key = key
        self._step = step
        self._end_step = end_step
        self.steps = 0

    def run(self, group: list[Batch]) -> torch.Tensor:
        loss = self._step(group)
        self._end_step()
        self.steps += 1
        return loss


class StepBuilder:
    """The step of one ``fit`` run, and its runners by shape bucket."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, loss: Loss, clip: float | None,
                 execution: Execution, mesh: Callable[[], Any] = lambda: None) -> None:
        self.model, self.opt, self.loss, self.clip, self.execution = model, opt, loss, clip, execution
        # mode="auto": the optimizer is made capturable now, before the first step makes its state
        self.replay: ReplayPlan | None = ReplayPlan(model, opt, mesh) if execution.replay else None
        step_one, step_many = self._step_one, self._step_many
        if execution.mode == "compile":
            # Dynamo specialises on a Python-float learning rate and would recompile whenever a
            # scheduler changes it; as a 0-dim tensor it is a graph input.
            for g in opt.param_groups:
                if not isinstance(g["lr"], torch.Tensor):
                    g["lr"] = torch.tensor(float(g["lr"]))
            step_one = torch.compile(step_one, backend="tpu")
            step_many = torch.compile(step_many, backend="tpu")
        self.step: StepFn = lambda micro: step_one(micro[0]) if len(micro) == 1 else step_many(micro)
        self._runners: dict[tuple, StepRunner] = {}

    def runner(self, group: list[Batch]) -> StepRunner | ReplayRunner:
        """The runner of ``group``'s shape bucket, built on the bucket's first step."""
        key = bucket_key(group)
        if self.replay is not None:  # a graph freezes the real row counts the loss divides by
            key = (*key, tuple(b.size for b in group))
        r = self._runners.get(key)
        if r is None:
            if self.replay is not None:
                r = self._runners[key] = ReplayRunner(key, self.step, self.execution.end_step, self.replay)
            else:
                r = self._runners[key] = StepRunner(key, self.step, self.execution.end_step)
        return r

    @property
    def runners(self) -> list[StepRunner | ReplayRunner]:
        return list(self._runners.values())

    # ------------------------------------------------------------------ the step function
    def _micro_loss(self, b: Batch, totals: tuple) -> torch.Tensor:
        """Forward and loss of one micro-batch: its share of the step's mean loss."""
        with self.execution.autocast():
            out = self.model(*b.args, **b.kwargs)
            return self.loss.contribution(self.model, out, b, totals)

    def _finish(self) -> None:
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def _step_many(self, micro: list[Batch]) -> torch.Tensor:
        totals = self.loss.group_totals(micro)
        report = None
        for b in micro:
            loss = self._micro_loss(b, totals)
            loss.backward()
            report = loss.detach() if report is None else report + loss.detach()
        self._finish()
        return report.float()

    def _step_one(self, b: Batch) -> torch.Tensor:
        # Straight-line code for the usual single micro-batch: Dynamo gives up on a whole
        # function when a graph break (backward) falls inside a loop, so this path has none.
        loss = self._micro_loss(b, self.loss.group_totals([b]))
        report = loss.detach().float()  # before the graph break, so in the forward's graph
        loss.backward()
        self._finish()
        return report

    # ------------------------------------------------------------------ failures
    def explain_failure(self, group: list[Batch]) -> None:
        """Raises the :class:`LossConfigError` behind a failed compiled step, if the loss is the
        cause: Dynamo reports a loss called with the wrong arguments as its own error, so the
        forward and loss run again, eagerly and without gradients, to name it."""
        if self.execution.mode != "compile":
            return
        try:
            with torch.no_grad():
                totals = self.loss.group_totals(group)
                for b in group:
                    self._micro_loss(b, totals)
        except LossConfigError:
            raise
        except Exception:  # noqa: BLE001 - not the loss: the caller reports the original error
            return

