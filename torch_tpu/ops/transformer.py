"""Lowerings: the fused transformer ops of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``.

Why: in eval mode (no autograd, no autocast) torch's modules take a fast path that calls
``aten._native_multi_head_attention`` and ``aten._transformer_encoder_layer_fwd``, and that path
lists PrivateUse1 as a device it serves. Those ops have CPU and CUDA kernels only, so every eval
forward of an ``nn.Transformer*`` model on tpu ran on the host through the CPU fallback. Here each is
one device program, the arithmetic of CPU's kernel in jax: the in-projection with its bias, queries
scaled by ``1/sqrt(head_dim)`` before the product, a boolean mask applied as ``-inf`` (so a fully
masked row is NaN, as CPU's masked softmax gives), the out-projection, and for the encoder layer
the residuals, layer norms (``norm_first`` either way) and the ReLU or GELU feed-forward.
Nested (padded-batch) inputs never reach these lowerings: they dispatch to the nested key
(``torch_tpu.dispatch.nested``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from torch_tpu.ops._registry import aten
from torch_tpu.ops.elementwise import gelu
from torch_tpu.ops.linalg import _dot, matmul_lowering
from torch_tpu.ops.nn import native_layer_norm
from torch_tpu.ops.reduction import softmax


def _linear(x, weight, bias, precision):
    y = _dot(x, weight.T, precision).astype(x.dtype)
    return y if bias is None else y + bias


def _mask_for(mask, mask_type, scores):
    """The boolean "masked out" array broadcast to ``scores`` ``[B, H, L, S]``, by CPU's mask
    types: 0 an ``[L, S]`` attention mask, 1 a ``[B, S]`` key padding mask, 2 (or none) a mask of
    the scores' shape or one broadcasting to it. CPU turns a non-boolean mask into a boolean one."""
    m = mask.astype(jnp.bool_)
    if mask_type == 1:
        m = m.reshape(m.shape[0], 1, 1, m.shape[-1])
    return jnp.broadcast_to(m, scores.shape)


def _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
               need_weights, average_attn_weights, mask_type, precision):
    B, L, D = query.shape
    S = key.shape[1]
    h = D // num_head
    w_q, w_k, w_v = qkv_weight[:D], qkv_weight[D:2 * D], qkv_weight[2 * D:]
    b_q, b_k, b_v = qkv_bias[:D], qkv_bias[D:2 * D], qkv_bias[2 * D:]
    scale = jnp.asarray(1.0 / math.sqrt(h), query.dtype)
    q = _linear(query, w_q, b_q, precision) * scale
    k = _linear(key, w_k, b_k, precision)
    v = _linear(value, w_v, b_v, precision)
    q = q.reshape(B, L, num_head, h).transpose(0, 2, 1, 3)
    k = k.reshape(B, S, num_head, h).transpose(0, 2, 1, 3)
    v = v.reshape(B, S, num_head, h).transpose(0, 2, 1, 3)
    scores = _dot(q, k.transpose(0, 1, 3, 2), precision).astype(query.dtype)
    if mask is not None:
        scores = jnp.where(_mask_for(mask, mask_type, scores), -jnp.inf, scores)
    attn = softmax(scores, -1, False).astype(scores.dtype)  # the table's: in float for half inputs, as CPU
    ctx = _dot(attn, v, precision).astype(query.dtype).transpose(0, 2, 1, 3).reshape(B, L, D)
    out = _linear(ctx, proj_weight, proj_bias, precision)
    if not need_weights:
        return out, None
    return out, (attn.sum(1) / num_head if average_attn_weights else attn)


def _mha_meta(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask=None,
              need_weights=True, average_attn_weights=True, mask_type=None):
    """torch's meta kernel, except that without ``need_weights`` the weights are undefined (None in
    Python), as CPU's kernel returns them; torch's meta gives an empty tensor there."""
    out, weights = aten._native_multi_head_attention.default(
        query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, need_weights,
        average_attn_weights, mask_type)
    return out, (weights if need_weights and query.numel() and key.numel() else None)


@matmul_lowering(aten._native_multi_head_attention.default, meta=_mha_meta)
def native_multi_head_attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias,
                                mask=None, need_weights=True, average_attn_weights=True, mask_type=None,
                                precision=None):
    if query.size == 0 or key.size == 0:  # CPU's kernel: an empty result and no weights
        return jnp.zeros(query.shape, query.dtype), None
    return _attention(query, key, value, embed_dim, num_head, qkv_weight, qkv_bias, proj_weight, proj_bias, mask,
                      need_weights, average_attn_weights, mask_type, precision)


def _encoder_layer_meta(src, *args, **kwargs):
    """The result is laid out as ``src`` (torch 2.11 has no meta kernel for the op)."""
    return src.new_empty(src.shape)


@matmul_lowering(aten._transformer_encoder_layer_fwd.default, meta=_encoder_layer_meta)
def transformer_encoder_layer_fwd(src, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, use_gelu,
                                  norm_first, eps, norm_weight_1, norm_bias_1, norm_weight_2, norm_bias_2,
                                  ffn_weight_1, ffn_bias_1, ffn_weight_2, ffn_bias_2, mask=None, mask_type=None,
                                  precision=None):
    def norm(x, weight, bias):
        return native_layer_norm(x, [embed_dim], weight, bias, eps)[0].astype(x.dtype)

    if src.size == 0:
        return jnp.zeros(src.shape, src.dtype)
    x = norm(src, norm_weight_1, norm_bias_1) if norm_first else src
    x = _attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight, proj_bias, mask, False, True,
                   mask_type, precision)[0] + src
    if not norm_first:
        x = norm(x, norm_weight_1, norm_bias_1)
    y = norm(x, norm_weight_2, norm_bias_2) if norm_first else x
    y = _linear(y, ffn_weight_1, ffn_bias_1, precision)
    y = gelu(y).astype(y.dtype) if use_gelu else jnp.maximum(y, jnp.zeros((), y.dtype))
    y = _linear(y, ffn_weight_2, ffn_bias_2, precision) + x
    return norm(y, norm_weight_2, norm_bias_2) if not norm_first else y
