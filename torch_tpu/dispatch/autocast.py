"""``torch.autocast(device_type="tpu")``: the same op policy CUDA uses.

Ops in ``LOWER_PRECISION`` (matmuls, convolutions, attention) run in the autocast dtype (bf16 by
default), ops in ``FLOAT32`` (reductions, norms, losses, exp/log) run in float32, and ops in
``PROMOTE`` run in the widest floating type of their inputs. Everything else passes straight
through. Only floating tpu tensors other than float64 are cast, as on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu.ops._registry import dispatcher_overloads

aten = torch.ops.aten
_KEY = "AutocastPrivateUse1"
_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER_PRECISION = (
    "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d conv_transpose3d convolution "
    "prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul "
    "linalg_multi_dot lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell scaled_dot_product_attention"
).split()
FLOAT32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow softplus layer_norm "
    "native_layer_norm group_norm frobenius_norm nuclear_norm cosine_similarity poisson_nll_loss "
    "cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss "
    "mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss "
    "binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp prod softmax log_softmax cumprod cumsum "
    "linalg_vector_norm norm sum cross_entropy_loss"
).split()
PROMOTE = (
    "cat stack index_copy addcdiv addcmul atan2 bilinear cross dot grid_sampler index_put scatter_add tensordot"
).split()


def _eligible(x: Any) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and x.dtype != torch.float64
        and x.device.type == "tpu"
    )


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if _eligible(x):
        return x if x.dtype == dtype else x.to(dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    found: list[torch.dtype] = []

    def visit(x: Any) -> None:
        if _eligible(x):
            found.append(x.dtype)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    for a in (*args, *kwargs.values()):
        visit(a)
    if not found:
        return None
    widest = found[0]
    for d in found[1:]:
        widest = torch.promote_types(widest, d)
    return widest


def _kernel(op: torch._ops.OpOverload, policy: str):
    def run(*args: Any, **kwargs: Any) -> Any:
        if policy == "lower":
            dtype = torch.get_autocast_dtype("tpu")
        elif policy == "fp32":
            dtype = torch.float32
        else:
            dtype = _widest(args, kwargs)
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            if dtype is None:
                return op(*args, **kwargs)
            return op(*_cast(args, dtype), **{k: _cast(v, dtype) for k, v in kwargs.items()})

    return run


_lib: torch.library.Library | None = None


def install() -> None:
    """Registers the policy kernels and a fallthrough for every other op."""
    global _lib
    _lib = torch.library.Library("aten", "IMPL")
    fallthrough = torch.library.Library("_", "IMPL")
    fallthrough.fallback(torch.library.fallthrough_kernel, _KEY)
    _lib._fallthrough = fallthrough  # keep it alive with the table
    for names, policy in ((LOWER_PRECISION, "lower"), (FLOAT32, "fp32"), (PROMOTE, "promote")):
        for name in names:
            packet = getattr(aten, name, None)
            if packet is None:
                continue
            for op in dispatcher_overloads(packet):
                if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
                    continue  # in-place and out= overloads keep their dtypes, as on CUDA
                _lib.impl(op.name().split("::", 1)[1], _kernel(op, policy), _KEY)
