"""Neural-network ops: normalisation, pooling, losses, embeddings, resampling and padding.

Every op is a lowering, also backward ops whose ``output_mask`` leaves some results undefined (the
lowering returns the defined ones, :meth:`Lowering.apply`), and ops torch has no meta kernel for
(``lower(meta=...)``). Batch norm alone keeps a hand-written eager kernel: it updates its running
statistics in place.
Backward ops without a cheaper closed form are ``jax.vjp`` of the forward lowering.

Reduced-precision floats (bf16, f16) are computed in float32 and cast back, as CPU does.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from torch._prims_common import alert_not_deterministic

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import aten, kernel, lower
from torch_tpu.runtime.executor import Program, execute
from torch_tpu.tensor import value_checks as checks
from torch_tpu.tensor.meta import cpu_meta, device_mismatch, to_meta
from torch_tpu.tensor.storage import contiguous_strides, dense_layout, is_tpu, new_strided, new_tensor, read, write

_LOW = (jnp.bfloat16, jnp.float16)


def _acc(x):
    """``x`` in the precision CPU accumulates it in (float32 for bf16/f16)."""
    return x.astype(jnp.float32) if x is not None and x.dtype in _LOW else x


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


# ------------------------------------------------------------------------ hand-written kernels
_PROGRAMS: dict[tuple, Program] = {}


def run_jax(name: str, fn: Callable, static: dict, dynamic: dict, out_dtypes: Sequence[Any]) -> tuple:
    """Runs ``fn(**static, **dynamic)`` as a cached jitted program; results cast to ``out_dtypes``.

    ``dynamic`` holds tpu tensors (read as jax arrays) and Python floats (runtime values).
    """
    frozen = tuple(sorted((k, _freeze(v)) for k, v in static.items()))
    dyn_names = tuple(dynamic)
    jdts = tuple(None if d is None else _dtypes.to_jax(d) for d in out_dtypes)
    key = (name, id(fn), frozen, dyn_names, jdts)
    prog = _PROGRAMS.get(key)
    if prog is None:

        def program(*vals):
            res = fn(**static, **dict(zip(dyn_names, vals)))
            res = res if isinstance(res, (tuple, list)) else (res,)
            return tuple(r if d is None else jnp.asarray(r).astype(d) for r, d in zip(res, jdts))

        prog = _PROGRAMS[key] = Program(f"{name}({', '.join(f'{k}={v!r}' for k, v in frozen)})", program)
    vals = []
    for v in dynamic.values():
        if isinstance(v, torch.Tensor):
            if not is_tpu(v):
                raise device_mismatch(name, v.device)
            vals.append(read(v))
        else:
            vals.append(v)
    return execute(prog, *vals)


def _bind(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _wrap(value: Any, dtype: torch.dtype) -> torch.Tensor:
    return new_tensor(tuple(value.shape), dtype, value)


def _reduce(loss, reduction: int):
    """torch's Reduction enum: 0 none, 1 mean, 2 sum."""
    if reduction == 1:
        return loss.mean()
    if reduction == 2:
        return loss.sum()
    return loss


def _norm_factor(x, reduction: int):
    return 1.0 / max(x.size, 1) if reduction == 1 else 1.0


# =================================================================================== batch norm
def _channel_shape(x) -> tuple[int, ...]:
    return (1, x.shape[1]) + (1,) * (x.ndim - 2)


def _bn_axes(x) -> tuple[int, ...]:
    return (0,) + tuple(range(2, x.ndim))


def batch_norm_math(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(out, save_mean, save_invstd, new_running_mean, new_running_var), as CPU computes them.

    In training the batch statistics normalise and the running ones are blended with the batch
    mean and *unbiased* variance; in eval the running statistics normalise.
    """
    x = _acc(input)
    shape, axes = _channel_shape(x), _bn_axes(x)
    if training:
        mean = x.mean(axes)
        var = jnp.square(x - mean.reshape(shape)).mean(axes)
        invstd = lax.rsqrt(var + eps)
        n = x.size // max(x.shape[1], 1)
        new_rm = new_rv = None
        if running_mean is not None:
            new_rm = (1 - momentum) * running_mean + momentum * mean
        if running_var is not None:
            new_rv = (1 - momentum) * running_var + momentum * var * (n / max(n - 1, 1))
    else:
        mean, invstd = _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)
        new_rm, new_rv = running_mean, running_var
    out = (x - mean.reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        out = out * _acc(weight).reshape(shape)
    if bias is not None:
        out = out + _acc(bias).reshape(shape)
    if not training:
        mean = invstd = jnp.zeros((0,), x.dtype)  # CPU saves nothing in eval mode
    return out, mean, invstd, new_rm, new_rv


_FUNCTIONAL_BN = (aten._native_batch_norm_legit_functional.default, aten._batch_norm_with_update_functional.default)


def _batch_norm_kernel(op: torch._ops.OpOverload, fixed_training: bool | None, reserve: bool) -> Callable:
    """A kernel for one batch-norm entry point: runs the math and writes running stats in place."""

    def run(*args: Any, **kwargs: Any) -> Any:
        metas = op(*to_meta(args), **{k: to_meta(v) for k, v in kwargs.items()})
        b = _bind(op, args, kwargs)
        training = b.get("training", fixed_training)
        rm, rv = b.get("running_mean"), b.get("running_var")
        dyn = {
            "input": b["input"], "weight": b.get("weight"), "bias": b.get("bias"),
            "running_mean": rm, "running_var": rv,
            "momentum": float(b["momentum"]), "eps": float(b["eps"]),
        }
        dyn = {k: v for k, v in dyn.items() if v is not None}
        dtypes = [metas[0].dtype, metas[1].dtype, metas[2].dtype]
        dtypes += [None if rm is None else rm.dtype, None if rv is None else rv.dtype]
        # CPU lays the result out as the input (channels_last stays so), as torch's meta kernel says
        shape, stride = tuple(metas[0].shape), tuple(metas[0].stride())
        storage_shape = dense_layout(shape, stride) if stride != contiguous_strides(shape) else None
        perm = None if storage_shape is None else tuple(sorted(range(len(shape)), key=lambda d: -stride[d]))
        out, mean, invstd, new_rm, new_rv = run_jax(
            "batch_norm", _bn_program, {"training": training, "perm": perm}, dyn, dtypes
        )
        functional = op in _FUNCTIONAL_BN
        if training and not functional:
            if rm is not None:
                write(rm, new_rm)
            if rv is not None:
                write(rv, new_rv)
        first = _wrap(out, dtypes[0]) if perm is None else new_strided(shape, stride, storage_shape, dtypes[0], out)
        res = [first, _wrap(mean, dtypes[1]), _wrap(invstd, dtypes[2])]
        if reserve:
            res.append(new_tensor((0,), torch.uint8, jnp.zeros((0,), jnp.uint8)))
        if functional:
            res += [_wrap(new_rm, dtypes[3]), _wrap(new_rv, dtypes[4])]
        return tuple(res)

    return run


def _bn_program(training, perm, input, momentum, eps, weight=None, bias=None, running_mean=None, running_var=None):
    out, mean, invstd, new_rm, new_rv = batch_norm_math(
        input, weight, bias, running_mean, running_var, training, momentum, eps
    )
    if perm is not None:  # stored in the result's physical order (channels_last)
        out = jnp.transpose(out, perm)
    return out, mean, invstd, new_rm, new_rv


for _op, _training, _reserve in (
    (aten.native_batch_norm.default, None, False),
    (aten._native_batch_norm_legit.default, None, False),
    (aten._native_batch_norm_legit.no_stats, None, False),
    (aten._native_batch_norm_legit_no_training.default, False, False),
    (aten._native_batch_norm_legit_functional.default, None, False),
    (aten._batch_norm_with_update.default, True, True),
    (aten._batch_norm_with_update_functional.default, True, True),
    (aten._batch_norm_no_update.default, False, True),
):
    kernel(_op, fusable=True, how="kernel (batch norm)")(_batch_norm_kernel(_op, _training, _reserve))


# In a functional graph (torch.compile) the same ops return the new running statistics instead of
# writing them. In eval mode CPU saves no statistics (shape (0,)) where torch's meta kernel, which
# traces the graph, says (C,): ``own_shapes`` keeps CPU's. Nothing in the graph reads them then.
@lower(aten._native_batch_norm_legit_functional.default, graph_only=True, own_shapes=True)
def batch_norm_functional(input, weight, bias, running_mean, running_var, training, momentum, eps):
    return batch_norm_math(input, weight, bias, running_mean, running_var, training, momentum, eps)


@lower(aten._native_batch_norm_legit_no_training.default, graph_only=True, own_shapes=True)
def batch_norm_eval(input, weight, bias, running_mean, running_var, momentum, eps):
    return batch_norm_math(input, weight, bias, running_mean, running_var, False, momentum, eps)[:3]


@lower(aten._batch_norm_no_update.default, graph_only=True, own_shapes=True)
def batch_norm_no_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """(out, save_mean, save_invstd, reserve): eval mode, nothing saved, as on CPU."""
    out, mean, invstd, _, _ = batch_norm_math(input, weight, bias, running_mean, running_var, False, momentum, eps)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8)


@lower(aten._batch_norm_with_update_functional.default, graph_only=True)
def batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """(out, save_mean, save_invstd, reserve, new running mean, new running var)."""
    out, mean, invstd, rm, rv = batch_norm_math(input, weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, invstd, jnp.zeros((0,), jnp.uint8), rm, rv


@lower(aten._native_batch_norm_legit.no_stats, graph_only=True)
def batch_norm_no_stats(input, weight, bias, training, momentum, eps):
    return batch_norm_math(input, weight, bias, None, None, True, momentum, eps)[:3]


def _bn_backward(grad_out, input, weight, save_mean, save_invstd, running_mean, running_var, train, eps, output_mask):
    x, g = _acc(input), _acc(grad_out)
    shape, axes = _channel_shape(x), _bn_axes(x)
    if train:
        mean, invstd = _acc(save_mean), _acc(save_invstd)
    else:
        mean, invstd = _acc(running_mean), lax.rsqrt(_acc(running_var) + eps)
    w = jnp.ones_like(invstd) if weight is None else _acc(weight)
    xhat = (x - mean.reshape(shape)) * invstd.reshape(shape)
    gb = g.sum(axes)
    gw = (g * xhat).sum(axes)
    if train:
        n = x.size // max(x.shape[1], 1)
        gx = (w * invstd).reshape(shape) * (g - (gb / n).reshape(shape) - xhat * (gw / n).reshape(shape))
    else:
        gx = g * (w * invstd).reshape(shape)
    return tuple(r for r, m in zip((gx, gw, gb), output_mask) if m)


def _native_bn_backward(
    grad_out, input, output_mask, train, eps, weight=None, running_mean=None, running_var=None, save_mean=None,
    save_invstd=None,
):
    return _bn_backward(grad_out, input, weight, save_mean, save_invstd, running_mean, running_var, train, eps,
                        output_mask)


def _bn_backward_update(
    grad_out, input, weight, output_mask, update, eps, reserve, running_mean=None, running_var=None, save_mean=None,
    save_var=None,
):
    return _bn_backward(grad_out, input, weight, save_mean, save_var, running_mean, running_var, update, eps,
                        output_mask)


lower(aten.native_batch_norm_backward.default, by_name=True)(_native_bn_backward)
lower(aten.batch_norm_backward.default, by_name=True)(_bn_backward_update)


# =================================================================================== layer norm
@lower(aten.native_layer_norm.default)
def native_layer_norm(input, normalized_shape, weight, bias, eps):
    x = _acc(input)
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = x.mean(axes, keepdims=True)
    rstd = lax.rsqrt(jnp.square(x - mean).mean(axes, keepdims=True) + eps)
    out = (x - mean) * rstd
    if weight is not None:
        out = out * _acc(weight)
    if bias is not None:
        out = out + _acc(bias)
    return out, mean, rstd


def _layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, output_mask, weight=None, bias=None):
    x, g = _acc(input), _acc(grad_out)
    k = len(normalized_shape)
    axes = tuple(range(x.ndim - k, x.ndim))
    lead = tuple(range(x.ndim - k))
    xhat = (x - _acc(mean)) * _acc(rstd)
    gw = g if weight is None else g * _acc(weight)
    gx = _acc(rstd) * (gw - gw.mean(axes, keepdims=True) - xhat * (gw * xhat).mean(axes, keepdims=True))
    res = [gx, (g * xhat).sum(lead), g.sum(lead)]
    return tuple(r for r, m in zip(res, output_mask) if m)


lower(aten.native_layer_norm_backward.default, by_name=True)(_layer_norm_backward)


# ================================================================================== weight norm
@lower(aten._weight_norm_interface_backward.default)
def weight_norm_interface_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """The gradients of ``w = g * v / ||v||`` (the norm over every dim but ``dim``, as the forward
    saved it): ``grad_g = sum(grad_w * v) / ||v||`` and ``grad_v = g / ||v|| * (grad_w - v * grad_g
    / ||v||)``, in float32 for half inputs as CPU computes them. The forward decomposes through
    torch's own rule; this backward has none, so it ran on CPU."""
    gw, v, g, n = _acc(grad_w), _acc(saved_v), _acc(saved_g), _acc(saved_norms)
    axes = tuple(i for i in range(v.ndim) if i != dim)
    grad_g = jnp.sum(gw * v, axis=axes, keepdims=True).reshape(g.shape) / n
    grad_v = (g / n) * (gw - v * (grad_g / n))
    return grad_v.astype(saved_v.dtype), grad_g.astype(saved_g.dtype)


# =================================================================================== group norm
@lower(aten.native_group_norm.default)
def native_group_norm(input, weight, bias, N, C, HxW, group, eps):
    x = _acc(input).reshape(N, group, -1)
    mean = x.mean(-1)
    rstd = lax.rsqrt(jnp.square(x - mean[..., None]).mean(-1) + eps)
    out = ((x - mean[..., None]) * rstd[..., None]).reshape(N, C, -1)
    if weight is not None:
        out = out * _acc(weight)[:, None]
    if bias is not None:
        out = out + _acc(bias)[:, None]
    return out.reshape(input.shape), mean, rstd


def _group_norm_backward(grad_out, input, mean, rstd, N, C, HxW, group, output_mask, weight=None):
    x = _acc(input).reshape(N, group, C // max(group, 1), HxW)
    g = _acc(grad_out).reshape(x.shape)
    xhat = (x - _acc(mean)[..., None, None]) * _acc(rstd)[..., None, None]
    gw = g if weight is None else g * _acc(weight).reshape(1, group, -1, 1)
    red = (2, 3)
    gx = _acc(rstd)[..., None, None] * (
        gw - gw.mean(red, keepdims=True) - xhat * (gw * xhat).mean(red, keepdims=True)
    )
    dweight = (g * xhat).sum((0, 3)).reshape(C)
    dbias = g.sum((0, 3)).reshape(C)
    res = [gx.reshape(input.shape), dweight, dbias]
    return tuple(r for r, m in zip(res, output_mask) if m)


lower(aten.native_group_norm_backward.default, by_name=True)(_group_norm_backward)


# ====================================================================================== pooling
def _expand(v: Sequence[int], n: int, default: Sequence[int] | None = None) -> list[int]:
    v = list(v) if v is not None else []
    if not v and default is not None:
        return list(default)
    return v * n if len(v) == 1 else v


def pool_out_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """torch's pooling_output_shape: ceil mode may not start a window in the right padding."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool_params(x, n, kernel_size, stride, padding, dilation, ceil_mode):
    k = _expand(kernel_size, n)
    s = _expand(stride, n, k)
    p = _expand(padding, n)
    d = _expand(dilation, n) if dilation is not None else [1] * n
    sizes = x.shape[x.ndim - n:]
    out = [pool_out_size(L, kk, ss, pp, dd, ceil_mode) for L, kk, ss, pp, dd in zip(sizes, k, s, p, d)]
    return k, s, p, d, out


def _patches(x, n, k, s, p, d, out, fill):
    """The pooling windows of the last ``n`` dims: ``(..., *out, prod(k))``, padding read as ``fill``,
    and each window element's flat index into the input's last ``n`` dims (or -1 in the padding)."""
    lead = x.ndim - n
    sizes = x.shape[lead:]
    hi = [max(0, (o - 1) * ss + dd * (kk - 1) + 1 - L - pp) for o, ss, dd, kk, L, pp in zip(out, s, d, k, sizes, p)]
    xp = lax.pad(x, jnp.asarray(fill, x.dtype), [(0, 0, 0)] * lead + [(pp, h, 0) for pp, h in zip(p, hi)])
    slices = []
    for offs in itertools.product(*[range(kk) for kk in k]):
        start = [o * dd for o, dd in zip(offs, d)]
        limit = [st + (o - 1) * ss + 1 for st, o, ss in zip(start, out, s)]
        slices.append(lax.slice(xp, [0] * lead + start, list(xp.shape[:lead]) + limit, [1] * lead + list(s)))
    values = jnp.stack(slices, axis=-1)
    # flat input index of every (output position, window element), computed in the program from
    # iotas: as a host constant it was the size of the output times the window (a 16M-element
    # max_pool1d embedded a 128 MB constant, and XLA took 10 s to compile it). Unused by avg pooling,
    # whose program drops it.
    flat = jnp.zeros((1,) * n + (math.prod(k),), jnp.int64)
    valid = jnp.ones(flat.shape, bool)
    stride_in = 1
    for i in reversed(range(n)):
        o = jnp.arange(out[i], dtype=jnp.int64).reshape([-1 if j == i else 1 for j in range(n)] + [1])
        kk = np.array([offs[i] for offs in itertools.product(*[range(q) for q in k])], np.int64)
        idx = o * s[i] - p[i] + kk * d[i]
        valid = valid & (idx >= 0) & (idx < sizes[i])
        flat = flat + idx * stride_in
        stride_in *= sizes[i]
    return values, jnp.where(valid, flat, -1)


def _lowest(dtype):
    return -jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).min


def _max_pool(x, n, kernel_size, stride, padding, dilation, ceil_mode):
    k, s, p, d, out = _pool_params(x, n, kernel_size, stride, padding, dilation, ceil_mode)
    values, flat = _patches(x, n, k, s, p, d, out, _lowest(x.dtype))
    # the first maximum of each window (NaN counts as the largest), picked elementwise: a gather
    # (take_along_axis) has index arrays the size of the output, which XLA constant-folds slowly
    pick = jnp.arange(values.shape[-1]) == jnp.argmax(values, axis=-1)[..., None]
    best = jnp.max(jnp.where(pick, values, jnp.asarray(_lowest(x.dtype), values.dtype)), axis=-1)
    idx = jnp.sum(jnp.where(pick, flat, 0), axis=-1)
    return best, idx


@lower(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool(self, 2, kernel_size, stride, padding, dilation, ceil_mode)


def _unbatched_as_batched(op: Any) -> Any:
    """A meta for a 3-d pooling op that lays out an unbatched (4-D) input as CPU's kernel does: as
    the batch of one it is. torch's meta kernel asks the 4-D tensor itself for a memory format, so
    a ``channels_last_3d`` input squeezed to 4-D got a contiguous result where CPU's is
    ``channels_last_3d`` once unsqueezed (and its gradient the input's layout)."""

    def meta(*args: Any, **kwargs: Any) -> Any:
        if args[0].dim() != 4:
            return op(*args, **kwargs)
        # the batch dim's stride spans the tensor (unsqueeze's would be the channels' size)
        batched = [a.as_strided((1, *a.shape), (max(a.numel(), 1), *a.stride()))
                   if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args]
        out = op(*batched, **kwargs)
        return out.squeeze(0) if isinstance(out, torch.Tensor) else tuple(o.squeeze(0) for o in out)

    return meta


@lower(aten.max_pool3d_with_indices.default, meta=_unbatched_as_batched(aten.max_pool3d_with_indices.default))
def max_pool3d_with_indices(self, kernel_size, stride=(), padding=(0,), dilation=(1,), ceil_mode=False):
    return _max_pool(self, 3, kernel_size, stride, padding, dilation, ceil_mode)


def scatter_to_input(grad_output, input_shape, indices, n):
    """Adds each output gradient to the input element its flat spatial index names."""
    lead = input_shape[: len(input_shape) - n]
    rows = math.prod(lead)
    g = grad_output.reshape(rows, -1)
    idx = indices.reshape(rows, -1)
    out = jnp.zeros((rows, math.prod(input_shape[len(input_shape) - n:])), g.dtype)
    out = out.at[jnp.arange(rows)[:, None], idx].add(g, mode="drop")
    return out.reshape(input_shape)


@lower(aten.max_pool2d_with_indices_backward.default)
def max_pool2d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return scatter_to_input(_acc(grad_output), self.shape, indices, 2)


@lower(aten.max_pool3d_with_indices_backward.default,
       meta=_unbatched_as_batched(aten.max_pool3d_with_indices_backward.default))
def max_pool3d_with_indices_backward(grad_output, self, kernel_size, stride, padding, dilation, ceil_mode, indices):
    return scatter_to_input(_acc(grad_output), self.shape, indices, 3)


def _avg_pool(x, n, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
    k, s, p, _, out = _pool_params(x, n, kernel_size, stride, padding, None, ceil_mode)
    xa = _acc(x)
    lead = x.ndim - n
    sizes = x.shape[lead:]
    values, _ = _patches(xa, n, k, s, p, [1] * n, out, 0)
    summed = values.sum(-1)
    if divisor_override:
        return summed / divisor_override
    div = np.ones((), np.int64)
    for L, o, kk, ss, pp in zip(sizes, out, k, s, p):
        start = np.arange(o) * ss - pp
        end = np.minimum(start + kk, L + pp)
        count = (end - start) if count_include_pad else (np.minimum(end, L) - np.maximum(start, 0))
        div = div[..., None] * count
    return summed / jnp.asarray(div, xa.dtype)


@lower(aten.avg_pool2d.default)
def avg_pool2d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, 2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


@lower(aten.avg_pool3d.default)
def avg_pool3d(self, kernel_size, stride=(), padding=(0,), ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    return _avg_pool(self, 3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)


def _avg_pool_backward(n):
    def backward(grad_output, self, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override):
        fwd = functools.partial(
            _avg_pool, n=n, kernel_size=kernel_size, stride=stride, padding=padding, ceil_mode=ceil_mode,
            count_include_pad=count_include_pad, divisor_override=divisor_override,
        )
        _, vjp = jax.vjp(lambda x: fwd(x), _acc(self))
        return vjp(_acc(grad_output))[0]

    return backward


lower(aten.avg_pool2d_backward.default)(_avg_pool_backward(2))
lower(aten.avg_pool3d_backward.default)(_avg_pool_backward(3))


def _adaptive_index(L: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """Window (O, K) of input positions for adaptive pooling, and which of them are real."""
    start = (np.arange(out) * L) // out
    end = -((-(np.arange(out) + 1) * L) // out)
    K = int((end - start).max()) if out else 1
    idx = start[:, None] + np.arange(K)[None, :]
    valid = idx < end[:, None]
    return np.minimum(idx, L - 1), valid


def _adaptive_windows(x, output_size, fill):
    """Adaptive windows of the last ``len(output_size)`` dims: ``(..., *out, K)`` values (invalid
    positions read as ``fill``) and the flat input index of each."""
    n = len(output_size)
    lead = x.ndim - n
    sizes = x.shape[lead:]
    flat = np.zeros((), np.int64)
    valid_all = np.ones((), bool)
    stride_in = math.prod(sizes)
    for i, (L, size) in enumerate(zip(sizes, output_size)):
        idx, valid = _adaptive_index(L, size)
        x = jnp.take(x, jnp.asarray(idx.reshape(-1)), axis=lead + 2 * i).reshape(
            x.shape[: lead + 2 * i] + idx.shape + x.shape[lead + 2 * i + 1:]
        )
        stride_in //= L
        flat = flat[..., None, None] + idx * stride_in
        valid_all = valid_all[..., None, None] & valid
    # x: (..., O1, K1, O2, K2, ...) -> (..., O1, O2, ..., K1*K2*...)
    perm = list(range(lead)) + [lead + 2 * i for i in range(n)] + [lead + 2 * i + 1 for i in range(n)]
    x = x.transpose(perm)
    K = math.prod(flat.shape[1::2])
    x = x.reshape(x.shape[: lead + n] + (K,))
    fperm = [2 * i for i in range(n)] + [2 * i + 1 for i in range(n)]
    flat = flat.transpose(fperm).reshape(tuple(output_size) + (K,))
    valid_all = valid_all.transpose(fperm).reshape(flat.shape)
    return jnp.where(valid_all, x, jnp.asarray(fill, x.dtype)), flat, valid_all


def _adaptive_avg(self, output_size):
    x = _acc(self)
    values, _, valid = _adaptive_windows(x, list(output_size), 0)
    return values.sum(-1) / jnp.asarray(valid.sum(-1), x.dtype)


_CPU_DTYPE_NAMES = {torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
                    torch.int64: "Long", torch.bool: "Bool"}


def _floating_meta(op: torch._ops.OpOverload, kernel_name: str) -> Callable:
    """torch's meta kernel of an adaptive pooling accepts integer inputs, CPU's kernel does not:
    this stand-in raises CPU's NotImplementedError first (a RuntimeError subclass, as in torch)."""

    def meta(self, *args, **kwargs):
        if self.dtype in _CPU_DTYPE_NAMES:
            raise NotImplementedError(f'"{kernel_name}" not implemented for \'{_CPU_DTYPE_NAMES[self.dtype]}\'')
        return op(self, *args, **kwargs)

    return meta


def adaptive_avg_pool(self, output_size):
    return _adaptive_avg(self, output_size)


for _op, _name in ((aten._adaptive_avg_pool2d.default, "adaptive_avg_pool2d"),
                   (aten._adaptive_avg_pool3d.default, "adaptive_avg_pool3d_cpu")):
    lower(_op, meta=_floating_meta(_op, _name))(adaptive_avg_pool)


def _adaptive_avg_backward(n: int) -> Callable:
    def backward(grad_output, self):
        out = grad_output.shape[grad_output.ndim - n:]
        _, vjp = jax.vjp(lambda x: _adaptive_avg(x, out), _acc(self))
        return vjp(_acc(grad_output))[0]

    return backward


lower(aten._adaptive_avg_pool2d_backward.default)(_adaptive_avg_backward(2))
lower(aten._adaptive_avg_pool3d_backward.default)(_adaptive_avg_backward(3))


def _adaptive_max(self, output_size):
    values, flat, _ = _adaptive_windows(self, list(output_size), _lowest(self.dtype))
    arg = jnp.argmax(values, axis=-1)
    best = jnp.take_along_axis(values, arg[..., None], axis=-1)[..., 0]
    idx = jnp.take_along_axis(jnp.broadcast_to(jnp.asarray(flat), values.shape), arg[..., None], axis=-1)[..., 0]
    return best, idx


def adaptive_max_pool(self, output_size):
    return _adaptive_max(self, output_size)


for _op, _name in ((aten.adaptive_max_pool2d.default, "adaptive_max_pool2d"),
                   (aten.adaptive_max_pool3d.default, "adaptive_max_pool3d_cpu")):
    lower(_op, meta=_floating_meta(_op, _name))(adaptive_max_pool)


@lower(aten.adaptive_max_pool2d_backward.default)
def adaptive_max_pool2d_backward(grad_output, self, indices):
    return scatter_to_input(_acc(grad_output), self.shape, indices, 2)


@lower(aten.adaptive_max_pool3d_backward.default)
def adaptive_max_pool3d_backward(grad_output, self, indices):
    return scatter_to_input(_acc(grad_output), self.shape, indices, 3)


def _check_unpool_indices(self, indices, output_size, *rest, **kw):
    # two inputs sent to one position (indices not from max_pool): either may land, as on CPU
    alert_not_deterministic(f"max_unpooling{len(output_size)}d_forward_out")
    limit = math.prod(output_size)
    sizes = "x".join(map(str, output_size))
    checks.check_values(indices, checks.outside, (0, limit),
                        lambda v: RuntimeError(f"Found an invalid max index: {v} (output volumes are of size {sizes}"))


def _max_unpool(self, indices, output_size):
    n = len(output_size)
    lead = self.shape[: self.ndim - n]
    rows = math.prod(lead)
    out = jnp.zeros((rows, math.prod(output_size)), self.dtype)
    out = out.at[jnp.arange(rows)[:, None], indices.reshape(rows, -1)].set(self.reshape(rows, -1), mode="drop")
    return out.reshape(tuple(lead) + tuple(output_size))


@lower(aten.max_unpool2d.default, check=_check_unpool_indices)
def max_unpool2d(self, indices, output_size):
    return _max_unpool(self, indices, output_size)


@lower(aten.max_unpool3d.default, check=_check_unpool_indices)
def max_unpool3d(self, indices, output_size, stride, padding):
    return _max_unpool(self, indices, output_size)


# ============================================================================== im2col / col2im
def _im2col(x, kernel_size, dilation, padding, stride):
    batched = x.ndim == 4
    x = x if batched else x[None]
    k, d, p, s = _expand(kernel_size, 2), _expand(dilation, 2), _expand(padding, 2), _expand(stride, 2)
    out = [pool_out_size(L, kk, ss, pp, dd, False) for L, kk, ss, pp, dd in zip(x.shape[2:], k, s, p, d)]
    values, _ = _patches(x, 2, k, s, p, d, out, 0)  # (N, C, oh, ow, K)
    N, C = x.shape[:2]
    cols = values.transpose(0, 1, 4, 2, 3).reshape(N, C * math.prod(k), out[0] * out[1])
    return cols if batched else cols[0]


@lower(aten.im2col.default)
def im2col(self, kernel_size, dilation, padding, stride):
    return _im2col(self, kernel_size, dilation, padding, stride)


@lower(aten.col2im.default)
def col2im(self, output_size, kernel_size, dilation, padding, stride):
    batched = self.ndim == 3
    cols = self if batched else self[None]
    k = _expand(kernel_size, 2)
    shape = (cols.shape[0], cols.shape[1] // math.prod(k)) + tuple(_expand(output_size, 2))
    zeros = jnp.zeros(shape, cols.dtype)
    _, vjp = jax.vjp(lambda x: _im2col(x, kernel_size, dilation, padding, stride), zeros)
    out = vjp(cols)[0]
    return out if batched else out[0]


# ======================================================================================= losses
def _check_nll_target(self, target, weight=None, reduction=1, ignore_index=-100, *rest, **kw):
    """CPU reads the target values: an out-of-range class is an IndexError."""
    C = self.shape[1] if self.dim() >= 2 else self.shape[0]
    checks.check_values(target, checks.outside_unless, (0, C, ignore_index),
                        lambda v: IndexError(f"Target {v} is out of bounds."))


def _nll_parts(self, target, weight, ignore_index):
    """(picked log-prob, per-element weight), classes on dim 1 (or 0 for an unbatched input)."""
    x = _acc(self)
    cls = 1 if x.ndim >= 2 else 0
    x = jnp.moveaxis(x, cls, -1)
    ignored = target == ignore_index
    safe = jnp.where(ignored, 0, target)
    picked = jnp.take_along_axis(x, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    w = jnp.ones(safe.shape, x.dtype) if weight is None else _acc(weight)[safe]
    return picked, jnp.where(ignored, 0, w)


def _nll_forward(self, target, weight, reduction, ignore_index):
    picked, w = _nll_parts(self, target, weight, ignore_index)
    loss = -picked * w
    if reduction == 0:
        return loss, jnp.zeros((), loss.dtype)
    total = w.sum()
    return (loss.sum() / total if reduction == 1 else loss.sum()), total


def _nll_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight):
    cls = 1 if self.ndim >= 2 else 0
    _, w = _nll_parts(self, target, weight, ignore_index)
    g = _acc(grad_output)
    if reduction == 1:
        g = g / _acc(total_weight)
    C = self.shape[cls]
    # 32-bit class ids (the forward checked them against C): a 64-bit compare of every logit's
    # position, which XLA:TPU emulates, was 4% of a small GPT step's bytes
    cls_id = jnp.where(target == ignore_index, -1, target).astype(jnp.int32)
    onehot = jnp.arange(C, dtype=jnp.int32) == cls_id[..., None]
    grad = jnp.where(onehot, (-w * g)[..., None], 0)
    return jnp.moveaxis(grad, -1, cls)


# CPU's own kernel on zero-filled stand-ins gives the shape checks CPU makes, as RuntimeErrors with
# CPU's words (torch's Python meta kernels assert instead), and accepts a uint8 target as CPU does.
for _fwd, _bwd in ((aten.nll_loss_forward, aten.nll_loss_backward),
                   (aten.nll_loss2d_forward, aten.nll_loss2d_backward)):
    lower(_fwd.default, check=_check_nll_target, meta=cpu_meta(_fwd))(_nll_forward)
    lower(_bwd.default, meta=cpu_meta(_bwd))(_nll_backward)


@lower(aten.mse_loss.default)
def mse_loss(self, target, reduction=1):
    return _reduce(jnp.square(_acc(self) - _acc(target)), reduction)


@lower(aten.mse_loss_backward.default)
def mse_loss_backward(grad_output, self, target, reduction):
    d = _acc(self) - _acc(target)
    return 2 * d * _acc(grad_output) * _norm_factor(d, reduction)


@lower(aten.smooth_l1_loss.default)
def smooth_l1_loss(self, target, reduction=1, beta=1.0):
    z = jnp.abs(_acc(self) - _acc(target))
    return _reduce(jnp.where(z < beta, 0.5 * z * z / jnp.where(beta == 0, 1, beta), z - 0.5 * beta), reduction)


@lower(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward(grad_output, self, target, reduction, beta):
    d = _acc(self) - _acc(target)
    g = _acc(grad_output) * _norm_factor(d, reduction)
    inner = d / jnp.where(beta == 0, 1, beta)
    return jnp.where(d < -beta, -g, jnp.where(d > beta, g, inner * g))


@lower(aten.huber_loss.default)
def huber_loss(self, target, reduction=1, delta=1.0):
    z = jnp.abs(_acc(self) - _acc(target))
    return _reduce(jnp.where(z < delta, 0.5 * z * z, delta * (z - 0.5 * delta)), reduction)


@lower(aten.huber_loss_backward.default)
def huber_loss_backward(grad_output, self, target, reduction, delta):
    d = _acc(self) - _acc(target)
    g = _acc(grad_output) * _norm_factor(d, reduction)
    return jnp.where(d < -delta, -g * delta, jnp.where(d > delta, g * delta, d * g))


def _check_bce_input(self, *rest, **kw):
    checks.check_values(self, checks.outside_closed, (0, 1),
                        lambda v: RuntimeError("all elements of input should be between 0 and 1"))


@lower(aten.binary_cross_entropy.default, check=_check_bce_input)
def binary_cross_entropy(self, target, weight=None, reduction=1):
    x, t = _acc(self), _acc(target)
    loss = -(t * jnp.maximum(jnp.log(x), -100) + (1 - t) * jnp.maximum(jnp.log1p(-x), -100))
    if weight is not None:
        loss = loss * _acc(weight)
    return _reduce(loss, reduction)


@lower(aten.binary_cross_entropy_backward.default)
def binary_cross_entropy_backward(grad_output, self, target, weight=None, reduction=1):
    x, t = _acc(self), _acc(target)
    g = _acc(grad_output) * _norm_factor(x, reduction) * (x - t) / jnp.maximum((1 - x) * x, 1e-12)
    return g if weight is None else g * _acc(weight)


@lower(aten.binary_cross_entropy_with_logits.default)
def binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    x, t = _acc(self), _acc(target)
    softplus_neg = jnp.log1p(jnp.exp(-jnp.abs(x))) + jnp.maximum(-x, 0)  # log(1 + exp(-x)), stably
    if pos_weight is not None:
        loss = (1 - t) * x + ((_acc(pos_weight) - 1) * t + 1) * softplus_neg
    else:
        loss = (1 - t) * x + softplus_neg
    if weight is not None:
        loss = loss * _acc(weight)
    return _reduce(loss, reduction)


@lower(aten.soft_margin_loss.default)
def soft_margin_loss(self, target, reduction=1):
    return _reduce(jnp.log1p(jnp.exp(-_acc(target) * _acc(self))), reduction)


@lower(aten.soft_margin_loss_backward.default)
def soft_margin_loss_backward(grad_output, self, target, reduction):
    x, t = _acc(self), _acc(target)
    z = jnp.exp(-t * x)
    return -t * z / (1 + z) * _acc(grad_output) * _norm_factor(x, reduction)


def _check_multilabel_target(self, target, *rest, **kw):
    C = self.shape[-1] if self.dim() else 1
    checks.check_values(target, checks.outside, (-1, C), lambda v: RuntimeError(
        f"multilabel_margin_loss: target values must be in [-1, {C}), got an out-of-range value"))


def _multilabel_margin(self, target, reduction):
    x = _acc(self)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    t2 = target.reshape(x2.shape)
    C = x2.shape[-1]
    # a target list ends at its first -1
    live = jnp.cumprod(t2 != -1, axis=-1).astype(bool)
    safe = jnp.where(live, t2, 0)
    is_target = jnp.zeros(x2.shape, x.dtype).at[jnp.arange(x2.shape[0])[:, None], safe].max(live.astype(x.dtype))
    xt = jnp.take_along_axis(x2, safe, axis=-1)  # (N, K)
    z = 1 - xt[..., None] + x2[:, None, :]  # (N, K, C)
    keep = live[..., None] & (is_target[:, None, :] == 0)
    loss = jnp.where(keep & (z > 0), z, 0).sum((1, 2)) / C
    loss = loss.reshape(self.shape[:-1]) if self.ndim > 1 else loss.reshape(())
    return _reduce(loss, reduction), is_target.reshape(self.shape)


@lower(aten.multilabel_margin_loss_forward.default, check=_check_multilabel_target)
def multilabel_margin_loss_forward(self, target, reduction):
    return _multilabel_margin(self, target, reduction)


def _like_self(grad_output, self, *args, **kwargs):
    """The meta result of a loss backward that CPU alone implements: a gradient shaped as ``self``."""
    if grad_output.device != self.device or grad_output.dtype != self.dtype:
        raise RuntimeError(f"expected grad_output of dtype {self.dtype}, got {grad_output.dtype}")
    return torch.empty_like(self)


def _multilabel_margin_backward(grad_output, self, target, reduction, is_target):
    _, vjp = jax.vjp(lambda x: _multilabel_margin(x, target, reduction)[0], _acc(self))
    return vjp(_acc(grad_output))[0]


lower(aten.multilabel_margin_loss_backward.default, by_name=True, meta=_like_self)(_multilabel_margin_backward)


def _check_multi_margin(self, target, *rest, **kw):
    C = self.shape[-1] if self.dim() else 1
    checks.check_values(target, checks.outside, (0, C), lambda v: RuntimeError("target out of range"))


def _multi_margin(self, target, p, margin, weight, reduction):
    x = _acc(self)
    x2 = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    t = target.reshape(-1)
    C = x2.shape[-1]
    xt = jnp.take_along_axis(x2, t[:, None], axis=-1)
    z = margin - xt + x2
    z = jnp.where((z > 0) & (jnp.arange(C) != t[:, None]), z, 0)
    if p == 2:
        z = z * z
    if weight is not None:
        z = z * _acc(weight)[t][:, None]
    loss = z.sum(-1) / C
    loss = loss.reshape(target.shape)
    return _reduce(loss, reduction)


@lower(aten.multi_margin_loss.default, static_scalars=True, check=_check_multi_margin)
def multi_margin_loss(self, target, p=1, margin=1, weight=None, reduction=1):
    return _multi_margin(self, target, p, margin, weight, reduction)


def _multi_margin_backward(grad_output, self, target, p, margin, weight=None, reduction=1):
    _, vjp = jax.vjp(lambda x: _multi_margin(x, target, p, margin, weight, reduction), _acc(self))
    return vjp(_acc(grad_output))[0]


lower(aten.multi_margin_loss_backward.default, by_name=True, meta=_like_self)(_multi_margin_backward)


# =================================================================================== embeddings
def _check_embedding(weight, indices, *rest, **kw):
    if weight.dim() != 2:  # CPU's RuntimeError; torch's Python meta kernel asserts
        raise RuntimeError(f"'weight' must be 2-D, got {weight.dim()}-D")
    checks.check_values(indices, checks.outside, (0, weight.shape[0]),
                        lambda v: IndexError("index out of range in self"))


@lower(aten.embedding.default, check=_check_embedding, runtime_numbers=("padding_idx",))
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return jnp.take(weight, indices, axis=0)


@lower(aten.embedding_dense_backward.default, runtime_numbers=("padding_idx",))
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq):
    idx = indices.reshape(-1)
    g = _acc(grad_output).reshape(idx.shape[0], -1)
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        g = g / counts[idx][:, None]
    g = jnp.where((idx == padding_idx)[:, None], 0, g)  # -1 (none) matches no index
    return jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(g)


def _bags(indices, offsets, include_last_offset):
    """offset2bag (bag of every index) and the number of bags."""
    n_bags = offsets.shape[0] - 1 if include_last_offset else offsets.shape[0]
    pos = jnp.arange(indices.shape[0])
    bag = jnp.searchsorted(offsets, pos, side="right") - 1
    return jnp.clip(bag, 0, max(n_bags - 1, 0)), n_bags


def _bag_round(acc, dtype):
    """A bag's float32 sum in the weight's half-precision dtype, rounded as CPU's kernel (fbgemm)
    rounds it: bfloat16 ties away from zero (it adds half a unit to the bits and cuts them), float16
    to nearest even. Rounding ties to even instead differed from CPU in the last bit of about one
    bag sum in twenty; CPU's ``mean`` divides this rounded sum, as here."""
    if dtype == jnp.bfloat16:
        bits = jax.lax.bitcast_convert_type(acc.astype(jnp.float32), jnp.uint32)
        cut = jax.lax.bitcast_convert_type((bits + 0x8000) & 0xFFFF0000, jnp.float32)
        return jnp.where(jnp.isnan(acc), acc, cut).astype(jnp.bfloat16)
    return acc.astype(dtype)


def _embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                   per_sample_weights=None, include_last_offset=False, padding_idx=-1):
    if indices.ndim == 2:  # fixed-size bags
        n, k = indices.shape
        indices, offsets = indices.reshape(-1), jnp.arange(n) * k
    offset2bag, n_bags = _bags(indices, offsets, include_last_offset)
    # as on CPU, indices past the last offset belong to the last bag, even with include_last_offset
    # padding_idx is a runtime input (a loop over padding values compiles once); -1, none, matches
    # no index, which the check keeps within [0, num_weights)
    keep = indices != padding_idx
    w = _acc(weight)
    rows = jnp.take(w, indices, axis=0)
    if per_sample_weights is not None:
        rows = rows * _acc(per_sample_weights)[:, None]
    # the meta kernel sizes bag_size by the offsets (one more than the bags with include_last_offset)
    bag_size = jnp.zeros((offsets.shape[0],), jnp.int64).at[offset2bag].add(keep.astype(jnp.int64))
    if mode == 2:
        vals = jnp.where(keep[:, None], rows, -jnp.inf)
        best = jnp.full((n_bags, w.shape[1]), -jnp.inf, w.dtype).at[offset2bag].max(vals)
        pos = jnp.arange(indices.shape[0])[:, None]
        first = jnp.full(best.shape, indices.shape[0], jnp.int64).at[offset2bag].min(
            jnp.where(vals == best[offset2bag], pos, indices.shape[0])
        )
        nonempty = bag_size[:n_bags, None] > 0
        if indices.shape[0] == 0:  # no index at all: every bag is empty (a gather from nothing fails)
            max_indices = jnp.zeros(best.shape, jnp.int64)
        else:
            max_indices = jnp.where(nonempty, indices[jnp.minimum(first, indices.shape[0] - 1)], 0)
        out = jnp.where(nonempty, best, 0)
    else:
        summed = keep
        if include_last_offset:  # CPU sums only up to the last offset (but still counts the rest for mean)
            summed = keep & (jnp.arange(indices.shape[0]) < offsets[-1])
        out = jnp.zeros((n_bags, w.shape[1]), w.dtype).at[offset2bag].add(jnp.where(summed[:, None], rows, 0))
        out = _bag_round(out, weight.dtype)
        if mode == 1:
            out = (out.astype(w.dtype) / jnp.maximum(bag_size[:n_bags], 1)[:, None].astype(w.dtype)).astype(
                weight.dtype)
        max_indices = jnp.zeros((0,), jnp.int64)
    return out, offset2bag, bag_size, max_indices


def _check_bag(weight, indices, offsets, *rest, **kw):
    """CPU's RuntimeErrors of embedding_bag (its kernel's, not embedding's IndexError): an index
    out of range, and 1-d offsets that don't start at 0 or point past the input; the shapes, which
    torch's meta kernel does not check."""
    for t, name, dims in ((indices, "input", (1, 2)), (offsets, "offsets", (1,)), (weight, "weight", (2,))):
        if t.dim() not in dims:
            what = "a 1D or 2D Tensor" if name == "input" else f"a {dims[0]}D Tensor"
            raise RuntimeError(f"{name} has to be {what}, but got Tensor of dimension {t.dim()}")
    n = weight.shape[0]
    padding_idx = kw.get("padding_idx", rest[5] if len(rest) > 5 else None)
    if padding_idx is not None and padding_idx >= 0:  # CPU's padded path words it otherwise
        error = lambda v, at: RuntimeError(
            f"embedding_bag: Expected idx >= 0 && idx < num_embeddings but found idx to be {v}")
    else:
        error = lambda v, at: RuntimeError(
            f"Index {at} of input takes value {v} which is not in the valid range [0, {n})")
    checks.check_values(indices, checks.outside, (0, n), error, position=True)
    if indices.dim() != 1 or offsets.numel() == 0:
        return  # 2-d input: fixed-size bags, no offsets to check
    length = indices.shape[0]
    checks.check_values(offsets[:1], checks.outside, (0, 1), lambda v: RuntimeError(
        f"offsets[0] has to be 0, i.e., the first sequence in the mini-batch has to start from position 0. "
        f"However, got {v}"))
    checks.check_values(offsets[-1:], checks.outside_closed, (0, length), lambda v: RuntimeError(
        f"offsets[-1] can not be greater than input's length {length} but got offsets[-1] of {v}"))


lower(aten._embedding_bag.default, aten._embedding_bag_forward_only.default, check=_check_bag,
      runtime_numbers=("padding_idx",))(_embedding_bag)


def _bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights, scale_grad_by_freq,
                        mode, per_sample_weights, padding_idx=-1):
    idx = indices.reshape(-1)
    g = _acc(grad)
    if mode == 2:
        mi = maximum_indices.reshape(-1)
        cols = jnp.tile(jnp.arange(g.shape[1]), g.shape[0])
        ok = jnp.repeat(bag_size[: g.shape[0]] > 0, g.shape[1])
        out = jnp.zeros((num_weights, g.shape[1]), g.dtype)
        return out.at[jnp.where(ok, mi, num_weights), cols].add(g.reshape(-1), mode="drop")
    rows = g[offset2bag]
    if mode == 1:
        rows = rows / jnp.maximum(bag_size[offset2bag], 1)[:, None].astype(g.dtype)
    if per_sample_weights is not None:
        rows = rows * _acc(per_sample_weights)[:, None]
    if scale_grad_by_freq:
        counts = jnp.zeros((num_weights,), g.dtype).at[idx].add(1)
        rows = rows / counts[idx][:, None]
    rows = jnp.where((idx == padding_idx)[:, None], 0, rows)
    return jnp.zeros((num_weights, g.shape[1]), g.dtype).at[idx].add(rows)


@lower(aten._embedding_bag_dense_backward.default, runtime_numbers=("padding_idx",))
def _embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                  scale_grad_by_freq, mode, per_sample_weights, padding_idx=-1):
    return _bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                               scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@lower(aten._embedding_bag_backward.default, runtime_numbers=("padding_idx",))
def _embedding_bag_backward(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                            scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx=-1):
    """The dense gradient, in a graph (eager mode runs :func:`_embedding_bag_backward_kernel`)."""
    if sparse:
        raise NotImplementedError("tpu: the sparse gradient of EmbeddingBag(sparse=True) inside a compiled "
                                  "graph (its number of rows depends on the indices); it works in eager mode")
    return _bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                               scale_grad_by_freq, mode, per_sample_weights, padding_idx)


@kernel(aten._embedding_bag_backward.default)
def _embedding_bag_backward_kernel(grad, indices, offsets, offset2bag, bag_size, maximum_indices, num_weights,
                                   scale_grad_by_freq, mode, sparse, per_sample_weights=None, padding_idx=-1):
    """EmbeddingBag's weight gradient, as CPU makes it: dense through ``_embedding_bag_dense_backward``,
    or with ``sparse=True`` a sparse COO tensor with a row per index outside ``padding_idx`` (each
    its bag's gradient, divided by the bag's size for ``mean``, times its per-sample weight), which
    ``embedding_backward`` assembles. torch's meta kernel of the sparse form drops the padding rows
    with ``nonzero``, which a meta tensor cannot answer, so this kernel builds it from tpu ops."""
    if not sparse:
        return aten._embedding_bag_dense_backward(grad, indices, offset2bag, bag_size, maximum_indices, num_weights,
                                                  scale_grad_by_freq, mode, per_sample_weights, padding_idx)
    rows = grad.index_select(0, offset2bag)
    if mode == 1:  # mean
        rows = rows / bag_size.to(rows.dtype).unsqueeze(1).index_select(0, offset2bag)
    elif mode == 2:  # max: CPU's sparse path has no max
        raise NotImplementedError("embedding_bag_backward: Sparse gradients are not supported for mode 'max'")
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(1)
    return aten.embedding_backward(rows, indices, num_weights, padding_idx, scale_grad_by_freq, True)


@lower(aten._embedding_bag_per_sample_weights_backward.default, runtime_numbers=("padding_idx",))
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx=-1):
    idx = indices.reshape(-1)
    dots = (_acc(grad)[offset2bag] * _acc(weight)[idx]).sum(-1)
    return jnp.where(idx == padding_idx, 0, dots)


# ==================================================================================== resampling
def _index_dtype(x):
    return jnp.float64 if x.dtype == jnp.float64 else jnp.float32


def _area_scale(in_size: int, out_size: int, align_corners: bool, scale, dt):
    """torch's area_pixel_compute_scale; ``scale`` (a user's scale factor) may be a traced value."""
    if align_corners:
        return jnp.asarray((in_size - 1) / (out_size - 1) if out_size > 1 else 0.0, dt)
    if scale is None:
        return jnp.asarray(in_size / out_size, dt)
    scale = jnp.asarray(scale, dt)
    return jnp.where(scale > 0, 1 / scale, jnp.asarray(in_size / out_size, dt))


def _nearest_index(in_size: int, out_size: int, scale, exact: bool, dt):
    dst = jnp.arange(out_size)
    if not exact and out_size == in_size:
        return dst
    if not exact and out_size == 2 * in_size:
        return dst // 2
    s = _area_scale(in_size, out_size, False, scale, dt)
    src = jnp.floor((dst.astype(dt) + (0.5 if exact else 0.0)) * s).astype(jnp.int64)
    return jnp.minimum(src, in_size - 1)


def _upsample_nearest(x, output_size, scales, exact):
    n = len(output_size)
    for i, (size, s) in enumerate(zip(output_size, scales)):
        axis = x.ndim - n + i
        x = jnp.take(x, _nearest_index(x.shape[axis], size, s, exact, _index_dtype(x)), axis=axis)
    return x


def _interp_axis(x, axis, out_size, align_corners, scale, cubic):
    in_size = x.shape[axis]
    dt = _index_dtype(x)
    s = _area_scale(in_size, out_size, align_corners, scale, dt)
    dst = jnp.arange(out_size, dtype=dt)
    src = s * dst if align_corners else s * (dst + 0.5) - 0.5
    shape = [1] * x.ndim
    shape[axis] = out_size
    if not cubic:
        src = jnp.maximum(src, 0) if not align_corners else src
        i0 = jnp.floor(src).astype(jnp.int64)
        lam = (src - i0).astype(x.dtype).reshape(shape)
        i0 = jnp.minimum(i0, in_size - 1)
        i1 = jnp.minimum(i0 + 1, in_size - 1)
        return jnp.take(x, i0, axis=axis) * (1 - lam) + jnp.take(x, i1, axis=axis) * lam
    i0 = jnp.floor(src).astype(jnp.int64)
    t = (src - i0).astype(x.dtype)
    A = -0.75

    def conv1(v):
        return ((A + 2) * v - (A + 3)) * v * v + 1

    def conv2(v):
        return ((A * v - 5 * A) * v + 8 * A) * v - 4 * A

    coeffs = (conv2(t + 1), conv1(t), conv1(1 - t), conv2(2 - t))
    out = 0
    for k, c in enumerate(coeffs):
        out = out + jnp.take(x, jnp.clip(i0 - 1 + k, 0, in_size - 1), axis=axis) * c.reshape(shape)
    return out


def _upsample_interp(x, output_size, align_corners, scales, cubic=False):
    n = len(output_size)
    if x.dtype == jnp.uint8:
        return _uint8_passes(x, reversed(range(n)), lambda y, i: _interp_axis(
            y, y.ndim - n + i, output_size[i], align_corners, scales[i], cubic), cubic)
    x = _acc(x)
    for i, (size, s) in enumerate(zip(output_size, scales)):
        x = _interp_axis(x, x.ndim - n + i, size, align_corners, s, cubic)
    return x


def _uint8_passes(x, axes, interp, cubic):
    """A uint8 image resized as CPU's uint8 kernel does: in float32, one axis at a time, the last
    (W) first, then rounded to the nearest integer and cast back to uint8. Bicubic's passes are
    each rounded and clamped to [0, 255] before the next, as CPU keeps a uint8 buffer between them
    (its overshoot is clipped between passes, which moves values by up to tens); bilinear cannot
    overshoot, and one final rounding keeps it within 1 of CPU's fixed-point weights."""
    y = x.astype(jnp.float32)
    for i in axes:
        y = interp(y, i)
        if cubic:
            y = jnp.clip(jnp.round(y), 0, 255)
    return jnp.clip(jnp.round(y), 0, 255).astype(jnp.uint8)


_UPSAMPLE_KERNELS = {  # the CPU kernel that refuses an integer dtype, as CPU names it
    "nearest": {1: "compute_indices_weights_nearest", 2: "upsample_nearest2d_channels_last",
                3: "compute_indices_weights_nearest"},
    "linear": {1: "compute_indices_weights_linear", 2: "upsample_bilinear2d_channels_last",
               3: "compute_indices_weights_linear"},
    "cubic": {2: "compute_indices_weights_cubic"},
}


def _upsample_dtype_meta(op: torch._ops.OpOverload, kernel_name: str, uint8: bool) -> Callable:
    """torch's meta kernel of an upsample accepts any dtype; CPU's kernels take floating inputs,
    and uint8 where ``uint8`` (nearest, bilinear and bicubic 2-D, antialiased): this stand-in raises
    CPU's NotImplementedError (a RuntimeError subclass) for the rest, once per signature."""

    def meta(self, *args, **kwargs):
        if self.dtype in _CPU_DTYPE_NAMES and not (uint8 and self.dtype == torch.uint8):
            raise NotImplementedError(f'"{kernel_name}" not implemented for \'{_CPU_DTYPE_NAMES[self.dtype]}\'')
        return op(self, *args, **kwargs)

    return meta


def _register_upsample(op, n: int, kind: str):
    """Lowers an upsample op and its backward (the vjp of the forward)."""
    nearest = kind in ("nearest", "nearest_exact")

    def forward(x, output_size, align_corners, scales):
        if nearest:
            return _upsample_nearest(x, output_size, scales, kind == "nearest_exact")
        return _upsample_interp(x, output_size, align_corners, scales, cubic=(kind == "cubic"))

    def split(rest):
        if nearest:
            return False, list(rest)[:n] + [None] * (n - len(rest))
        rest = list(rest)
        return rest[0], rest[1:n + 1] + [None] * (n + 1 - len(rest))

    def fwd_lowering(self, output_size, *rest):
        align, scales = split(rest)
        return forward(self, list(output_size), align, scales)

    def bwd_lowering(grad_output, output_size, input_size, *rest):
        align, scales = split(rest)
        zeros = jnp.zeros(tuple(input_size), _acc(grad_output).dtype)
        _, vjp = jax.vjp(lambda x: forward(x, list(output_size), align, scales), zeros)
        return vjp(_acc(grad_output))[0]

    family = "nearest" if nearest else kind
    uint8 = nearest or n == 2
    lower(op.default, meta=_upsample_dtype_meta(op.default, _UPSAMPLE_KERNELS[family][n], uint8))(fwd_lowering)
    lower(getattr(aten, op._qualified_op_name.split("::")[1] + "_backward").default)(bwd_lowering)


for _op, _n, _kind in (
    (aten.upsample_nearest1d, 1, "nearest"),
    (aten.upsample_nearest2d, 2, "nearest"),
    (aten.upsample_nearest3d, 3, "nearest"),
    (aten._upsample_nearest_exact1d, 1, "nearest_exact"),
    (aten._upsample_nearest_exact2d, 2, "nearest_exact"),
    (aten._upsample_nearest_exact3d, 3, "nearest_exact"),
    (aten.upsample_linear1d, 1, "linear"),
    (aten.upsample_bilinear2d, 2, "linear"),
    (aten.upsample_trilinear3d, 3, "linear"),
    (aten.upsample_bicubic2d, 2, "cubic"),
):
    _register_upsample(_op, _n, _kind)


# ======================================================================================= padding
def _pad_widths(x, padding):
    """torch's pad list (last dim first, (left, right) pairs) as jnp.pad widths."""
    n = len(padding) // 2
    widths = [(0, 0)] * (x.ndim - n)
    for i in range(n):
        widths.append((padding[2 * (n - 1 - i)], padding[2 * (n - 1 - i) + 1]))
    return widths


def _pad(x, padding, mode):
    widths = _pad_widths(x, padding)
    x = jnp.pad(x, [(max(a, 0), max(b, 0)) for a, b in widths], mode=mode)
    crop = tuple(slice(-a if a < 0 else 0, x.shape[i] + b if b < 0 else None) for i, (a, b) in enumerate(widths))
    return x[crop]


def _register_pad(op, mode):
    def forward(self, padding):
        return _pad(self, padding, mode)

    def backward(grad_output, self, padding):
        _, vjp = jax.vjp(lambda x: _pad(x, padding, mode), jnp.zeros(self.shape, _acc(grad_output).dtype))
        return vjp(_acc(grad_output))[0]

    # CPU's kernels lay the result out as the input (channels_last stays so); torch's meta kernels
    # make it contiguous: the result's strides are CPU's, taken once per signature
    bwd = getattr(aten, op._qualified_op_name.split("::")[1] + "_backward")
    lower(op.default, meta=cpu_meta(op))(forward)
    lower(bwd.default, meta=cpu_meta(bwd))(backward)


for _op in (aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d):
    _register_pad(_op, "reflect")
for _op in (aten.replication_pad1d, aten.replication_pad2d, aten.replication_pad3d):
    _register_pad(_op, "edge")


# ============================================================================== pixel shuffling
@lower(aten.pixel_shuffle.default)
def pixel_shuffle(self, upscale_factor):
    r = upscale_factor
    *lead, c, h, w = self.shape
    x = self.reshape(*lead, c // (r * r), r, r, h, w)
    k = len(lead)
    x = x.transpose(*range(k), k, k + 3, k + 1, k + 4, k + 2)
    return x.reshape(*lead, c // (r * r), h * r, w * r)


@lower(aten.pixel_unshuffle.default)
def pixel_unshuffle(self, downscale_factor):
    r = downscale_factor
    *lead, c, h, w = self.shape
    x = self.reshape(*lead, c, h // r, r, w // r, r)
    k = len(lead)
    x = x.transpose(*range(k), k, k + 2, k + 4, k + 1, k + 3)
    return x.reshape(*lead, c * r * r, h // r, w // r)


# ========================================================================================= pdist
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    i, j = np.triu_indices(n, k=1)
    return i, j


@lower(aten._pdist_forward.default)
def _pdist_forward(self, p=2.0):
    x = _acc(self)
    i, j = _pairs(x.shape[0])
    d = jnp.abs(x[i] - x[j])
    safe_p = jnp.where((p == 0) | jnp.isinf(p), 1.0, p)
    general = jnp.power(jnp.power(d, safe_p).sum(-1), 1 / safe_p)
    return jnp.where(p == 0, (d != 0).sum(-1).astype(x.dtype), jnp.where(jnp.isinf(p), d.max(-1, initial=0), general))


@lower(aten._pdist_backward.default)
def _pdist_backward(grad, self, p, pdist):
    x = _acc(self)
    i, j = _pairs(x.shape[0])
    diff = x[i] - x[j]
    dist = _acc(pdist)[:, None]
    g = _acc(grad)[:, None]
    nz = dist != 0
    safe = jnp.where(nz, dist, 1)
    sign = jnp.sign(diff)
    p_safe = jnp.where((p == 0) | jnp.isinf(p), 2.0, p)
    general = diff * jnp.power(jnp.abs(diff), p_safe - 2) * g / jnp.power(safe, p_safe - 1)
    one = sign * g
    two = diff * g / safe
    inf = sign * (jnp.abs(diff) == dist) * g
    pair = jnp.where(p == 0, 0, jnp.where(p == 1, one, jnp.where(p == 2, two, jnp.where(jnp.isinf(p), inf, general))))
    pair = jnp.where(nz | (p == 1), pair, 0)
    out = jnp.zeros_like(x).at[i].add(pair).at[j].add(-pair)
    return out


# ============================================================================ fused RNN cells
# torch runs nn.LSTM / nn.GRU on a non-CPU device through these CUDA-style fused cells. The
# workspace holds the activated gates, which the backward reads back.
def _lstm_cell_meta(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    """torch's own meta reads ``.device`` of the optional biases, so ``bias=False`` (both None)
    fails there: hy and cy have cx's shape, the workspace the gates' shape."""
    return torch.empty_like(cx), torch.empty_like(cx), torch.empty_like(input_gates)


@lower(aten._thnn_fused_lstm_cell.default, meta=_lstm_cell_meta)
def _thnn_fused_lstm_cell(input_gates, hidden_gates, cx, input_bias=None, hidden_bias=None):
    gates = _acc(input_gates) + _acc(hidden_gates)
    if input_bias is not None:
        gates = gates + _acc(input_bias) + _acc(hidden_bias)
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
    cy = f * _acc(cx) + i * g
    return o * jnp.tanh(cy), cy, jnp.concatenate([i, f, g, o], axis=-1)


def _lstm_cell_backward(cx, cy, workspace, has_bias, grad_hy=None, grad_cy=None):
    if grad_hy is None and grad_cy is None:  # as torch's kernel: no gradient in, none out
        return None, None, None
    i, f, g, o = jnp.split(_acc(workspace), 4, axis=-1)
    cy, cx = _acc(cy), _acc(cx)
    gh = jnp.zeros_like(cy) if grad_hy is None else _acc(grad_hy)
    gc = jnp.zeros_like(cy) if grad_cy is None else _acc(grad_cy)
    tcy = jnp.tanh(cy)
    gcy = gh * o * (1 - tcy * tcy) + gc
    grad_gates = jnp.concatenate(
        [gcy * g * i * (1 - i), gcy * cx * f * (1 - f), gcy * i * (1 - g * g), gh * tcy * o * (1 - o)], axis=-1
    )
    res = [grad_gates, gcy * f]
    if has_bias:
        res.append(grad_gates.sum(0))
    return tuple(res)


lower(aten._thnn_fused_lstm_cell_backward_impl.default, by_name=True)(_lstm_cell_backward)


def _gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    ig, hg, h = _acc(input_gates), _acc(hidden_gates), _acc(hx)
    if input_bias is not None:
        ig, hg = ig + _acc(input_bias), hg + _acc(hidden_bias)
    ir, ii, inn = jnp.split(ig, 3, axis=-1)
    hr, hi, hn = jnp.split(hg, 3, axis=-1)
    r, z = jax.nn.sigmoid(ir + hr), jax.nn.sigmoid(ii + hi)
    n = jnp.tanh(inn + r * hn)
    return n + z * (h - n), jnp.concatenate([r, z, n, h, hn], axis=-1)


def _gru_cell_meta(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    b, h = hx.shape
    return torch.empty_like(hx), input_gates.new_empty((b, 5 * h))


def _gru_cell_backward(grad_hy, workspace, has_bias):
    r, z, n, hx, hn = jnp.split(_acc(workspace), 5, axis=-1)
    gh = _acc(grad_hy)
    gn = gh * (1 - z) * (1 - n * n)
    gz = gh * (hx - n) * z * (1 - z)
    gr = gn * hn * r * (1 - r)
    g_in, g_hid = jnp.concatenate([gr, gz, gn], -1), jnp.concatenate([gr, gz, gn * r], -1)
    res = [g_in, g_hid, gh * z]
    if has_bias:
        res += [g_in.sum(0), g_hid.sum(0)]
    return tuple(res)


def _gru_cell_backward_meta(grad_hy, workspace, has_bias):
    b, h = grad_hy.shape
    gates = grad_hy.new_empty((b, 3 * h))
    bias = grad_hy.new_empty((3 * h,)) if has_bias else None
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, bias


lower(aten._thnn_fused_gru_cell.default, by_name=True, meta=_gru_cell_meta)(_gru_cell)
lower(aten._thnn_fused_gru_cell_backward.default, by_name=True, meta=_gru_cell_backward_meta)(_gru_cell_backward)


# ================================================================================ grid sampler 3d
def _grid_unnormalize(coord, size: int, align_corners: bool):
    """[-1, 1] grid coordinates to input pixel positions, as CPU's grid sampler maps them."""
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _grid_reflect(coord, twice_low: int, twice_high: int):
    """Reflects ``coord`` into [twice_low / 2, twice_high / 2] (CPU's reflect_coordinates)."""
    if twice_low == twice_high:
        return jnp.zeros_like(coord)
    lo = twice_low / 2
    span = (twice_high - twice_low) / 2
    c = jnp.abs(coord - lo)
    extra = jnp.fmod(c, span)
    flips = jnp.floor(c / span)
    return jnp.where(jnp.fmod(flips, 2) == 0, extra + lo, span - extra + lo)


def _grid_source(coord, size: int, padding_mode: int, align_corners: bool):
    coord = _grid_unnormalize(coord, size, align_corners)
    if padding_mode == 1:  # border
        coord = jnp.clip(coord, 0, size - 1)
    elif padding_mode == 2:  # reflection
        if align_corners:
            coord = _grid_reflect(coord, 0, 2 * (size - 1))
        else:
            coord = _grid_reflect(coord, -1, 2 * size - 1)
        coord = jnp.clip(coord, 0, size - 1)
    return coord


def grid_sampler_3d(input, grid, interpolation_mode, padding_mode, align_corners):
    """Trilinear (mode 0) or nearest (mode 1) sampling of ``input`` (N, C, D, H, W) at ``grid``
    (N, D', H', W', 3; x, y, z in [-1, 1]); corners outside the input read zero."""
    x = _acc(input)
    g = grid.astype(x.dtype)
    d, h, w = x.shape[-3:]
    ix = _grid_source(g[..., 0], w, padding_mode, align_corners)
    iy = _grid_source(g[..., 1], h, padding_mode, align_corners)
    iz = _grid_source(g[..., 2], d, padding_mode, align_corners)

    def gather(zi, yi, xi):  # (N, D', H', W') int -> (N, C, D', H', W'), zero outside
        inside = (zi >= 0) & (zi < d) & (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
        flat = (jnp.clip(zi, 0, d - 1) * h + jnp.clip(yi, 0, h - 1)) * w + jnp.clip(xi, 0, w - 1)
        vals = jax.vmap(lambda xn, fn: jnp.take(xn.reshape(xn.shape[0], -1), fn, axis=1))(x, flat)
        return jnp.where(inside[:, None], vals, 0)

    if interpolation_mode == 1:
        return gather(*(jnp.round(c).astype(jnp.int64) for c in (iz, iy, ix)))
    x0, y0, z0 = jnp.floor(ix), jnp.floor(iy), jnp.floor(iz)
    out = 0
    for dz in (0, 1):
        for dy in (0, 1):
            for dx in (0, 1):
                wx = (ix - x0) if dx else (x0 + 1 - ix)
                wy = (iy - y0) if dy else (y0 + 1 - iy)
                wz = (iz - z0) if dz else (z0 + 1 - iz)
                idx = [(c + o).astype(jnp.int64) for c, o in ((z0, dz), (y0, dy), (x0, dx))]
                out = out + gather(*idx) * (wx * wy * wz)[:, None]
    return out


def _grid_sampler_3d_check(input, grid, interpolation_mode, padding_mode, align_corners):
    if interpolation_mode == 2:
        raise RuntimeError("grid_sampler(): bicubic interpolation only supports 4D input")


lower(aten.grid_sampler_3d.default, check=_grid_sampler_3d_check)(grid_sampler_3d)


def grid_sampler_2d(input, grid, interpolation_mode, padding_mode, align_corners):
    """Bilinear and nearest: the 3-d sampler over a depth of one (z = 0 lands on it exactly);
    bicubic: CPU's 4x4 cubic convolution (A = -0.75), padding applied to each tap."""
    if interpolation_mode != 2:
        g3 = jnp.concatenate([grid, jnp.zeros_like(grid[..., :1])], axis=-1)[:, None]
        return grid_sampler_3d(input[:, :, None], g3, interpolation_mode, padding_mode, align_corners)[:, :, 0]
    x = _acc(input)
    g = grid.astype(x.dtype)
    h, w = x.shape[-2:]
    ix = _grid_unnormalize(g[..., 0], w, align_corners)
    iy = _grid_unnormalize(g[..., 1], h, align_corners)
    x0, y0 = jnp.floor(ix), jnp.floor(iy)

    def tap(c, size):  # one tap's coordinate after padding (zeros padding: out of range reads 0)
        if padding_mode == 0:
            return c
        return _grid_source(_grid_normalize(c, size, align_corners), size, padding_mode, align_corners)

    def gather(yi, xi):
        yi, xi = jnp.round(yi).astype(jnp.int64), jnp.round(xi).astype(jnp.int64)
        inside = (yi >= 0) & (yi < h) & (xi >= 0) & (xi < w)
        flat = jnp.clip(yi, 0, h - 1) * w + jnp.clip(xi, 0, w - 1)
        vals = jax.vmap(lambda xn, fn: jnp.take(xn.reshape(xn.shape[0], -1), fn, axis=1))(x, flat)
        return jnp.where(inside[:, None], vals, 0)

    wx, wy = _cubic_weights(ix - x0), _cubic_weights(iy - y0)
    out = 0
    for i in range(4):
        for j in range(4):
            out = out + gather(tap(y0 - 1 + i, h), tap(x0 - 1 + j, w)) * (wy[i] * wx[j])[:, None]
    return out


def _grid_normalize(coord, size: int, align_corners: bool):
    """The inverse of :func:`_grid_unnormalize` (a tap's pixel position back to [-1, 1])."""
    if align_corners:
        return coord * 2 / max(size - 1, 1) - 1
    return (coord * 2 + 1) / size - 1


def _cubic_weights(t, a: float = -0.75):
    """The four cubic-convolution weights of taps -1, 0, 1, 2 at fraction ``t``."""
    def near(d):
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _grid_sampler_2d_check(input, grid, interpolation_mode, padding_mode, align_corners):
    """CPU's shape checks of ``grid_sampler_2d``, in CPU's order and words. Eager mode serves the op
    by torch's decomposition, whose asserts (an AssertionError, or a ValueError from unpacking)
    would otherwise speak first."""
    sizes, gsizes = list(input.shape), list(grid.shape)
    if input.dim() and grid.dim() and input.shape[0] != grid.shape[0]:
        raise RuntimeError(f"grid_sampler(): expected grid and input to have same batch size, but got input with "
                           f"sizes {sizes} and grid with sizes {gsizes}")
    if grid.dim() and grid.shape[-1] != input.dim() - 2:
        raise RuntimeError(f"grid_sampler(): expected grid to have size {input.dim() - 2} in last dimension, but got "
                           f"grid with sizes {gsizes}")
    for i in range(2, input.dim()):
        if input.shape[i] == 0:
            raise RuntimeError(f"grid_sampler(): expected input to have non-empty spatial dimensions, but input has "
                               f"sizes {sizes} with dimension {i} being empty")
    if input.dim() != 4 or grid.dim() != 4:
        raise RuntimeError(f"grid_sampler(): expected 4D input and grid with same number of dimensions, but got "
                           f"input with sizes {sizes} and grid with sizes {gsizes}")


lower(aten.grid_sampler_2d.default, graph_only=True, check=_grid_sampler_2d_check)(grid_sampler_2d)


@lower(aten._trilinear.default, graph_only=True)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``bilinear``'s kernel: the three inputs unsqueezed at their ``expand`` dims, multiplied,
    summed over ``sumdim`` (eager mode runs torch's composite)."""
    def unsqueeze(a, dims):
        for d in sorted(dims):
            a = jnp.expand_dims(a, d)
        return a

    prod = unsqueeze(i1, expand1) * unsqueeze(i2, expand2) * unsqueeze(i3, expand3)
    return jnp.sum(prod, axis=tuple(sumdim)) if sumdim else prod


def _grid_sampler_backward(forward: Callable) -> Callable:
    """The backward of a grid sampler: the vjp of its forward lowering (bicubic included). The
    input's gradient where ``output_mask`` asks for it; the grid's always, as CPU's kernel (and
    torch's meta kernel) return it whatever the mask says."""

    def backward(grad_output, input, grid, interpolation_mode, padding_mode, align_corners, output_mask):
        def fwd(x, g):
            return forward(x, g, interpolation_mode, padding_mode, align_corners)

        x, g = _acc(input), _acc(grid)
        _, vjp = jax.vjp(fwd, x, g)
        gx, gg = vjp(_acc(grad_output).astype(x.dtype))
        return (gx, gg) if output_mask[0] else (gg,)

    return backward


lower(aten.grid_sampler_3d_backward.default, by_name=True)(_grid_sampler_backward(grid_sampler_3d))
lower(aten.grid_sampler_2d_backward.default, by_name=True)(_grid_sampler_backward(grid_sampler_2d))


# ======================================================================= antialiased resampling
def _aa_filter(kind: str, x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    if kind == "linear":
        return np.where(x < 1, 1 - x, 0)
    a = -0.5  # the bicubic filter antialiasing uses (PIL's)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1, np.where(x < 2, (((x - 5) * x + 8) * x - 4) * a, 0))


def _aa_weights(in_size: int, out_size: int, align_corners: bool, scale, kind: str) -> np.ndarray:
    """CPU's antialiasing weights as an (out, in) matrix: each output pixel averages the input
    pixels under a filter widened by the downscaling factor, weights normalised to sum to 1."""
    if align_corners:
        s = (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
    else:
        s = 1.0 / scale if scale is not None and scale > 0 else in_size / out_size
    s = float(np.float32(s))
    interp = 2 if kind == "linear" else 4
    support = interp * 0.5 * s if s >= 1.0 else interp * 0.5
    inv = 1.0 / s if s >= 1.0 else 1.0
    m = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        center = s * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        j = np.arange(lo, hi)
        w = _aa_filter(kind, (j - center + 0.5) * inv)
        total = w.sum()
        m[i, lo:hi] = w / total if total != 0 else w
    return m


def _upsample_aa(x, output_size, align_corners, scales_h, scales_w, kind):
    """Separable: along W first, then H, as CPU (uint8: each pass rounded, see _uint8_passes)."""
    hp = lax.Precision.HIGHEST
    (oh, ow), (ih, iw) = output_size, x.shape[-2:]
    axes = [1] if ow != iw else []  # CPU skips an axis whose size is unchanged
    axes += [0] if oh != ih else []

    def interp(y, i):
        if i == 1:
            mw = jnp.asarray(_aa_weights(iw, ow, align_corners, scales_w, kind), y.dtype)
            return jnp.einsum("...w,ow->...o", y, mw, precision=hp)
        mh = jnp.asarray(_aa_weights(ih, oh, align_corners, scales_h, kind), y.dtype)
        return jnp.einsum("...hw,oh->...ow", y, mh, precision=hp)

    if x.dtype == jnp.uint8:
        return _uint8_passes(x, axes, interp, kind == "cubic")
    y = _acc(x)
    for i in axes:
        y = interp(y, i)
    return y


def _register_upsample_aa(op, kind: str):
    """The forward and its backward (the vjp; the forward is linear in the input). Scales are
    static: they pick the weights."""

    def forward(self, output_size, align_corners, scales_h=None, scales_w=None):
        return _upsample_aa(self, list(output_size), align_corners, scales_h, scales_w, kind)

    def backward(grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None):
        zeros = jnp.zeros(tuple(input_size), _acc(grad_output).dtype)
        _, vjp = jax.vjp(lambda x: forward(x, output_size, align_corners, scales_h, scales_w), zeros)
        return vjp(_acc(grad_output))[0]

    meta = _upsample_dtype_meta(op.default, "compute_index_ranges_weights", True)
    lower(op.default, static_scalars=True, check=_aa_dtype_check, meta=meta)(forward)
    lower(getattr(aten, op._qualified_op_name.split("::")[1] + "_backward").default, static_scalars=True,
          check=_aa_dtype_check)(backward)


def _aa_dtype_check(x, *args, **kwargs):
    """CPU computes antialiasing weights for float32/float64 only."""
    if x.dtype in (torch.float16, torch.bfloat16):
        name = "Half" if x.dtype == torch.float16 else "BFloat16"
        raise NotImplementedError(f'"compute_index_ranges_weights" not implemented for \'{name}\'')


_register_upsample_aa(aten._upsample_bilinear2d_aa, "linear")
_register_upsample_aa(aten._upsample_bicubic2d_aa, "cubic")


# ========================================================================================= CTC
def _lse(*xs):
    """log(sum(exp(xs))) that is -inf, with a zero gradient, when every term is -inf."""
    m = functools.reduce(jnp.maximum, xs)
    finite = jnp.isfinite(m)
    m0 = jnp.where(finite, m, 0)
    s = sum(jnp.exp(x - m0) for x in xs)
    pos = s > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, s, 1)) + m0, -jnp.inf)


def _shift_right(x, k: int, fill):
    """x (N, L) moved k states to the right along its last axis, ``fill`` in the k first states,
    the shape kept: with every target empty L is 1, shorter than the shift."""
    pad = jnp.full(x.shape[:-1] + (k,), fill, x.dtype)
    return jnp.concatenate([pad, x], axis=-1)[..., : x.shape[-1]]


def _ctc_forward(log_probs, targets, input_lengths, target_lengths, blank):
    """(negative log-likelihood (N,), log_alpha (N, T, 2 S + 1)) by the forward recursion over
    the blank-extended label sequences; S is the longest target."""
    lp = _acc(log_probs)
    T, N, _ = lp.shape
    S = max(target_lengths, default=0)
    L = 2 * S + 1
    tl = np.asarray(target_lengths, np.int64)
    if targets.ndim == 2:  # padded (N, S')
        labels = targets[:, :S] if S else jnp.zeros((N, 0), targets.dtype)
    else:  # concatenated
        starts = np.concatenate([[0], np.cumsum(tl)[:-1]]).astype(np.int64)
        idx = np.minimum(starts[:, None] + np.arange(S)[None, :], max(targets.shape[0] - 1, 0))
        labels = targets[idx] if targets.shape[0] else jnp.zeros((N, S), targets.dtype)
    s = np.arange(L)
    real = (s[None, :] % 2 == 1) & ((s[None, :] - 1) // 2 < tl[:, None])  # (N, L) a target symbol
    lab = jnp.where(real, jnp.take_along_axis(labels, np.clip((s - 1) // 2, 0, max(S - 1, 0))[None, :]
                                              .repeat(N, 0), axis=1) if S else blank, blank)
    lab = lab.astype(jnp.int64)
    alive = s[None, :] <= 2 * tl[:, None]  # states past 2 * target length never matter
    prev2 = _shift_right(lab, 2, -1)
    skip = jnp.asarray(real) & (lab != prev2) & (s[None, :] >= 2)
    lp_ext = jnp.take_along_axis(lp, jnp.broadcast_to(lab[None], (T, N, L)), axis=2)  # (T, N, L)
    la0 = jnp.where(jnp.asarray((s[None, :] < 2) & alive), lp_ext[0], -jnp.inf)

    def step(la, lpt):
        a1 = _shift_right(la, 1, -jnp.inf)
        a2 = jnp.where(skip, _shift_right(la, 2, -jnp.inf), -jnp.inf)
        new = jnp.where(jnp.asarray(alive), _lse(la, a1, a2) + lpt, -jnp.inf)
        return new, new

    _, rest = lax.scan(step, la0, lp_ext[1:])
    la = jnp.concatenate([la0[None], rest], axis=0)  # (T, N, L)
    last = np.maximum(np.asarray(input_lengths, np.int64) - 1, 0)
    final = la[last, np.arange(N)]  # (N, L)
    l1 = jnp.take_along_axis(final, jnp.asarray(2 * tl)[:, None], axis=1)[:, 0]
    l2 = jnp.take_along_axis(final, jnp.asarray(np.maximum(2 * tl - 1, 0))[:, None], axis=1)[:, 0]
    l2 = jnp.where(jnp.asarray(tl > 0), l2, -jnp.inf)
    return -_lse(l1, l2), jnp.swapaxes(la, 0, 1)


def _ctc_loss_check(log_probs, *args, **kwargs):
    """CPU's kernel refuses empty log_probs before it looks at the lengths."""
    if log_probs.numel() == 0:
        raise RuntimeError("log_probs tensor must not be empty")


@lower(aten._ctc_loss.default, check=_ctc_loss_check)
def _ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """zero_infinity is applied by torch's composite ``ctc_loss`` above this op, as on CPU."""
    return _ctc_forward(log_probs, targets, list(input_lengths), list(target_lengths), blank)


def _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, neg_log_likelihood, log_alpha,
                       blank, zero_infinity=False):
    """CPU's gradient: (exp(log_probs) - occupancy) * grad, the gradient with respect to the
    logits under a log_softmax (torch's convention), zero past each input length and, with
    zero_infinity, for infinite losses. The occupancy is the vjp of the forward recursion."""
    lp = _acc(log_probs)
    il, tls = list(input_lengths), list(target_lengths)
    _, vjp = jax.vjp(lambda x: _ctc_forward(x, targets, il, tls, blank)[0], lp)
    (dnll,) = vjp(jnp.ones(lp.shape[1], lp.dtype))  # = -occupancy
    g = _acc(grad).astype(lp.dtype)
    res = (jnp.exp(lp) + dnll) * g[None, :, None]
    live = np.arange(lp.shape[0])[:, None] < np.asarray(il, np.int64)[None, :]  # (T, N)
    res = jnp.where(jnp.asarray(live)[..., None], res, 0)
    inf = jnp.isinf(_acc(neg_log_likelihood))[None, :, None]
    if zero_infinity:
        return jnp.where(inf, 0, res)
    return jnp.where(inf & jnp.asarray(live)[..., None], jnp.nan, res)  # CPU's exp(-inf + inf)


def _ctc_loss_backward_meta(grad, log_probs, *args, **kwargs):
    """torch has no meta kernel here: the gradient has log_probs' shape and dtype."""
    return torch.empty_like(log_probs)


lower(aten._ctc_loss_backward.default, by_name=True, meta=_ctc_loss_backward_meta)(_ctc_loss_backward)


# --------------------------------------------------------------------- fractional max pooling
def _fractional_starts(sample, size: int, out: int, pool: int, dtype):
    """CPU's window starts for one dimension: ``int((i + u) * a) - int(u * a)`` with
    ``a = (size - pool) / (out - 1)``, in the input's float type, and the last window flush with the
    end. ``sample`` (one uniform draw per plane) has shape (planes,); the result (planes, out)."""
    i = jnp.arange(out, dtype=dtype)
    if out > 1:
        alpha = jnp.asarray(size - pool, dtype) / jnp.asarray(out - 1, dtype)
        u = sample.astype(dtype)[:, None]
        starts = ((i + u) * alpha).astype(jnp.int64) - (u * alpha).astype(jnp.int64)
    else:
        starts = jnp.zeros((sample.shape[0], out), jnp.int64)
    return starts.at[:, out - 1].set(size - pool)


def _fractional_max_pool(x, kernel_size, output_size, random_samples, n: int):
    """Max over the fractional windows of the last ``n`` dims; indices are flat within a plane.
    The samples' columns are (w, h) in 2-D and (t, h, w) in 3-D, as CPU reads them."""
    batched = x.ndim == n + 2
    xb = x if batched else x[None]
    lead = xb.shape[:2]
    planes = lead[0] * lead[1]
    sizes = xb.shape[2:]
    samples = random_samples.reshape(planes, n)
    order = [1, 0] if n == 2 else [0, 1, 2]  # which sample column drives each spatial dim
    flat = jnp.zeros((planes,) + (1,) * (2 * n), jnp.int64)
    for d in range(n):
        # in the input's dtype, rounded at each step as CPU's kernel computes them (bfloat16 too)
        starts = _fractional_starts(samples[:, order[d]], sizes[d], output_size[d], kernel_size[d], x.dtype)
        pos = starts[:, :, None] + jnp.arange(kernel_size[d])  # (planes, out_d, pool_d)
        shape = [planes] + [1] * (2 * n)
        shape[1 + d], shape[1 + n + d] = output_size[d], kernel_size[d]
        stride = math.prod(sizes[d + 1:])
        flat = flat + pos.reshape(shape) * stride
    flat = flat.reshape(planes, math.prod(output_size), math.prod(kernel_size))
    values = jnp.take_along_axis(xb.reshape(planes, -1), flat.reshape(planes, -1), axis=1).reshape(flat.shape)
    nan = jnp.isnan(values)
    k = values.shape[-1]
    last_nan = k - 1 - jnp.argmax(nan[..., ::-1], axis=-1)  # CPU keeps the last NaN of a window
    arg = jnp.where(nan.any(-1), last_nan, jnp.argmax(jnp.where(nan, _lowest(values.dtype), values), axis=-1))
    best = jnp.take_along_axis(values, arg[..., None], axis=-1)[..., 0]
    idx = jnp.take_along_axis(flat, arg[..., None], axis=-1)[..., 0]
    shape = tuple(lead) + tuple(output_size)
    best, idx = best.reshape(shape), idx.reshape(shape)
    return (best, idx) if batched else (best[0], idx[0])


def _fractional_meta(op: torch._ops.OpOverload, n: int) -> Callable:
    """CPU's checks of the window and output sizes, with CPU's words (torch's meta kernel runs two
    of them together, "musteither"), then torch's meta kernel."""
    ints = "Ints" if n == 2 else "three Ints"

    def meta(self, kernel_size, output_size, random_samples):
        for what, v in (("kernel_size", kernel_size), ("output_size", output_size)):
            if len(v) != n:
                raise RuntimeError(f"fractional_max_pool{n}d: {what} must either be a single Int or tuple of {ints}")
        if random_samples.dtype != self.dtype:  # CPU's check, which torch's meta kernels leave out
            raise RuntimeError("Expect _random_samples to have the same dtype as input")
        if n == 3:  # torch's 3-d meta kernel does not check the samples as CPU does
            batch, planes = (self.shape[0], self.shape[1]) if self.dim() == 5 else (1, self.shape[0])
            if random_samples.shape[0] < batch:
                raise RuntimeError("Expect _random_samples.size(0) no less then input batch size.")
            if random_samples.shape[1] != planes:
                raise RuntimeError("Expect _random_samples.size(1) equals to input channel size.")
            if random_samples.shape[2] != 3:
                raise RuntimeError(f"Expect _random_samples.size(2) equals to 3; got {random_samples.shape[2]}.")
        return op(self, kernel_size, output_size, random_samples)

    return meta


@lower(aten.fractional_max_pool2d.default, meta=_fractional_meta(aten.fractional_max_pool2d.default, 2))
def fractional_max_pool2d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 2)


@lower(aten.fractional_max_pool3d.default, meta=_fractional_meta(aten.fractional_max_pool3d.default, 3))
def fractional_max_pool3d(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples, 3)


@lower(aten.fractional_max_pool2d_backward.default)
def fractional_max_pool2d_backward(grad_output, self, kernel_size, output_size, indices):
    return scatter_to_input(_acc(grad_output), self.shape, indices, 2)


def _like_input_meta(grad_output, self, *args, **kwargs):
    """torch has no meta kernel here: the gradient has the input's shape and dtype."""
    return torch.empty_like(self)


@lower(aten.fractional_max_pool3d_backward.default, meta=_like_input_meta)
def fractional_max_pool3d_backward(grad_output, self, kernel_size, output_size, indices):
    return scatter_to_input(_acc(grad_output), self.shape, indices, 3)
