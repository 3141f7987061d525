"""Convolutions (1d/2d/3d, grouped, dilated, transposed) as one ``lax.conv_general_dilated``.

``aten.convolution`` is the op every ``F.conv*`` reaches; without our kernel torch would route a
PrivateUse1 tensor to ``convolution_overrideable`` and fail. Its backward is ``jax.vjp`` of the
same forward, computing only the gradients ``output_mask`` asks for.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
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


def _convolution_meta(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
                      *rest):
    _channel_checks(input, weight, groups, transposed)
    return aten.convolution.default(input, weight, bias, stride, padding, dilation, transposed, output_padding,
                                    groups)


@lower(aten.convolution, meta=_convolution_meta)
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


lower(aten.convolution_backward.default, by_name=True)(_conv_backward)
