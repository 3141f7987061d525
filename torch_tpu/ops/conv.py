"""Convolutions (1d/2d/3d, grouped, dilated, transposed) as one ``lax.conv_general_dilated``.

``aten.convolution`` is the op every ``F.conv*`` reaches; without our kernel torch would route a
PrivateUse1 tensor to ``convolution_overrideable`` and fail. Its backward is ``jax.vjp`` of the
same forward, computing only the gradients ``output_mask`` asks for.

Which kernel torch would pick (``torch._C._select_conv_backend``) also decides the output's
memory format, on CPU and in FakeTensor's prediction of it under ``torch.compile``. For a
PrivateUse1 tensor torch answers ``Overrideable``, whose format is always contiguous, where CPU's
is ``channels_last`` for a ``channels_last`` input or weight. A tpu convolution lays its output
out as CPU does, so :func:`install` makes torch's two questions answer CPU's for tpu tensors:
the eager result, the compiled graph's prediction and a CUDA-style test of the choice then agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import torch
from jax import lax

from torch_tpu.ops._registry import aten, lower

_LOW = (jnp.bfloat16, jnp.float16)


def _expand(v: list[int], n: int) -> list[int]:
    v = list(v)
    return v * n if len(v) == 1 else v


def conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """The convolution, NC... layout, as torch defines it (weight OI... or, transposed, IO...)."""
    n = weight.ndim - 2
    stride, padding, dilation = _expand(stride, n), _expand(padding, n), _expand(dilation, n)
    output_padding = _expand(output_padding, n) if output_padding else [0] * n
    low = input.dtype in _LOW
    # CPU accumulates in float32 and has no reduced-precision matmul passes: ask XLA for the same.
    precision = None if low else lax.Precision.HIGHEST
    pref = jnp.float32 if low else None
    if not transposed:
        out = lax.conv_general_dilated(
            input, weight, window_strides=stride, padding=[(p, p) for p in padding], rhs_dilation=dilation,
            feature_group_count=groups, precision=precision, preferred_element_type=pref,
        )
    else:
        # A transposed conv is a conv of the stride-dilated input with the flipped, in/out-swapped kernel.
        cin, cout_g, *k = weight.shape
        w = weight.reshape(groups, cin // groups, cout_g, *k).swapaxes(1, 2).reshape(groups * cout_g, cin // groups, *k)
        w = jnp.flip(w, axis=tuple(range(2, 2 + n)))
        pads = [
            (d * (kk - 1) - p, d * (kk - 1) - p + op)
            for kk, p, d, op in zip(k, padding, dilation, output_padding)
        ]
        out = lax.conv_general_dilated(
            input, w, window_strides=[1] * n, padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
            feature_group_count=groups, precision=precision, preferred_element_type=pref,
        )
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * n).astype(out.dtype)
    return out.astype(input.dtype)


def _channel_checks(input, weight, groups, transposed) -> None:
    """CPU's check of the input's channels against the weight's, in CPU's words: torch's meta
    kernel says only "Invalid channel dimensions", and lets a transposed mismatch through."""
    if input.dim() != weight.dim() or weight.dim() < 3:
        return
    want = weight.shape[0] if transposed else weight.shape[1] * groups
    if input.shape[1] != want:
        given = "transposed=1" if transposed else f"groups={groups}"
        raise RuntimeError(
            f"Given {given}, weight of size {list(weight.shape)}, expected input{list(input.shape)} to have "
            f"{want} channels, but got {input.shape[1]} channels instead"
        )


def _stand_in(t: Any) -> Any:
    """A CPU tensor of ``t``'s sizes, strides and dtype (never written or read: only its geometry
    and flags are asked), for torch's CPU answer to a question about ``t``."""
    if not isinstance(t, torch.Tensor) or t.device.type == "cpu":
        return t
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    return c.requires_grad_() if t.requires_grad and c.is_floating_point() else c


def _as_cpu(question: Callable[..., Any]) -> Callable[..., Any]:
    def on_cpu(*args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, torch.Tensor) and a.device.type == "tpu" for a in (*args, *kwargs.values())):
            args = tuple(_stand_in(a) for a in args)
            kwargs = {k: _stand_in(v) for k, v in kwargs.items()}
        return question(*args, **kwargs)

    on_cpu.__name__ = question.__name__
    on_cpu.__doc__ = question.__doc__
    on_cpu.__wrapped__ = question  # type: ignore[attr-defined]
    return on_cpu


def install() -> None:
    """Answer ``_select_conv_backend`` and ``_conv_determine_backend_memory_format`` for tpu
    tensors as CPU does (see the module docstring). Idempotent."""
    for name in ("_select_conv_backend", "_conv_determine_backend_memory_format"):
        current = getattr(torch._C, name)
        if not hasattr(current, "__wrapped__"):
            setattr(torch._C, name, _as_cpu(current))


# CPU's slow 3-D kernels return a contiguous result whatever the formats (torch's own prediction,
# FakeTensor's, says channels_last_3d for a channels_last_3d input there; eager CPU is followed).
_CONTIGUOUS_ON_CPU = frozenset(
    getattr(torch._C._ConvBackend, n) for n in ("Slow3d", "SlowDilated3d", "SlowTranspose3d")
    if hasattr(torch._C._ConvBackend, n)
)


def _cpu_format(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    """The memory format CPU's kernel gives a convolution's result (and its input and weight
    gradients) for these arguments' geometry: torch's own prediction, but contiguous where CPU's
    slow 3-D kernels ignore it. Decided as with torch's default oneDNN setting, so that the one
    cached program per signature does not depend on the setting at its first call (a disabled
    oneDNN changes only 3-D results, to contiguous)."""
    if weight.dim() < 4 or input.numel() == 0 or weight.numel() == 0:
        return torch.contiguous_format  # CPU's 1-D convolutions and empty results stay contiguous
    args = [_stand_in(input), _stand_in(weight), _stand_in(bias)]
    before = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(torch.backends.mkldnn.is_available())
    try:
        backend = torch._C._select_conv_backend.__wrapped__(  # type: ignore[attr-defined]
            *args, stride, padding, dilation, transposed, output_padding, groups)
        if backend in _CONTIGUOUS_ON_CPU:
            return torch.contiguous_format
        return torch._C._conv_determine_backend_memory_format.__wrapped__(  # type: ignore[attr-defined]
            args[0], args[1], backend)
    finally:
        torch._C._set_mkldnn_enabled(before)


def _in_format(t, fmt):
    return None if t is None else t.contiguous(memory_format=fmt)


def _convolution_meta(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                      *rest):
    _channel_checks(input, weight, groups, transposed)
    out = aten.convolution.default(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                                   groups)
    return _in_format(out, _cpu_format(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                                       groups))


def _conv_backward_meta(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
                        output_padding, groups, output_mask):
    gx, gw, gb = aten.convolution_backward.default(grad_output, input, weight, bias_sizes, stride, padding,
                                                   dilation, transposed, output_padding, groups, output_mask)
    fmt = _cpu_format(input, weight, None, stride, padding, dilation, transposed, output_padding, groups)
    return _in_format(gx, fmt), _in_format(gw, fmt), gb


def _wide_int(input, *args, **kwargs) -> bool:
    """A convolution of 64-bit integers: XLA:TPU has no 64-bit integer convolution ("While rewriting
    computation to not contain X64 element types"), so on a TPU (or with a TPU target) it runs on
    the host, as CPU computes it (found by tools/target_sweep.py). A device lowering without a
    64-bit convolution, as the 64-bit matrix products have (``linalg._wide_int_matmul``), is the
    better answer; integer convolutions are rare enough that the host serves for now."""
    return input.dtype in (torch.int64, torch.uint64)


@lower(aten.convolution, meta=_convolution_meta, host_on_tpu=_wide_int)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@lower(aten._convolution.default, meta=_convolution_meta)
def _convolution(
    input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
    benchmark=False, deterministic=False, cudnn_enabled=True, allow_tf32=True,
):
    return conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


def _conv_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
) -> tuple[Any, ...]:
    if 0 in input.shape or 0 in weight.shape or 0 in grad_output.shape:
        # no channel (or no sample) to combine: every gradient is zero. The vjp cannot say so, as
        # torch's output for an input without channels has no channels either (CPU's shapes)
        zeros = (jnp.zeros(input.shape, input.dtype), jnp.zeros(weight.shape, weight.dtype),
                 jnp.zeros(tuple(bias_sizes or (0,)), grad_output.dtype))
        return tuple(g for g, m in zip(zeros, output_mask) if m)

    def fwd(x, w):
        return conv_forward(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(fwd, input, weight)
    gx, gw = vjp(grad_output.astype(input.dtype))
    gb = grad_output.sum(axis=(0,) + tuple(range(2, grad_output.ndim)))
    return tuple(g for g, m in zip((gx, gw, gb), output_mask) if m)


lower(aten.convolution_backward.default, by_name=True, meta=_conv_backward_meta)(_conv_backward)
