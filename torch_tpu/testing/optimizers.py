"""Conformance against PyTorch's OptimizerInfo database (``optim_db``), CPU as the reference.

Every optimizer in the database comes with its configurations (learning rates, weight decay,
amsgrad, maximize, tensor hyperparameters, ...). Each configuration trains the same small model
for a few steps on CPU (the plain for-loop implementation) and on tpu, and the parameters must
match after every step. The verdicts, per optimizer:

* ``step``: the for-loop implementation on tpu (``foreach=False``) matches CPU;
* ``foreach``, ``fused``: the same with ``foreach=True`` / ``fused=True`` on tpu, where the optimizer
  has that implementation (torch allows both on a PrivateUse1 device); None (not applicable, left
  out of the rates) where it has none;
* ``capturable``: the configurations with ``capturable=True``, which torch allows on tpu as on CUDA
  (the database's CUDA configurations: tensor learning rates and betas among them); None where the
  optimizer has none;
* ``state_dict``: the optimizer's state matches CPU's, and a fresh tpu optimizer that loads it steps
  on as CPU's does;
* ``scheduler``: the database's learning-rate schedulers step as on CPU;
* ``errors``: the database's error inputs, with tpu parameters, raise (or warn) the type it names.

An optimizer that takes sparse gradients only (SparseAdam) trains an embedding table whose gradient
is a sparse COO tensor (``F.embedding(..., sparse=True)``), on tpu as on CPU.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

RTOL, ATOL = 1e-4, 1e-5
# L-BFGS runs up to 20 inner iterations (and line-search evaluations) per step, on curvature pairs
# that subtract nearly equal gradients: on this model CPU's own float32 run lands up to 2e-4 from its
# float64 run (measured over the database's five configurations and four convex losses), and tpu's
# float32 run as far, in either direction. Its steps are compared at that scale.
CLOSURE_RTOL, CLOSURE_ATOL = 1e-3, 2e-4
STEPS = 3
CHECKS = ("step", "foreach", "fused", "capturable", "state_dict", "scheduler", "errors")


def optim_infos() -> list:
    from torch.testing._internal.common_optimizers import optim_db

    return list(optim_db)


def optim_key(info: Any) -> str:
    return info.optim_cls.__name__


@dataclasses.dataclass
class OptimVerdict:
    name: str
    step: bool = False
    foreach: bool | None = False
    fused: bool | None = False
    capturable: bool | None = False
    state_dict: bool = False
    scheduler: bool = False
    errors: bool = False
    skipped: str | None = None
    error: str = ""

    def gated(self) -> dict[str, bool | None]:
        """Each check's verdict; None where the optimizer has no such implementation."""
        return {k: getattr(self, k) for k in CHECKS}


# ------------------------------------------------------------------------------ the model
def _initial(info: Any) -> dict[str, torch.Tensor]:
    """The model's starting weights, on CPU: two matrices, and a bias except for Muon (which takes
    2-d parameters only); an embedding table for an optimizer of sparse gradients."""
    g = torch.Generator().manual_seed(0)
    if info.only_supports_sparse_grads:
        return {"table": torch.randn(6, 3, generator=g)}
    w = {"w1": torch.randn(4, 3, generator=g), "w2": torch.randn(2, 4, generator=g)}
    if optim_key(info) != "Muon":
        w["b"] = torch.randn(2, generator=g)
    return w


def _batch(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 + step)
    return tuple(torch.randn(*shape, generator=g) for shape in ((5, 3), (5, 4), (4, 6), (2, 6)))


def _loss(params: dict[str, torch.Tensor], step: int) -> torch.Tensor:
    """A strictly convex quadratic in each parameter: the optimizers' own arithmetic decides the
    steps, not the rounding of a chaotic landscape. Strictly: with a flat direction (``w2 @ u`` for
    a ``u`` of rank 3 leaves one direction of each row of ``w2`` free), L-BFGS, which reaches the
    minimum within its 20 inner iterations, drifts along it by float32's last-bit differences."""
    if "table" in params:
        # rows 0-5 drawn with repeats: the sparse gradient has duplicate indices to coalesce
        idx = torch.randint(0, 6, (5,), generator=torch.Generator().manual_seed(200 + step))
        x, t, _, _ = _batch(step)
        rows = torch.nn.functional.embedding(idx.to(params["table"].device), params["table"], sparse=True)
        return ((rows * x.to(rows.device)).sum(1) - t[:, 0].to(rows.device)).pow(2).mean()
    x, t, u, v = (a.to(params["w1"].device) for a in _batch(step))
    loss = ((x @ params["w1"].T - t) ** 2).mean() + ((params["w2"] @ u - v) ** 2).mean()
    if "b" in params:
        loss = loss + ((params["b"] - v[:, 0]) ** 2).mean()
    return loss


def _params(info: Any, device: str) -> dict[str, torch.nn.Parameter]:
    return {k: torch.nn.Parameter(v.to(device)) for k, v in _initial(info).items()}


# ------------------------------------------------------------------------------ a run
@dataclasses.dataclass
class _Run:
    params: dict[str, torch.nn.Parameter]
    optim: torch.optim.Optimizer
    history: list[dict[str, torch.Tensor]]
    lrs: list[float]


def _train(info: Any, kwargs: dict, device: str, steps: int = STEPS, scheduler: Callable | None = None,
           params: dict | None = None, optim: torch.optim.Optimizer | None = None, first_step: int = 0) -> _Run:
    params = params if params is not None else _params(info, device)
    # a configuration's tensor hyperparameters (a tensor lr, betas) stay on the CPU, as torch's
    # tests pass them for every device; copied, so that no run shares them with another
    optim = optim if optim is not None else info.optim_cls(list(params.values()), **copy.deepcopy(kwargs))
    sched = scheduler(optim) if scheduler is not None else None
    history, lrs = [], []
    for i in range(first_step, first_step + steps):
        # L-BFGS (a closure) minimises one batch: its curvature pairs, carried from step to step,
        # turn a change of batch into steps that part float32 from float64 by tens on CPU itself
        batch = 0 if info.step_requires_closure else i
        # a configuration that maximizes climbs the negated loss, a concave one: climbing the convex
        # loss runs off to infinity, where L-BFGS's line search (torch 2.15's maximize with
        # strong_wolfe) compares values of float32 rounding, not of the optimizer's arithmetic
        sign = -1.0 if optim.param_groups[0].get("maximize") else 1.0

        def closure(batch: int = batch, sign: float = sign) -> torch.Tensor:
            optim.zero_grad()
            loss = _loss(params, batch) * sign
            loss.backward()
            return loss

        if info.step_requires_closure:
            loss = optim.step(closure)
        else:
            loss = closure()
            optim.step()
        if sched is not None:
            if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
                sched.step(float(loss))
            else:
                sched.step()
            lrs.append(float(optim.param_groups[0]["lr"]))
        history.append({k: p.detach().cpu().clone() for k, p in params.items()})
    return _Run(params, optim, history, lrs)


def _compare_histories(cpu: _Run, tpu: _Run, what: str) -> None:
    closure = isinstance(cpu.optim, torch.optim.LBFGS)
    rtol, atol = (CLOSURE_RTOL, CLOSURE_ATOL) if closure else (RTOL, ATOL)
    for step, (a, b) in enumerate(zip(cpu.history, tpu.history)):
        for name in a:
            try:
                torch.testing.assert_close(b[name], a[name], rtol=rtol, atol=atol)
            except AssertionError as e:
                raise AssertionError(f"{what}: {name} after step {step + 1}: {e}") from None


def _compare_states(cpu: torch.optim.Optimizer, tpu: torch.optim.Optimizer) -> None:
    a, b = cpu.state_dict()["state"], tpu.state_dict()["state"]
    if a.keys() != b.keys():
        raise AssertionError(f"state of parameters {sorted(a)} on CPU, {sorted(b)} on tpu")
    closure = isinstance(cpu, torch.optim.LBFGS)
    rtol, atol = (CLOSURE_RTOL, CLOSURE_ATOL) if closure else (RTOL, ATOL)
    for k in a:
        if a[k].keys() != b[k].keys():
            raise AssertionError(f"parameter {k}'s state holds {sorted(a[k])} on CPU, {sorted(b[k])} on tpu")
        for name, x in a[k].items():
            if closure and name == "al":
                # L-BFGS's two-loop scratch: each entry is written (s . q * ro) before it is read,
                # within an iteration, so no later step depends on the stored values; on a
                # converged run they are ratios of near-zero products (ro ~ 4e7), which two
                # machines' float32 round apart by percents. Its length is compared.
                if not isinstance(b[k][name], list | tuple) or len(b[k][name]) != len(x):
                    raise AssertionError(f"state al of parameter {k}: {len(x)} entries on CPU, "
                                         f"{b[k][name]!r:.80} on tpu")
                continue
            _compare_value(x, b[k][name], f"state {name} of parameter {k}", rtol, atol)


def _compare_value(x: Any, y: Any, what: str, rtol: float, atol: float) -> None:
    """One state entry: tensors and floats within the tolerance, lists of them (L-BFGS's curvature
    pairs) entry by entry, anything else equal."""
    if isinstance(x, list | tuple) and isinstance(y, list | tuple) and len(x) == len(y):
        for i, (xi, yi) in enumerate(zip(x, y)):
            _compare_value(xi, yi, f"{what}[{i}]", rtol, atol)
    elif isinstance(x, torch.Tensor):
        y = y.detach().cpu() if isinstance(y, torch.Tensor) else torch.tensor(y)
        try:
            torch.testing.assert_close(y.to(x.dtype), x, rtol=rtol, atol=atol)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
    elif isinstance(x, float) and isinstance(y, float):
        # a loss read back as a Python float (L-BFGS's prev_loss)
        if abs(x - y) > atol + rtol * abs(x):
            raise AssertionError(f"{what}: CPU {x!r}, tpu {y!r}")
    elif x != y:
        raise AssertionError(f"{what}: CPU {x!r}, tpu {y!r}")


def _reference_kwargs(info: Any, kwargs: dict) -> dict:
    """CPU's run of a configuration: the for-loop implementation, not capturable."""
    ref = {k: v for k, v in kwargs.items() if k not in ("capturable", "foreach", "fused", "differentiable")}
    if "foreach" in info.supported_impls:
        ref["foreach"] = False
    return ref


def _configs(info: Any) -> list:
    """The database's configurations for a device whose optimizers may be capturable (CUDA's list;
    torch allows capturable on tpu too), without the global flags, which the checks set."""
    out = []
    for oi in info.optim_inputs_func("cuda"):
        kw = {k: v for k, v in oi.kwargs.items() if k not in ("foreach", "fused", "differentiable")}
        out.append((oi.desc or "default", kw))
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _same_outcome(info: Any, ref_kwargs: dict, tpu_kwargs: dict, what: str) -> tuple[_Run, _Run] | None:
    """Trains on CPU and on tpu; None when both refuse the configuration (the same error type)."""
    try:
        cpu = _train(info, ref_kwargs, "cpu")
    except Exception as e:
        try:
            _train(info, tpu_kwargs, "tpu")
        except type(e):
            return None
        raise AssertionError(f"{what}: CPU raises {_first_line(e)}; tpu does not raise it") from None
    tpu = _train(info, tpu_kwargs, "tpu")
    _compare_histories(cpu, tpu, what)
    return cpu, tpu


# ------------------------------------------------------------------------------ one optimizer
def check(info: Any) -> OptimVerdict:
    v = OptimVerdict(optim_key(info))
    configs = _configs(info)
    plain = [(d, kw) for d, kw in configs if not kw.get("capturable")]
    capturable = [(d, kw) for d, kw in configs if kw.get("capturable")]
    has = set(info.supported_impls)

    def each(name: str, cases: list, flags: dict) -> bool:
        for desc, kw in cases:
            try:
                tpu_kw = {**kw, **flags}
                if "foreach" in has and "foreach" not in tpu_kw:
                    tpu_kw["foreach"] = False
                _same_outcome(info, _reference_kwargs(info, kw), tpu_kw, f"{name} [{desc}]")
            except Exception as e:
                v.error = v.error or f"{name} [{desc}]: {_first_line(e)}"
                return False
        return True

    v.step = each("step", plain, {})
    v.foreach = each("foreach", plain, {"foreach": True}) if "foreach" in has else None
    v.fused = each("fused", plain, {"fused": True}) if "fused" in has else None
    v.capturable = each("capturable", capturable, {}) if capturable else None
    v.state_dict = _guard(v, "state_dict", lambda: _check_state_dict(info, plain[0][1]))
    v.scheduler = _guard(v, "scheduler", lambda: _check_schedulers(info, plain[0][1]))
    v.errors = _guard(v, "errors", lambda: _check_errors(info))
    return v


def _guard(v: OptimVerdict, name: str, fn: Callable[[], None]) -> bool:
    try:
        fn()
    except Exception as e:
        v.error = v.error or f"{name}: {_first_line(e)}"
        return False
    return True


def _check_state_dict(info: Any, kwargs: dict) -> None:
    ref = _reference_kwargs(info, kwargs)
    cpu = _train(info, ref, "cpu")
    tpu = _train(info, ref, "tpu")
    _compare_states(cpu.optim, tpu.optim)
    # a fresh tpu optimizer over fresh parameters loads the state and steps on as CPU's does
    params = {k: torch.nn.Parameter(p.detach().clone()) for k, p in tpu.params.items()}
    fresh = info.optim_cls(list(params.values()), **ref)
    fresh.load_state_dict(tpu.optim.state_dict())
    more_cpu = _train(info, ref, "cpu", params=cpu.params, optim=cpu.optim, first_step=STEPS)
    more_tpu = _train(info, ref, "tpu", params=params, optim=fresh, first_step=STEPS)
    _compare_histories(more_cpu, more_tpu, "after load_state_dict")


def _check_schedulers(info: Any, kwargs: dict) -> None:
    ref = _reference_kwargs(info, kwargs)
    for i, group in enumerate(info.scheduler_inputs):
        for j, make in enumerate(group):
            cpu = _train(info, ref, "cpu", steps=STEPS, scheduler=make)
            tpu = _train(info, ref, "tpu", steps=STEPS, scheduler=make)
            _compare_histories(cpu, tpu, f"with scheduler {i}.{j}")
            if cpu.lrs != tpu.lrs:
                raise AssertionError(f"scheduler {i}.{j}: learning rates: CPU {cpu.lrs}, tpu {tpu.lrs}")


def _check_errors(info: Any) -> None:
    from torch.testing._internal.common_optimizers import OptimizerErrorEnum

    if info.optim_error_inputs_func is None:
        return
    for ei in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        oi = ei.optimizer_error_input
        params = _to_tpu_params(oi.params)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                optim = info.optim_cls(params, **oi.kwargs)
                if ei.error_on == OptimizerErrorEnum.STEP_ERROR:
                    optim.step()
            except Exception as e:
                if not isinstance(e, ei.error_type) or not re.search(ei.error_regex, str(e)):
                    raise AssertionError(f"[{oi.desc}]: wanted {ei.error_type.__name__} matching "
                                         f"{ei.error_regex!r}, got {_first_line(e)}") from None
                continue
        if issubclass(ei.error_type, Warning):
            if any(issubclass(w.category, ei.error_type) and re.search(ei.error_regex, str(w.message))
                   for w in caught):
                continue
        raise AssertionError(f"[{oi.desc}]: wanted {ei.error_type.__name__} matching {ei.error_regex!r}; "
                             "nothing was raised")


def _to_tpu_params(params: Any) -> Any:
    """The error input's parameters (and their gradients) on tpu, identity kept: a parameter that
    appears twice stays one tpu parameter."""
    moved: dict[int, torch.Tensor] = {}

    def move(t: Any) -> Any:
        if isinstance(t, dict):
            return {k: move(v) for k, v in t.items()}
        if isinstance(t, list | tuple):
            return type(t)(move(x) for x in t)
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return t
        if id(t) not in moved:
            y = t.detach().to("tpu")
            y = torch.nn.Parameter(y, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else y
            if t.grad is not None:
                y.grad = t.grad.to("tpu")
            moved[id(t)] = y
        return moved[id(t)]

    return move(params)


def run(infos: list, verbose: bool = False) -> list[OptimVerdict]:
    """:func:`check` for each OptimizerInfo, warnings silenced; a failure of the harness itself
    becomes the optimizer's verdict, never the end of the run."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in infos:
            try:
                v = check(info)
            except Exception:
                v = OptimVerdict(optim_key(info), error="harness: " + traceback.format_exc(limit=1).splitlines()[-1])
            if verbose:
                flags = " ".join(f"{k}={'-' if getattr(v, k) is None else int(getattr(v, k))}" for k in CHECKS)
                print(f"{v.name:12s} {'skip ' + v.skipped if v.skipped else flags} {v.error[:200]}", flush=True)
            out.append(v)
    return out


def summary(verdicts: list[OptimVerdict]) -> dict[str, Any]:
    """Each check's pass rate over the optimizers it applies to."""
    tested = [v for v in verdicts if not v.skipped]
    rates = {}
    for k in CHECKS:
        known = [getattr(v, k) for v in tested if getattr(v, k) is not None]
        rates[k] = sum(known) / max(len(known), 1)
    return {"entries": len(verdicts), "tested": len(tested), "skipped": len(verdicts) - len(tested), **rates}


__all__ = ["CHECKS", "OptimVerdict", "check", "optim_infos", "optim_key", "run", "summary"]
