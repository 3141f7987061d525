"""``mode="auto"``: the training step captured once per shape bucket and replayed.

A small model's step is bound by the host: Python dispatching a few hundred ops costs more than
the device's math. Replaying a captured step (:mod:`torch_tpu.device.graphs`, CUDA graphs'
semantics) costs one executable call. The estimator owns the loop, so it can capture safely:

* warm-up: the fit's first step runs in fused mode, so the optimizer state exists before any
  capture (state created inside a capture would be re-created by every replay);
* the optimizer is made capturable before that step: Adam and AdamW get ``capturable=True``
  (``fused`` ones stay fused), SGD ``fused=True``. Their learning rate enters the captured step as
  a 0-dim device tensor (a Python number would be frozen into the graph); it stays a Python float
  in ``param_groups`` for the scheduler and the history, and its value is sent to the device
  before a replay whenever it changed. Other ``torch.optim`` optimizers with a ``capturable``
  flag replay with their hyperparameters frozen;
* the optimizer's per-parameter step counts become views of one vector before the first capture
  (:meth:`ReplayPlan.pack_steps`): one array in and out of each replay instead of one per
  parameter, which is host time on a small model's step;
* each bucket (the shapes and dtypes of a step's batches, and its real row counts, which the loss
  uses as numbers) is captured at its first step, on private tensors that share the batch's
  arrays. A replay re-points those tensors at the next batch's arrays (no copy), sends a changed
  learning rate, and runs the graph; the step's loss is a fresh tensor on the loss output's array;
* the capture draws random numbers for the replay that follows it, not for itself: the device
  generator is wound back, so dropout sees the same numbers whichever step was captured (a resumed
  run captures at another step than the uninterrupted one);
* before each replay, what the graph froze is compared with its state at capture: every param
  group's numbers (beyond a tensor learning rate), which parameters require grad, and whether the
  model is in training mode. A change (a scheduler of betas, a callback freezing a layer) ends
  replay for the run. What cannot be checked cheaply is CUDA graphs' rule too: state the step
  keeps must be updated in place (``buf.add_(1)``, not ``self.buf = self.buf + 1``), and Python
  control flow inside the model takes the branch it took at capture.

The run falls back to fused mode, saying why once (a :class:`ReplayFallback` warning), when the
step cannot be captured: a host read in the user's loss or model (``.item()``, ``print``), a
shape that depends on values (``nonzero``, boolean masks), an optimizer that cannot be made
capturable, or one of the changes above. Everything else (checkpoints, resume, metrics, NaN
checks, gradient accumulation, progress) is the train loop's, whichever runner ran the step.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import torch
from torch import nn

from torch_tpu import distributed
from torch_tpu.core import rng as _rng
from torch_tpu.device import graphs
from torch_tpu.estimator.data import Batch, map_tensors
from torch_tpu.tensor import storage as _storage

WARMUP_STEPS = 1  # fused steps before the first capture: the optimizer state appears at step 1

# Optimizers whose capturable (or fused) step takes its learning rate as a device tensor.
_TENSOR_LR: dict[type, str] = {torch.optim.Adam: "capturable", torch.optim.AdamW: "capturable",
                               torch.optim.SGD: "fused"}


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class ReplayFallback(UserWarning):
    """``TPUEstimator(mode="auto")`` runs a fit's steps in fused mode: the message says why."""


def _refusal(e: BaseException) -> bool:
    """Whether graph capture refused the step (as CUDA would), rather than the step failing."""
    return isinstance(e, (RuntimeError, NotImplementedError)) and str(e).startswith("tpu graph capture:")


class ReplayPlan:
    """What one ``fit`` run's replay shares across buckets: the optimizer made capturable, its
    learning rates as device tensors, the warm-up, what the graphs froze, and the fallback."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, mesh: Callable[[], Any]) -> None:
        self.model, self.opt, self._mesh = model, opt, mesh
        self.fallback: str | None = None  # why the run's steps run in fused mode, once it does
        self.steps = 0  # steps run so far, by any runner
        self.replays = 0
        self.captures = 0
        self.tensor_lr = False
        self._lr: list[tuple[torch.Tensor, float]] = []  # per param group: its device lr, the value sent
        self._frozen: tuple | None = None
        self._params = [p for g in opt.param_groups for p in g["params"]]
        why = self._make_capturable()
        if why is not None:
            self.fall_back(why)

    # ------------------------------------------------------------------ the optimizer
    def _make_capturable(self) -> str | None:
        """Sets the optimizer's flags before its state exists (the warm-up step makes it); state
        loaded from a non-capturable run has its step counts moved to the device."""
        opt = self.opt
        name = type(opt).__name__
        if any(getattr(m, "sparse", False) is True for m in self.model.modules()
               if isinstance(m, (nn.Embedding, nn.EmbeddingBag))):
            return "the model has sparse gradients (an Embedding with sparse=True), which cannot be captured"
        flag = _TENSOR_LR.get(type(opt))
        if flag is None:
            if not type(opt).__module__.startswith("torch.optim") or not all(
                    "capturable" in g for g in opt.param_groups):
                return (f"the optimizer {name} cannot be made capturable (torch.optim's optimizers with a "
                        "'capturable' flag can: Adam, AdamW, SGD, RMSprop, NAdam, RAdam, Adamax, Adadelta, ASGD)")
            flag = "capturable"
        else:
            self.tensor_lr = True
        if any(g.get("differentiable") for g in opt.param_groups):
            self.tensor_lr = False
            return f"the optimizer {name} has differentiable=True, which cannot be captured"
        for g in opt.param_groups:
            if flag == "fused":
                g["fused"], g["foreach"] = True, False
            elif not g.get("fused"):
                g["capturable"] = True
        for p, state in opt.state.items():
            step = state.get("step") if isinstance(state, dict) else None
            if isinstance(step, torch.Tensor) and step.device.type != "tpu":
                state["step"] = step.to(device=p.device, dtype=torch.float32)
        return None

    def device_lrs(self) -> list[torch.Tensor]:
        """Each group's learning rate as a 0-dim float32 device tensor, made at the first capture
        (and spread over the mesh like the parameters: a program takes one device set)."""
        if not self._lr:
            mesh = self._mesh()
            for g in self.opt.param_groups:
                t = torch.tensor(float(g["lr"]), dtype=torch.float32).to(self.model_device)
                if mesh is not None:
                    distributed.replicate(t, mesh)
                self._lr.append((t, float(g["lr"])))
        return [t for t, _ in self._lr]

    @property
    def model_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("tpu", 0)

    def send_lrs(self) -> None:
        """The learning rates the host holds (a scheduler steps them as Python floats), sent to
        their device tensors when they changed: one small transfer, no op dispatched."""
        lrs = self._lr
        for i, g in enumerate(self.opt.param_groups):
            t, sent = lrs[i]
            lr = g["lr"]
            if lr != sent:
                value = float(lr)
                st = t.untyped_storage()
                old = st._jx
                st._jx = jax.device_put(np.asarray(value, np.float32), getattr(old, "sharding", None))
                lrs[i] = (t, value)

    def pack_steps(self) -> None:
        """Makes the optimizer's per-parameter step counts views of one vector, before the first
        capture.

        Capturable Adam and its kin keep ``state["step"]`` as a 0-dim device tensor per parameter.
        Every array an executable call takes or returns costs the host microseconds (jaxlib's
        argument checks, the buffer made, the old one freed), and a small model's replayed step is
        bound by exactly that: gpt-tiny's step took 121 arrays and returned 117, 29 of each its step
        counts. As views of one storage they are one array in and one out. Each ``state["step"]``
        is still its own 0-dim tensor with its own value, updated in place by the optimizer as
        before; only their storage is shared (a checkpoint saves them as views of it, and loads as
        separate tensors, packed again at the next capture). Left as they are with a mesh (their
        placement is the mesh's) or when they differ in device, dtype or shape."""
        if self._mesh() is not None:
            return
        found = [s for s in self.opt.state.values() if isinstance(s, dict) and type(s.get("step")) is torch.Tensor]
        if len(found) < 2:
            return
        steps = [s["step"] for s in found]
        first = steps[0]
        if first.device.type != "tpu" or any(
                t.device != first.device or t.dtype != first.dtype or t.dim() != 0 or t.requires_grad
                or t.untyped_storage().nbytes() != t.element_size() for t in steps):
            return
        packed = torch.stack(steps)
        for i, s in enumerate(found):
            s["step"] = packed[i]

    # ------------------------------------------------------------------ what the graphs froze
    @property
    def _skip(self) -> tuple[str, ...]:
        """Param group entries that are not frozen: the parameters, and a learning rate sent per step."""
        return ("params", "lr") if self.tensor_lr else ("params",)

    def _state(self) -> tuple:
        skip = self._skip
        groups = tuple(tuple(v for k, v in g.items() if k not in skip) for g in self.opt.param_groups)
        return (len(self.opt.param_groups), groups, tuple(p.requires_grad for p in self._params),
                self.model.training)

    def freeze(self) -> None:
        """Records, at the first capture, what every graph of the run takes as fixed."""
        if self._frozen is None:
            self._frozen = self._state()
            skip = self._skip
            self._frozen_items = []
            for g in self.opt.param_groups:
                keys = [k for k in g if k not in skip]
                # itemgetter of two or more keys gives a tuple: compared in C, identity first
                get = operator.itemgetter(*keys, *keys) if keys else (lambda _g: ())
                self._frozen_items.append((g, len(g), get, get(g)))
            self._frozen_grads = list(self._frozen[2])

    def _same(self) -> bool:
        """The quick form of ``_state() == frozen``, run before every replay: its loops run in C."""
        groups = self.opt.param_groups
        if len(groups) != len(self._frozen_items) or self.model.training is not self._frozen[3]:
            return False
        for (g, n, get, values), now in zip(self._frozen_items, groups):
            if g is not now or len(now) != n or get(now) != values:
                return False
        return list(map(_REQUIRES_GRAD, self._params)) == self._frozen_grads

    def unchanged(self) -> bool:
        """True while what the graphs froze is as at capture; else the run falls back, saying what."""
        if self._same():
            return True
        now = self._state()
        if now == self._frozen:
            return True
        before = self._frozen
        if now[0] != before[0]:
            what = "a param group was added to the optimizer"
        elif now[1] != before[1]:
            i = next(i for i, (a, b) in enumerate(zip(now[1], before[1])) if a != b)
            keys = [k for k in self.opt.param_groups[i] if k not in self._skip]
            changed = [k for k, a, b in zip(keys, now[1][i], before[1][i]) if a != b]
            what = (f"param group {i}'s {', '.join(repr(k) for k in changed)} changed between steps (a Python "
                    "number is frozen into the captured step)")
        elif now[2] != before[2]:
            what = "which parameters require grad changed between steps"
        else:
            what = "model.training changed between steps"
        self.fall_back(what)
        return False

    # ------------------------------------------------------------------ falling back
    def fall_back(self, reason: str) -> None:
        if self.fallback is not None:
            return
        self.fallback = reason
        warnings.warn(f"TPUEstimator(mode='auto'): the training step is not replayed; it runs in fused mode from "
                      f"here on, because {reason}", ReplayFallback, stacklevel=2)

    @property
    def warm(self) -> bool:
        return self.steps >= WARMUP_STEPS


class ReplayRunner:
    """The runner of one shape bucket in ``mode="auto"``: the plain step until the run is warm,
    then one capture, then a replay per step (see the module docstring)."""

    def __init__(self, key: tuple, step: Callable[[list[Batch]], torch.Tensor], end_step: Callable[[], None],
                 plan: ReplayPlan) -> None:
        self.key = key
        self._step = step
        self._end_step = end_step
        self.plan = plan
        self.steps = 0
        self.graph: Any = None
        self._inputs: list[Any] = []  # the storages of the captured batch's private tensors
        self._loss: Any = None  # the storage of the captured step's loss
        self._loss_meta: tuple = ()

    def run(self, group: list[Batch]) -> torch.Tensor:
        plan = self.plan
        self.steps += 1
        if plan.fallback is None and plan.warm:
            if self.graph is None:
                loss = self._capture(group)
                if loss is not None:
                    return loss
            elif plan.unchanged():
                return self._replay(group)
        return self._plain(group)

    def _plain(self, group: list[Batch]) -> torch.Tensor:
        loss = self._step(group)
        self._end_step()
        self.plan.steps += 1
        return loss

    # ------------------------------------------------------------------ capture
    def _capture(self, group: list[Batch]) -> torch.Tensor | None:
        """Captures the step on private tensors holding ``group``'s arrays and replays it: the
        step's loss. None when capture was refused (the run falls back; the step is still to run)."""
        plan = self.plan
        static = [_private(b) for b in group]
        if plan.captures == 0:
            plan.pack_steps()
        groups = plan.opt.param_groups
        floats = [g["lr"] for g in groups]
        if plan.tensor_lr:
            lrs = plan.device_lrs()
            plan.send_lrs()
            for g, t in zip(groups, lrs):
                g["lr"] = t
        g = graphs.TPUGraph()
        with _rng._lock:
            counter = _rng._counter
        try:
            with graphs.graph(g):
                loss = self._step(static)
        except Exception as e:  # noqa: BLE001 - a refusal falls back; anything else, the plain step says
            self._after_capture(floats, counter)
            plan.opt.zero_grad(set_to_none=True)  # gradients the region made hold nothing
            if _refusal(e):
                plan.fall_back(str(e).removeprefix("tpu graph capture: "))
                return None
            loss = self._plain(group)  # raises the step's own error when it is the model's or the loss's
            plan.fall_back(f"capturing the step failed: {type(e).__name__}: {e}")
            return loss
        self._after_capture(floats, counter)
        plan.freeze()
        plan.captures += 1
        self.graph = g
        self._inputs = [t.untyped_storage() for t in _batch_tensors(static)]
        self._loss_tensor = loss
        self._loss = loss.untyped_storage()
        self._loss_meta = (tuple(loss.shape), loss.dtype)
        self._new_tensor = _storage.new_tensor
        loss = self._replay(group)
        # The capture step is warm-up, and so is what the device still owes from the steps before
        # it: the first plain step's program may still be compiling or running. Waiting for this
        # step's loss here keeps that wait in the warm-up; otherwise the first replays wait behind
        # it, a one-time delay of a tenth of a second that shows in the steady steps' rate.
        jax.block_until_ready(self._loss._jx)
        return loss

    def _after_capture(self, floats: list, counter: int) -> None:
        for g, lr in zip(self.plan.opt.param_groups, floats):
            g["lr"] = lr
        with _rng._lock:
            _rng._counter = counter  # the capture's draws are the next replay's

    # ------------------------------------------------------------------ replay
    def _replay(self, group: list[Batch]) -> torch.Tensor:
        plan = self.plan
        for st, t in zip(self._inputs, _batch_tensors(group)):
            src = t.untyped_storage()
            if src is st:
                continue
            if t.storage_offset() == 0 and src._shape == st._shape and src._dtype == st._dtype and t.is_contiguous():
                st._jx = src._jx
            else:  # a view: its values copied into the whole private tensor
                st._jx = _private_tensor(t).untyped_storage()._jx
        if plan.tensor_lr:
            plan.send_lrs()
        self.graph.replay()
        plan.steps += 1
        plan.replays += 1
        shape, dtype = self._loss_meta
        return self._new_tensor(shape, dtype, self._loss._jx)


def _batch_tensors(group: list[Batch]) -> list[torch.Tensor]:
    """Every tensor of a step's batches, in a fixed order: the graph's inputs."""
    if len(group) == 1:
        return group[0].tensors()
    return [t for b in group for t in b.tensors()]


def _private_tensor(t: torch.Tensor) -> torch.Tensor:
    """A tensor of our own holding ``t``'s values: the same array when ``t`` covers its storage
    (arrays are immutable, so sharing one is safe), else a contiguous copy."""
    st = t.untyped_storage()
    if t.storage_offset() == 0 and t.is_contiguous() and st._shape == tuple(t.shape) and st._dtype == t.dtype:
        return _storage.new_tensor(tuple(t.shape), t.dtype, _storage.read_array(t))
    return t.clone().contiguous()


def _private(b: Batch) -> Batch:
    """``b`` with private tensors: a replay re-points them at the next batch's arrays, so they must
    not be the loader's own tensors (a loader that yields tpu tensors hands out the same ones)."""
    from dataclasses import replace

    args, kwargs, target, mask = map_tensors((b.args, b.kwargs, b.target, b.mask), _private_tensor)
    return replace(b, args=args, kwargs=kwargs, target=target, mask=mask)
