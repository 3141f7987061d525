"""Conformance against PyTorch's ModuleInfo database (``module_db``), CPU as the reference.

Every ``nn`` module in the database comes with constructor and forward inputs. Each input builds
the module on CPU and a copy of it on tpu (the same weights), in training mode and, where the
database says training and eval differ, in eval mode too. The verdicts, per module:

* ``forward``: the outputs and the buffers after the forward (running statistics) match CPU's; an
  input CPU rejects must be rejected on tpu too;
* ``grad``: the gradients of the inputs and of every parameter match;
* ``noncontiguous``: the same outputs and gradients with every floating input non-contiguous;
* ``memory_format``: a channels-last module and channels-last inputs (4-d and 5-d ones) give CPU's
  values, in the memory format CPU's output has;
* ``factory_kwargs``: built with ``device="tpu", dtype=torch.float32``, every parameter and buffer is
  on tpu with the dtype CPU gives it;
* ``no_fallback``: no op of the forward ran on the CPU fallback;
* ``bf16`` (reported, not gated): the forward in bfloat16 matches CPU's bfloat16 forward.

Lazy modules run their first forward on tpu (which materialises their parameters there), then load
CPU's materialised weights and are compared. An input whose CPU output changes with the random
seed (dropout in training mode) is left out of that mode and named in ``skipped_inputs``.
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_tpu
from torch_tpu.testing.expected import fallbacks

RTOL, ATOL = 1e-3, 1e-4
BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-2
MAX_INPUTS = 4
CHECKS = ("forward", "grad", "noncontiguous", "memory_format", "factory_kwargs", "no_fallback")


def module_infos() -> list:
    """The ModuleInfos whose dtypes hold float32 (all of them in torch 2.11-2.15)."""
    from torch.testing._internal.common_modules import module_db

    return [m for m in module_db if torch.float32 in m.dtypes]


def module_key(info: Any) -> str:
    return info.name


@dataclasses.dataclass
class ModuleVerdict:
    name: str
    forward: bool = False
    grad: bool = False
    noncontiguous: bool = False
    memory_format: bool = False
    factory_kwargs: bool = False
    no_fallback: bool = False
    bf16: bool | None = None  # None: CPU runs no bfloat16 input of this module
    skipped: str | None = None
    skipped_inputs: tuple[str, ...] = ()
    error: str = ""
    fallbacks: tuple[str, ...] = ()

    def gated(self) -> dict[str, bool]:
        return {k: getattr(self, k) for k in CHECKS}


# ------------------------------------------------------------------------------ moving and comparing
def _leaf(t: torch.Tensor, device: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    y = t.detach().to(device=device, dtype=dtype if (dtype and t.is_floating_point()) else t.dtype)
    if device == "cpu" and y.data_ptr() == t.data_ptr():
        y = y.clone()
    return y.requires_grad_(t.requires_grad and y.is_floating_point())


def _move(tree: Any, device: str, dtype: torch.dtype | None = None) -> Any:
    return tree_map(lambda x: _leaf(x, device, dtype) if isinstance(x, torch.Tensor) else x, tree)


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a tensor whose last dim has stride 2 (every other element of a wider one)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() == 0 or t.numel() <= 1:
        return t
    y = t.detach().repeat_interleave(2, dim=-1)[..., 1::2]
    return y.requires_grad_(t.requires_grad)


def _channels_last(t: Any) -> Any:
    if isinstance(t, torch.Tensor) and t.dim() in (4, 5):
        fmt = torch.channels_last if t.dim() == 4 else torch.channels_last_3d
        return t.detach().contiguous(memory_format=fmt).requires_grad_(t.requires_grad)
    return t


def _channels_last_module(m: torch.nn.Module) -> torch.nn.Module:
    """The module in the channels-last format of its own weights' rank (a Conv3d's 5-d weight takes
    ``channels_last_3d`` whatever the rank of its input: an unbatched 4-d one)."""
    dims = {t.dim() for t in (*m.parameters(), *m.buffers())}
    fmt = torch.channels_last_3d if 5 in dims else torch.channels_last if 4 in dims else None
    return m.to(memory_format=fmt) if fmt is not None else m


def _memory_format(t: torch.Tensor) -> str:
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return "channels_last"
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "channels_last_3d"
    return "contiguous" if t.is_contiguous() else "strided"


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what: str) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def _compare(cpu: Any, tpu: Any, rtol: float = RTOL, atol: float = ATOL, what: str = "output") -> None:
    a, _ = tree_flatten(cpu)
    b, _ = tree_flatten(tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, tpu))
    if len(a) != len(b):
        raise AssertionError(f"{what}: {len(a)} values on CPU, {len(b)} on tpu")
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor):
                raise AssertionError(f"{what}: CPU gave a tensor, tpu gave {type(y).__name__}")
            _close(y, x.detach(), rtol, atol, what)
        elif x != y:
            raise AssertionError(f"{what}: CPU gave {x!r}, tpu gave {y!r}")


def _float_outputs(out: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(out)
    return [o for o in flat if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]


def _grads(module: torch.nn.Module, out: Any, inputs: Any) -> dict[str, torch.Tensor | None]:
    """Gradients of a fixed, uneven weighting of the float outputs, by input position and parameter
    name (the weights are built on CPU, so the harness itself runs few tpu ops)."""
    outs = _float_outputs(out)
    leaves = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not outs or not (leaves or params):
        return {}
    total = sum((o * (torch.arange(o.numel()) % 7 + 1).reshape(o.shape).to(o.device, o.dtype)).sum() for o in outs)
    got = torch.autograd.grad(total, leaves + [p for _, p in params], allow_unused=True)
    names = [f"input {i}" for i in range(len(leaves))] + [n for n, _ in params]
    return {n: None if g is None else g.detach().cpu() for n, g in zip(names, got)}


def _compare_grads(cpu: dict, tpu: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    if cpu.keys() != tpu.keys():
        raise AssertionError(f"gradients of {sorted(cpu)} on CPU, of {sorted(tpu)} on tpu")
    for name, a in cpu.items():
        b = tpu[name]
        if (a is None) != (b is None):
            raise AssertionError(f"the gradient of {name} is missing on {'tpu' if b is None else 'CPU'}")
        if a is not None:
            _close(b, a, rtol, atol, f"grad of {name}")


# ------------------------------------------------------------------------------ one module input
def _build(info: Any, mi: Any, **factory: Any) -> torch.nn.Module:
    c = mi.constructor_input
    return info.module_cls(*c.args, **c.kwargs, **factory)


def _call(module: torch.nn.Module, fwd: Any, device: str, transform: Callable[[Any], Any] | None = None,
          dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    args = _move(fwd.args, device, dtype)
    kwargs = _move(fwd.kwargs, device, dtype)
    if transform is not None:
        args, kwargs = tree_map(transform, args), tree_map(transform, kwargs)
    return (args, kwargs), module(*args, **kwargs)


def _pair(info: Any, mi: Any, training: bool,
          dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The module on CPU and a copy on tpu, the same weights (a lazy module materialises on tpu
    through its own first forward, then takes CPU's weights)."""
    torch.manual_seed(0)
    cpu = _build(info, mi).train(training)
    tpu = copy.deepcopy(cpu).to("tpu")
    if dtype is not None:
        cpu, tpu = cpu.to(dtype), tpu.to(dtype)
    if info.is_lazy:
        with torch.no_grad():
            _call(cpu, mi.forward_input, "cpu", dtype=dtype)
            _call(tpu, mi.forward_input, "tpu", dtype=dtype)  # materialises the parameters on tpu
        tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu


def _is_random(info: Any, mi: Any, training: bool) -> bool:
    """Whether CPU's output depends on the random seed (dropout in training mode, for instance)."""
    outs = []
    for seed in (0, 1):
        torch.manual_seed(0)
        m = _build(info, mi).train(training)
        if info.is_lazy:
            with torch.no_grad():
                _call(m, mi.forward_input, "cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(_call(m, mi.forward_input, "cpu")[1])
    try:
        _compare(outs[0], outs[1], rtol=0, atol=0)
    except AssertionError:
        return True
    return False


def _check_input(info: Any, mi: Any, training: bool, transform: Callable[[Any], Any] | None = None,
                 channels_last: bool = False) -> None:
    """One module input, forward and gradients, on CPU and on tpu; raises on a difference.
    ``transform`` reshapes the tpu inputs (non-contiguous, channels-last); ``channels_last``
    converts both modules' weights too, and CPU's inputs, and compares the outputs' formats."""
    cpu, tpu = _pair(info, mi, training)
    cpu_transform = transform if channels_last else None
    if channels_last:
        cpu, tpu = _channels_last_module(cpu), _channels_last_module(tpu)
    try:
        torch.manual_seed(0)
        cin, cout = _call(cpu, mi.forward_input, "cpu", cpu_transform)
    except Exception:
        torch.manual_seed(0)
        try:
            _call(tpu, mi.forward_input, "tpu", transform)
        except Exception:
            return  # rejected on both
        raise AssertionError("CPU rejects this input; tpu accepted it") from None
    torch.manual_seed(0)
    tin, tout = _call(tpu, mi.forward_input, "tpu", transform)
    _compare(cout, tout)
    _compare(dict(cpu.named_buffers()), dict(tpu.named_buffers()), what="buffers after the forward")
    if channels_last:
        for a, b in zip(tree_flatten(cout)[0], tree_flatten(tout)[0]):
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _memory_format(a) != _memory_format(b):
                raise AssertionError(f"output memory format: CPU {_memory_format(a)}, tpu {_memory_format(b)}")
    try:
        cpu_grads = _grads(cpu, cout, cin)
    except Exception as e:  # CPU's backward refuses (nll_loss2d's on a channels_last input): so must tpu's
        try:
            _grads(tpu, tout, tin)
        except type(e):
            return
        raise AssertionError(f"CPU's backward raises {type(e).__name__}: {e}; tpu's does not") from None
    _compare_grads(cpu_grads, _grads(tpu, tout, tin))


def _check_factory_kwargs(info: Any, mi: Any) -> None:
    try:
        torch.manual_seed(0)
        cpu = _build(info, mi, device="cpu", dtype=torch.float32)
    except TypeError:
        return  # the constructor takes no factory kwargs
    tpu = _build(info, mi, device="tpu", dtype=torch.float32)
    want = {n: t.dtype for n, t in [*cpu.named_parameters(), *cpu.named_buffers()]}
    got = {n: t for n, t in [*tpu.named_parameters(), *tpu.named_buffers()]}
    if want.keys() != got.keys():
        raise AssertionError(f"factory kwargs: CPU holds {sorted(want)}, tpu {sorted(got)}")
    for n, t in got.items():
        if t.device.type != "tpu" or t.dtype != want[n]:
            raise AssertionError(f"factory kwargs: {n} is {t.dtype} on {t.device}; CPU's is {want[n]} (wanted on tpu)")


def _check_bf16(info: Any, mi: Any, training: bool) -> bool | None:
    """The forward in bfloat16 against CPU's bfloat16 forward; None where CPU rejects it."""
    try:
        cpu, tpu = _pair(info, mi, training, dtype=torch.bfloat16)
        torch.manual_seed(0)
        with torch.no_grad():
            _, cout = _call(cpu, mi.forward_input, "cpu", dtype=torch.bfloat16)
    except Exception:
        return None
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            _, tout = _call(tpu, mi.forward_input, "tpu", dtype=torch.bfloat16)
        _compare(cout, tout, rtol=BF16_RTOL, atol=BF16_ATOL)
    except Exception:
        return False
    return True


# ------------------------------------------------------------------------------ one module
def _inputs(info: Any, training: bool, max_inputs: int) -> list:
    torch.manual_seed(0)
    got = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True, training=training)
    return [mi for mi in got if mi.forward_input is not None][:max_inputs]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def check(info: Any, max_inputs: int = MAX_INPUTS, bf16: bool = True) -> ModuleVerdict:
    """Runs one ModuleInfo's inputs on CPU and tpu and returns its verdict."""
    v = ModuleVerdict(module_key(info))
    modes = (True, False) if info.train_and_eval_differ else (True,)
    cases = []
    skipped = []
    for training in modes:
        for i, mi in enumerate(_inputs(info, training, max_inputs)):
            label = f"{'train' if training else 'eval'} {mi.desc or i}"
            try:
                random = _is_random(info, mi, training)
            except Exception:
                random = False  # CPU rejects it: the forward check says what tpu does
            if random:
                skipped.append(f"{label}: random")
            else:
                cases.append((training, mi, label))
    v.skipped_inputs = tuple(skipped)
    if not cases:
        v.skipped = "every input's output is random"
        return v

    def each(check_one: Callable[[bool, Any], None], name: str) -> bool:
        for training, mi, label in cases:
            try:
                check_one(training, mi)
            except Exception as e:
                v.error = v.error or f"{name} [{label}]: {_first_line(e)}"
                return False
        return True

    torch_tpu.reset_metrics()
    v.forward = each(lambda t, mi: _check_forward_only(info, mi, t), "forward")
    v.fallbacks = fallbacks(torch_tpu.metrics())
    v.no_fallback = v.forward and not v.fallbacks
    if not v.forward:
        return v
    v.grad = each(lambda t, mi: _check_input(info, mi, t), "grad")
    v.noncontiguous = each(lambda t, mi: _check_input(info, mi, t, _noncontiguous), "non-contiguous")
    v.memory_format = each(lambda t, mi: _check_memory_format(info, mi, t), "memory format")
    v.factory_kwargs = each(lambda t, mi: _check_factory_kwargs(info, mi), "factory kwargs")
    if bf16:
        got = [_check_bf16(info, mi, t) for t, mi, _ in cases]
        known = [g for g in got if g is not None]
        v.bf16 = all(known) if known else None
    return v


def _check_forward_only(info: Any, mi: Any, training: bool) -> None:
    cpu, tpu = _pair(info, mi, training)
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            _, cout = _call(cpu, mi.forward_input, "cpu")
    except Exception:
        torch.manual_seed(0)
        try:
            with torch.no_grad():
                _call(tpu, mi.forward_input, "tpu")
        except Exception:
            return
        raise AssertionError("CPU rejects this input; tpu accepted it") from None
    torch.manual_seed(0)
    with torch.no_grad():
        _, tout = _call(tpu, mi.forward_input, "tpu")
    _compare(cout, tout)
    _compare(dict(cpu.named_buffers()), dict(tpu.named_buffers()), what="buffers after the forward")


def _check_memory_format(info: Any, mi: Any, training: bool) -> None:
    shapes = [t.dim() for t in tree_flatten((mi.forward_input.args, mi.forward_input.kwargs))[0]
              if isinstance(t, torch.Tensor)]
    if 4 in shapes or 5 in shapes:
        _check_input(info, mi, training, _channels_last, channels_last=True)


def run(infos: list, verbose: bool = False, **kw: Any) -> list[ModuleVerdict]:
    """:func:`check` for each ModuleInfo, warnings silenced; a failure of the harness itself
    becomes the module's verdict, never the end of the run."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in infos:
            try:
                v = check(info, **kw)
            except Exception:
                v = ModuleVerdict(module_key(info), error="harness: " + traceback.format_exc(limit=1).splitlines()[-1])
            if verbose:
                flags = " ".join(f"{k}={int(getattr(v, k))}" for k in CHECKS)
                print(f"{v.name:32s} {'skip ' + v.skipped if v.skipped else flags} bf16={v.bf16} {v.error[:160]}",
                      flush=True)
            out.append(v)
    return out


def summary(verdicts: list[ModuleVerdict]) -> dict[str, Any]:
    tested = [v for v in verdicts if not v.skipped]
    n = max(len(tested), 1)
    bf16 = [v.bf16 for v in tested if v.bf16 is not None]
    return {
        "entries": len(verdicts), "tested": len(tested), "skipped": len(verdicts) - len(tested),
        **{k: sum(getattr(v, k) for v in tested) / n for k in CHECKS},
        "bf16": sum(bf16) / max(len(bf16), 1), "bf16_tested": len(bf16),
    }


__all__ = ["CHECKS", "ModuleVerdict", "check", "module_infos", "module_key", "run", "summary"]
