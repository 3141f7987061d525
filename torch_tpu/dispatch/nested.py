"""Nested tensors (``torch.nested``, the strided layout) on the tpu device.

Why: PyTorch sends every op on a nested tensor to the ``NestedTensor<backend>`` dispatch key, and
registers its kernels for CPU and CUDA only, so on tpu even a nested tensor's sizes could not be
read. Code written for CUDA meets nested tensors without asking for them: ``nn.TransformerEncoder``
and ``nn.TransformerEncoderLayer`` in eval mode take torch's fast path, which packs padded batches
into nested tensors and lists PrivateUse1 among its devices.

How:
- Building one, reading its metadata, copying it between devices, unbinding and cloning it are
  torch's own device-generic C++ kernels, registered for ``NestedTensorPrivateUse1`` by the C++
  extension (``csrc/nested.cpp``): Python cannot reach a ``NestedTensorImpl``'s buffer.
- Every other op on a nested tpu tensor runs on CPU through the CPU fallback (``fallback``): the
  nested inputs are copied to CPU with torch's nested copy, the op runs there, and nested results
  come back as nested tpu tensors. Each op is counted in ``torch_tpu.metrics()`` and warns once, as
  every CPU fallback does; ``TORCH_TPU_STRICT=1`` refuses it.
- Views (``unsqueeze``, ``transpose``, ``select``, ``view``, ``unbind``, ``chunk`` ...: ``VIEWS``) are
  torch's kernels too, over the same buffer, so writes through them reach the base. Any other view
  raises ``NotImplementedError``: through CPU it would be a copy, and writes through it would be lost.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_tpu.core import extension as _extension
from torch_tpu.dispatch.fallback import cpu_fallback

_lib: torch.library.Library | None = None
# the views of a nested tpu tensor that csrc/nested.cpp serves (torch's kernels, over the same buffer)
VIEWS = ("alias", "detach", "values", "unbind", "unsqueeze", "squeeze", "transpose", "select", "view", "narrow",
         "chunk", "split", "split_with_sizes")


def _fallback(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    if not _extension.available():
        raise NotImplementedError(f"{op} on a nested tpu tensor: nested tensors on tpu need torch_tpu's C++ extension, "
                                  f"which is not loaded ({_extension.why_not()})")
    if any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns):
        raise NotImplementedError(f"{op} on a nested tpu tensor: views of nested tpu tensors are not implemented "
                                  f"(those served: {', '.join(VIEWS)})")
    return cpu_fallback(op, args, kwargs)


def register() -> None:
    """Registers the ``NestedTensorPrivateUse1`` fallback (the extension registers the kernels)."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("_", "IMPL")
    _lib.fallback(_fallback, "NestedTensorPrivateUse1")
