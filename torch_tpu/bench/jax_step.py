"""The benchmark's workloads written directly in JAX: the ceiling a PyTorch-on-XLA backend aims at.

Why: ``bench train --mode jax`` measures, in the same process and the same way as the tpu modes,
what a hand-written JAX program gets from the same machine: the same model (``workloads.py``),
the same starting weights and batch (read from the torch model that ``workloads.make`` builds on
CPU), the same optimizer arithmetic as ``torch.optim.SGD`` / ``torch.optim.AdamW``, as one jitted
step whose parameters and optimizer state are donated. With ``--target`` its program is compiled
for the TPU chip as the tpu modes' programs are, so the projections sit side by side.

``bf16`` follows ``torch.autocast(dtype=torch.bfloat16)``'s rules for the ops these models use:
matrix products (``linear``, ``matmul``) take bfloat16 inputs and give bfloat16 results; layer
norm, softmax and the loss run in float32; GELU keeps its input's dtype; an add of bfloat16 and
float32 is float32.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_tpu.bench import workloads

Params = dict[str, jax.Array]


def _array(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(t.detach().cpu().numpy())


class _Math:
    """The models' layers, in float32 or under bfloat16 autocast's rules."""

    def __init__(self, bf16: bool) -> None:
        self.low = jnp.bfloat16 if bf16 else None

    def cast(self, x: jax.Array) -> jax.Array:
        return x.astype(self.low) if self.low is not None else x

    def linear(self, p: Params, name: str, x: jax.Array) -> jax.Array:
        y = jnp.matmul(self.cast(x), self.cast(p[f"{name}.weight"]).T)  # torch's layout: W[out, in]
        return y + self.cast(p[f"{name}.bias"]) if f"{name}.bias" in p else y

    def matmul(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.matmul(self.cast(a), self.cast(b))

    @staticmethod
    def layer_norm(p: Params, name: str, x: jax.Array, eps: float = 1e-5) -> jax.Array:
        x = x.astype(jnp.float32)
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + eps) * p[f"{name}.weight"] + p[f"{name}.bias"]

    @staticmethod
    def gelu(x: jax.Array) -> jax.Array:  # torch's exact GELU, computed in float32 and rounded back
        return jax.nn.gelu(x.astype(jnp.float32), approximate=False).astype(x.dtype)

    @staticmethod
    def cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
        logits = logits.astype(jnp.float32)
        picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        return (jax.nn.logsumexp(logits, axis=-1) - picked).mean()


def _mlp_loss(m: _Math, p: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.relu(m.linear(p, "0", x))
    h = jax.nn.relu(m.linear(p, "2", h))
    return m.cross_entropy(m.linear(p, "4", h), y)


def _gpt_loss(m: _Math, p: Params, idx: jax.Array, y: jax.Array, layers: int, heads: int) -> jax.Array:
    B, T = idx.shape
    x = p["tok.weight"][idx] + p["pos.weight"][jnp.arange(T)]
    D = x.shape[-1]
    hd = D // heads
    causal = jnp.tril(jnp.ones((T, T), bool))
    for i in range(layers):
        b = f"blocks.{i}"
        q, k, v = jnp.split(m.linear(p, f"{b}.qkv", m.layer_norm(p, f"{b}.ln1", x)), 3, axis=2)
        q, k, v = (t.reshape(B, T, heads, hd).transpose(0, 2, 1, 3) for t in (q, k, v))
        att = m.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(hd)
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf).astype(jnp.float32), axis=-1)
        out = m.matmul(att, v).transpose(0, 2, 1, 3).reshape(B, T, D)
        x = x + m.linear(p, f"{b}.proj", out)
        h = m.gelu(m.linear(p, f"{b}.fc1", m.layer_norm(p, f"{b}.ln2", x)))
        x = x + m.linear(p, f"{b}.fc2", h)
    logits = m.linear(p, "head", m.layer_norm(p, "ln", x))
    return m.cross_entropy(logits.reshape(B * T, -1), y.reshape(-1))


def _sgd(group: dict) -> tuple[Callable, Callable]:
    lr = group["lr"]
    if group.get("momentum") or group.get("weight_decay") or group.get("nesterov"):
        raise NotImplementedError("the JAX ceiling's SGD is plain SGD (no momentum, no weight decay)")

    def init(p: Params) -> Any:
        return ()

    def update(p: Params, g: Params, s: Any) -> tuple[Params, Any]:
        return {k: p[k] - lr * g[k] for k in p}, s

    return init, update


def _adamw(group: dict) -> tuple[Callable, Callable]:
    """torch.optim.AdamW's arithmetic (not amsgrad, not maximize): decoupled decay, then Adam with
    bias corrections from the step count."""
    if group.get("amsgrad") or group.get("maximize"):
        raise NotImplementedError("the JAX ceiling's AdamW has no amsgrad or maximize")
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]

    def init(p: Params) -> Any:
        def zeros() -> Params:  # two sets of buffers: each is donated
            return {k: jnp.zeros_like(v) for k, v in p.items()}

        return jnp.zeros((), jnp.float32), zeros(), zeros()

    def update(p: Params, g: Params, s: Any) -> tuple[Params, Any]:
        t, m, v = s
        t = t + 1
        m = {k: b1 * m[k] + (1 - b1) * g[k] for k in p}
        v = {k: b2 * v[k] + (1 - b2) * g[k] * g[k] for k in p}
        step_size = lr / (1 - b1**t)
        root = jnp.sqrt(1 - b2**t)
        new = {k: p[k] * (1 - lr * wd) - step_size * m[k] / (jnp.sqrt(v[k]) / root + eps) for k in p}
        return new, (t, m, v)

    return init, update


def build(workload: str, bf16: bool = False) -> tuple[Callable, Any, tuple, int]:
    """(step_fn, state, (x, y), tokens per step): ``step_fn(state, x, y) -> (state, loss)`` is the
    whole training step, to be jitted with the state donated; the state starts from the weights
    and optimizer of ``workloads.make(workload, "cpu")``."""
    model, step, tokens = workloads.make(workload, "cpu")
    params = {k: _array(v) for k, v in model.named_parameters()}
    group = step.optimizer.param_groups[0]
    init, update = (_sgd if isinstance(step.optimizer, torch.optim.SGD) else _adamw)(group)
    m = _Math(bf16)
    if workload == "mlp":
        loss_of: Callable = lambda p, x, y: _mlp_loss(m, p, x, y)
    else:
        _, _, layers, heads, _, _ = workloads.SIZES[workload]
        loss_of = lambda p, x, y: _gpt_loss(m, p, x, y, layers, heads)

    def step_fn(state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, jax.Array]:
        p, s = state
        loss, grads = jax.value_and_grad(loss_of)(p, x, y)
        p, s = update(p, grads, s)
        return (p, s), loss

    x, y = step.data
    return step_fn, (params, init(params)), (_array(x), _array(y)), tokens


Watch = Callable[[Callable, Callable, tuple], Callable]


def stepper(workload: str, bf16: bool, watch: Watch) -> tuple[Callable, float]:
    """A no-argument step (as ``workloads.make``'s) running the compiled JAX step on the held state,
    and the seconds its compile took. The program takes the state's arrays as flat arguments, all
    donated. ``watch(executable, fn, donated)`` may wrap it (the TPU target's compile of each
    program, which lowers ``fn`` again from the arguments' shapes)."""
    step_fn, state, (x, y), _ = build(workload, bf16)
    leaves, tree = jax.tree_util.tree_flatten(state)
    n = len(leaves)

    def flat_fn(*args: jax.Array) -> tuple[jax.Array, ...]:
        new, loss = step_fn(tree.unflatten(args[:n]), args[n], args[n + 1])
        return (*jax.tree_util.tree_leaves(new), loss)

    donated = tuple(range(n))
    held = [jax.device_put(a) for a in leaves]
    x, y = jax.device_put(x), jax.device_put(y)
    t0 = time.perf_counter()
    compiled = jax.jit(flat_fn, donate_argnums=donated).lower(*held, x, y).compile()
    compile_s = time.perf_counter() - t0
    run = watch(compiled, flat_fn, donated)

    def step() -> jax.Array:
        out = run(*held, x, y)
        held[:] = out[:n]
        return out[n]

    return step, compile_s


def loss_value(loss: Any) -> float:
    """A step's loss on the host: a torch tensor's or a JAX array's."""
    if isinstance(loss, torch.Tensor):
        return float(loss.detach().to("cpu"))
    return float(np.asarray(loss))


__all__ = ["build", "loss_value", "stepper"]
