"""Lowerings: PyTorch's single-kernel optimizers (``fused=True``): Adam, AdamW and SGD.

Each updates lists of tensors in place. The kernels in :mod:`torch_tpu.dispatch.hand_kernels` run these functions
as one program over the whole lists and write every list back. The arithmetic follows CPU's fused
kernels: float32 math at least, bias corrections in double, gradients unscaled (and written back)
by ``grad_scale``, and nothing updated when ``found_inf`` is set.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def _wide(x: Any) -> Any:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _gradient(g: Any, dtype: Any, grad_scale: Any, maximize: bool) -> tuple[Any, Any]:
    """(the gradient unscaled by ``grad_scale``, in ``g``'s dtype: the kernels write it back;
    the same in ``dtype``, negated with ``maximize``: what the update uses)."""
    gw = _wide(g).astype(dtype)
    if grad_scale is not None:
        gw = gw / grad_scale.reshape(()).astype(dtype)
    return gw.astype(g.dtype), -gw if maximize else gw


def _skipped(found_inf: Any, new: list, old: list) -> list:
    """CPU's kernels return before touching anything when ``found_inf`` is 1."""
    if found_inf is None:
        return new
    skip = found_inf.reshape(()) == 1
    return [jnp.where(skip, o, n) for n, o in zip(new, old)]


def adam(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, max_exp_avg_sqs: list, steps: list,
         lr: Any, beta1: float, beta2: float, weight_decay: float, eps: float, *, amsgrad: bool, maximize: bool,
         decoupled: bool, decay: bool, grad_scale: Any = None, found_inf: Any = None) -> list:
    """One Adam (``decoupled``: AdamW) step. Returns the new params, grads, exp_avgs, exp_avg_sqs
    and, with ``amsgrad``, max_exp_avg_sqs, each list in order. ``decay``: whether
    ``weight_decay`` is nonzero (CPU skips the term entirely at 0, which matters for inf params)."""
    out: list[list] = [[], [], [], [], []]
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        step = steps[i].reshape(()).astype(jnp.float64)
        bias_correction1 = 1 - jnp.power(beta1, step)
        bias_correction2_sqrt = jnp.sqrt(1 - jnp.power(beta2, step))
        pw, mw, vw = _wide(p), _wide(m), _wide(v)
        wt = pw.dtype
        unscaled, gw = _gradient(g, wt, grad_scale, maximize)
        out[1].append(unscaled)
        if decay and decoupled:
            pw = pw * (1 - jnp.asarray(lr, jnp.float64) * weight_decay).astype(wt)
        elif decay:
            gw = gw + pw * weight_decay
        w = 1 - beta1  # exp_avg.lerp_(grad, 1 - beta1), as CPU computes it
        mw = jnp.where(jnp.abs(w) < 0.5, mw + w * (gw - mw), gw - (gw - mw) * (1 - w)).astype(wt)
        vw = vw * beta2 + (1 - beta2) * gw * gw
        if amsgrad:
            mx = jnp.maximum(_wide(max_exp_avg_sqs[i]), vw)
            out[4].append(mx.astype(max_exp_avg_sqs[i].dtype))
            denom = jnp.sqrt(mx) / bias_correction2_sqrt.astype(wt) + eps
        else:
            denom = jnp.sqrt(vw) / bias_correction2_sqrt.astype(wt) + eps
        step_size = (jnp.asarray(lr, jnp.float64) / bias_correction1).astype(wt)
        out[0].append((pw - step_size * mw / denom).astype(p.dtype))
        out[2].append(mw.astype(m.dtype))
        out[3].append(vw.astype(v.dtype))
    old = [params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else []]
    return [_skipped(found_inf, new, prev) for new, prev in zip(out, old)]


def sgd(params: list, grads: list, momentum_buffers: list, weight_decay: float, momentum: float, lr: Any,
        dampening: float, *, nesterov: bool, maximize: bool, is_first_step: bool, has_momentum: bool,
        decay: bool, grad_scale: Any = None, found_inf: Any = None) -> list:
    """One SGD step. Returns the new params, grads and (with momentum) momentum buffers."""
    out: list[list] = [[], [], []]
    for i, (p, g) in enumerate(zip(params, grads)):
        pw = _wide(p)
        wt = pw.dtype
        unscaled, gw = _gradient(g, wt, grad_scale, maximize)
        out[1].append(unscaled)
        if decay:
            gw = gw + weight_decay * pw
        if has_momentum:
            buf = gw if is_first_step else momentum * _wide(momentum_buffers[i]) + (1 - dampening) * gw
            out[2].append(buf.astype(momentum_buffers[i].dtype))
            gw = gw + momentum * buf if nesterov else buf
        out[0].append((pw - jnp.asarray(lr).astype(wt) * gw).astype(p.dtype))
    old = [params, grads, momentum_buffers if has_momentum else []]
    return [_skipped(found_inf, new, prev) for new, prev in zip(out, old)]
