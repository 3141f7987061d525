"""The decode benchmark's Llama written directly in JAX: the ceiling of a decode step.

Why: ``bench decode --modes jax`` measures, in the same run as the tpu modes, what a hand-written
JAX program gets from the same machine for the same model: transformers' Llama (``decode.tiny_llama``),
its weights read from the torch model, one jitted step per token with a static KV cache that is
donated, so XLA updates it in place. The prompt is fed one position per call, as the ``export``
loop does, so prefill and decode are one program. Greedy decoding: CPU PyTorch's tokens.

The arithmetic follows transformers' Llama in float32: RMSNorm in float32, rotary embeddings from
``rope_theta`` (the default rope type), grouped-query attention over the cache positions up to
the current one, a SiLU-gated MLP, an ``lm_head`` of its own or tied to the embedding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

Weights = dict[str, jax.Array]


class Decoder:
    """One model's jitted decode step and its weights on the device; :meth:`decode` runs a request."""

    def __init__(self, model: Any, batch: int, max_len: int,
                 watch: Callable[[Callable, Callable, tuple], Callable] | None = None) -> None:
        c = model.config
        rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise NotImplementedError(f"the JAX decode ceiling has the default rotary embedding only, not "
                                      f"{rope.get('rope_type')!r}")
        if getattr(c, "attention_bias", False) or getattr(c, "mlp_bias", False):
            raise NotImplementedError("the JAX decode ceiling has no attention or MLP bias")
        self.layers, self.heads, self.kv_heads = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.theta = float(rope.get("rope_theta", getattr(c, "rope_theta", None) or 10000.0))
        self.batch, self.max_len = batch, max_len
        self.weights = {k: jax.device_put(v.detach().cpu().numpy()) for k, v in model.named_parameters()}
        cache = (self.layers, batch, self.kv_heads, max_len, self.head_dim)
        self.cache_shape = cache
        jitted = jax.jit(self.step, donate_argnums=(1, 2))
        self.run = watch(jitted, self.step, (1, 2)) if watch is not None else jitted

    def _rms(self, x: jax.Array, w: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        return w * (x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + self.eps))

    def _rotate(self, x: jax.Array, pos: jax.Array) -> jax.Array:
        """Rotary embedding of ``x`` (..., head_dim) at position ``pos``, transformers' default."""
        d = self.head_dim
        inv = 1.0 / (self.theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
        freqs = pos.astype(jnp.float32) * inv
        emb = jnp.concatenate([freqs, freqs])
        half = d // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * jnp.cos(emb) + rotated * jnp.sin(emb)

    def step(self, w: Weights, ck: jax.Array, cv: jax.Array, token: jax.Array,
             pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One position: ``token`` [batch] at ``pos`` (a runtime int32) -> the greedy next token
        [batch] and the caches with this position's keys and values written."""
        B, H, K, hd = self.batch, self.heads, self.kv_heads, self.head_dim
        x = w["model.embed_tokens.weight"][token]
        visible = jnp.arange(self.max_len) <= pos
        zero = jnp.zeros((), pos.dtype)  # the update's start indices, all of pos's dtype
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, K, H // K, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(B, K, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(B, K, hd)
            q, k = self._rotate(q, pos), self._rotate(k, pos)
            at = (zero + i, zero, zero, pos, zero)
            ck = jax.lax.dynamic_update_slice(ck, k[None, :, :, None, :], at)
            cv = jax.lax.dynamic_update_slice(cv, v[None, :, :, None, :], at)
            scores = jnp.einsum("bkgd,bksd->bkgs", q, ck[i]) * hd**-0.5
            probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
            attn = jnp.einsum("bkgs,bksd->bkgd", probs, cv[i]).reshape(B, H * hd)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, w[p + "post_attention_layernorm.weight"])
            gate = jax.nn.silu(h @ w[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]  # tied
        logits = self._rms(x, w["model.norm.weight"]) @ head.T
        return jnp.argmax(logits, axis=-1).astype(token.dtype), ck, cv

    def decode(self, prompt: torch.Tensor, new_tokens: int,
               on_token: Callable[[int, jax.Array], None] | None = None) -> torch.Tensor:
        """Greedy decoding of a fresh request: the prompt one position per call, then one token per
        call. Returns prompt and new tokens, [batch, length + new_tokens], as ``static_decode``."""
        batch, length = prompt.shape
        if batch != self.batch or length + new_tokens > self.max_len:
            raise ValueError(f"the decoder was built for batch {self.batch} and {self.max_len} positions, "
                             f"not batch {batch} and {length + new_tokens}")
        ck = jnp.zeros(self.cache_shape, jnp.float32)
        cv = jnp.zeros(self.cache_shape, jnp.float32)
        ids = jnp.asarray(prompt.numpy().astype(np.int32))
        token = ids[:, 0]
        for i in range(length):
            token, ck, cv = self.run(self.weights, ck, cv, ids[:, i], jnp.int32(i))
        tokens = []
        for i in range(new_tokens):
            tokens.append(token)
            if on_token is not None:
                on_token(i, token)
            if i + 1 < new_tokens:
                token, ck, cv = self.run(self.weights, ck, cv, token, jnp.int32(length + i))
        new = np.stack([np.asarray(t) for t in tokens], axis=1).astype(np.int64)
        return torch.cat([prompt, torch.from_numpy(new)], dim=1)


__all__ = ["Decoder"]
