"""Conformance against PyTorch's own OpInfo database, with CPU as the reference.

For each OpInfo that supports float32 on CPU, its sample inputs run on CPU and on tpu; values,
shapes and dtypes must match (rtol 1e-3, atol 1e-4). Three verdicts per op:

* ``forward``: every sample's outputs match (a sample CPU rejects must be rejected on tpu too);
* ``grad``: gradients of the float outputs w.r.t. the inputs match (ops without autograd count
  as passing when their forward does);
* ``no_fallback``: the forward passed without any op running on the CPU fallback.

Ops whose results are uninitialised (``empty*``) or random are skipped.
"""

from __future__ import annotations

import dataclasses
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_tpu
from torch_tpu.testing.expected import fallbacks

RTOL, ATOL = 1e-3, 1e-4
MAX_SAMPLES = 6

_RANDOM = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal", "uniform",
    "rand_like", "randn_like", "randint_like", "randint", "randn", "rand", "nn.functional.dropout",
    "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "randperm", "torch._C._nn.rrelu",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "nn.functional.gumbel_softmax",
}
_UNINITIALISED_PREFIXES = ("empty", "new_empty", "empty_like", "empty_strided", "empty_permuted")


def op_key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def skip_reason(op) -> str | None:
    if op.name.startswith(_UNINITIALISED_PREFIXES) or op.name in ("new_empty_strided",):
        return "uninitialised result"
    if op.name in _RANDOM or op.name.split(".")[-1] in _RANDOM:
        return "random result"
    return None


def float32_ops() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if torch.float32 in o.supported_dtypes("cpu")]


@dataclasses.dataclass
class Verdict:
    name: str
    forward: bool = False
    grad: bool = False
    no_fallback: bool = False
    skipped: str | None = None
    error: str = ""
    fallbacks: tuple[str, ...] = ()


def _to_tpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().to("tpu")
        return y.requires_grad_(x.requires_grad) if x.requires_grad else y
    return x


def _to_cpu(x: Any) -> Any:
    return x.detach().to("cpu") if isinstance(x, torch.Tensor) else x


def _compare(cpu_out: Any, tpu_out: Any) -> None:
    a, _ = tree_flatten(cpu_out)
    b, _ = tree_flatten(tree_map(_to_cpu, tpu_out))
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} outputs on CPU, {len(b)} on tpu")
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor):
                raise AssertionError(f"CPU gave a tensor, tpu gave {type(y).__name__}")
            torch.testing.assert_close(y, x, rtol=RTOL, atol=ATOL, equal_nan=True)
        elif isinstance(x, float):
            torch.testing.assert_close(float(y), x, rtol=RTOL, atol=ATOL, equal_nan=True)
        elif x != y and not (isinstance(x, torch.dtype | torch.Size | tuple | list) and x == y):
            raise AssertionError(f"CPU gave {x!r}, tpu gave {y!r}")


def _sample_call(op, sample, to_dev):
    inp = tree_map(to_dev, sample.input)
    args = tree_map(to_dev, sample.args)
    kwargs = tree_map(to_dev, sample.kwargs)
    # as PyTorch's own OpInfo tests do: e.g. eigh's eigenvectors are compared up to sign
    return inp, args, kwargs, sample.output_process_fn_grad(op(inp, *args, **kwargs))


def _random_sample(sample) -> bool:
    """Samples that ask for dropout give random results: attention ops take a dropout_p, and
    multi_head_attention_forward applies its dropout whenever ``training=True``."""
    p = sample.kwargs.get("dropout_p", 0.0)
    return (isinstance(p, float) and p > 0.0) or sample.kwargs.get("training") is True


def _leaves(*trees: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(trees)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads(out: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    flat, _ = tree_flatten(out)
    outs = [o for o in flat if isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point]
    if not outs:
        return []
    # a fixed, uneven cotangent, built on CPU so the harness itself uses few tpu ops
    total = sum((o * (torch.arange(o.numel()) % 7 + 1).reshape(o.shape).to(o.device, o.dtype)).sum() for o in outs)
    gs = torch.autograd.grad(total, inputs, allow_unused=True)
    return [None if g is None else g.detach().cpu() for g in gs]


def _compare_grads(cpu: list, tpu: list) -> None:
    """The tpu gradients equal CPU's: as many, the same ones undefined, the values close."""
    if len(cpu) != len(tpu):
        raise AssertionError(f"{len(cpu)} gradients on CPU, {len(tpu)} on tpu")
    for a, b in zip(cpu, tpu):
        if (a is None) != (b is None):
            raise AssertionError("a gradient is missing on one side")
        if a is not None:
            torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, equal_nan=True)


def check(op, max_samples: int = MAX_SAMPLES, grads: bool = True) -> Verdict:
    """Runs one OpInfo on CPU and tpu and returns its verdict."""
    v = Verdict(op_key(op))
    v.skipped = skip_reason(op)
    if v.skipped:
        return v
    torch_tpu.reset_metrics()
    try:
        torch.manual_seed(0)  # the same samples whatever ran before
        samples = list(_take(op.sample_inputs("cpu", torch.float32, requires_grad=False), max_samples))
        for s in samples:
            if _random_sample(s) and "attention" in op.name:
                continue
            try:
                *_, cpu_out = _sample_call(op, s, lambda x: x)
            except Exception:
                continue  # CPU rejects it; tpu must reject it too
            else:
                _, _, _, tpu_out = _sample_call(op, s, _to_tpu)
                _compare(cpu_out, tpu_out)
                continue
        v.forward = True
        v.fallbacks = fallbacks(torch_tpu.metrics())
        v.no_fallback = not v.fallbacks
    except Exception as e:
        v.error = f"forward: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        v.fallbacks = fallbacks(torch_tpu.metrics())
        return v
    if not grads or not op.supports_autograd:
        v.grad = v.forward
        return v
    try:
        torch.manual_seed(0)
        samples = list(_take(op.sample_inputs("cpu", torch.float32, requires_grad=True), max_samples))
        for s in samples:
            if _random_sample(s) and "attention" in op.name:
                continue
            try:
                cin, cargs, ckw, cout = _sample_call(op, s, lambda x: x)
                cg = _grads(cout, _leaves(cin, cargs, ckw))
            except Exception:
                continue
            tin, targs, tkw, tout = _sample_call(op, s, _to_tpu)
            tg = _grads(tout, _leaves(tin, targs, tkw))
            _compare_grads(cg, tg)
        v.grad = True
    except Exception as e:
        v.error = f"grad: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return v


def _take(it: Iterable, n: int):
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def run(ops: list, verbose: bool = False, checker: Callable[..., Verdict] | None = None, **kw) -> list[Verdict]:
    """``checker`` (eager :func:`check` by default) for each op, warnings silenced; a failure of the
    harness itself becomes the op's verdict, never the end of the run."""
    checker = checker or check
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in ops:
            try:
                v = checker(op, **kw)
            except Exception:  # the harness itself must never stop the run
                v = Verdict(op_key(op), error="harness: " + traceback.format_exc(limit=1).splitlines()[-1])
            if verbose:
                status = "skip" if v.skipped else f"fwd={int(v.forward)} grad={int(v.grad)} nofb={int(v.no_fallback)}"
                print(f"{v.name:45s} {status} {v.error[:160]} {','.join(v.fallbacks)[:120]}", flush=True)
            out.append(v)
    return out


def summary(verdicts: list[Verdict]) -> dict[str, Any]:
    tested = [v for v in verdicts if not v.skipped]
    n = max(len(tested), 1)
    return {
        "opinfos": len(verdicts),
        "tested": len(tested),
        "skipped": len(verdicts) - len(tested),
        "forward": sum(v.forward for v in tested) / n,
        "grad": sum(v.grad for v in tested) / n,
        "no_fallback": sum(v.no_fallback for v in tested) / n,
    }


# ------------------------------------------------------------------------------ torch.compile
COMPILED_SAMPLES = 2


def check_compiled(op, max_samples: int = COMPILED_SAMPLES, grads: bool = True) -> Verdict:
    """Runs one OpInfo's first samples through ``torch.compile(backend="tpu")`` and compares them
    with CPU eager: ``forward`` for the values, ``grad`` for the gradients, which run the backward
    graph that AOTAutograd compiles through the same backend (``no_fallback`` is not measured).

    Graphs reach ops eager mode never sees (functional views such as ``view_copy``, the
    ``with_effects`` wrapper, ops AOTAutograd keeps whole, backward ops such as
    ``convolution_backward``), so each op runs in a graph of its own. Dynamo is reset before each
    sample: every sample is a fresh static-shape compile.
    """
    import torch._dynamo

    v = Verdict(op_key(op))
    v.skipped = skip_reason(op)
    if v.skipped:
        return v

    def call(*args: Any, **kwargs: Any) -> Any:
        return op(*args, **kwargs)

    def samples(requires_grad: bool) -> list:
        torch.manual_seed(0)
        got = _take(op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad), max_samples)
        return [s for s in got if not _random_sample(s)]

    try:
        for s in samples(False):
            try:
                *_, cpu_out = _sample_call(op, s, lambda x: x)
            except Exception:
                continue  # CPU rejects it: eager mode checks the errors
            torch._dynamo.reset()
            _, _, _, tpu_out = _sample_call(torch.compile(call, backend="tpu"), s, _to_tpu)
            _compare(cpu_out, tpu_out)
        v.forward = True
    except Exception as e:
        v.error = f"compiled: {type(e).__name__}: {_first_line(e)}"
        torch._dynamo.reset()
        return v
    if not grads or not op.supports_autograd:
        v.grad = v.forward
        torch._dynamo.reset()
        return v
    try:
        for s in samples(True):
            try:
                cin, cargs, ckw, cout = _sample_call(op, s, lambda x: x)
                cg = _grads(cout, _leaves(cin, cargs, ckw))
            except Exception:
                continue
            torch._dynamo.reset()
            tin, targs, tkw, tout = _sample_call(torch.compile(call, backend="tpu"), s, _to_tpu)
            tg = _grads(tout, _leaves(tin, targs, tkw))
            _compare_grads(cg, tg)
        v.grad = True
    except Exception as e:
        v.error = f"compiled grad: {type(e).__name__}: {_first_line(e)}"
    finally:
        torch._dynamo.reset()
    return v


def _first_line(e: Exception) -> str:
    """The message's first line that says something (Dynamo wraps the backend's error)."""
    lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.startswith("backend=")]
    return lines[0][:300] if lines else ""


def run_compiled(ops: list, verbose: bool = False) -> list[Verdict]:
    """:func:`check_compiled` for each op, Dynamo's logging silenced."""
    import logging

    torch._logging.set_logs(dynamo=logging.CRITICAL, graph_breaks=False)
    return run(ops, verbose, checker=check_compiled)
