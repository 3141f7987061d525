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


@lower(aten.convolution)
def convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    return conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


@lower(aten._convolution.default)
def _convolution(
    input, weight, bias, stride, padding, dilation, transposed, output_padding, groups,
    benchmark=False, deterministic=False, cudnn_enabled=True, allow_tf32=True,
):
    return conv_forward(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)


def _conv_backward(
    grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
) -> tuple[Any, ...]:
    def fwd(x, w):
        return conv_forward(x, w, None, stride, padding, dilation, transposed, output_padding, groups)

    _, vjp = jax.vjp(fwd, input, weight)
    gx, gw = vjp(grad_output.astype(input.dtype))
    gb = grad_output.sum(axis=(0,) + tuple(range(2, grad_output.ndim)))
    return tuple(g for g, m in zip((gx, gw, gb), output_mask) if m)


lower(aten.convolution_backward.default, by_name=True)(_conv_backward)
