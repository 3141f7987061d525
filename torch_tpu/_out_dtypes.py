"""CPU's rules for an ``out=`` tensor whose dtype differs from the op's result.

Torch's Python meta kernels check an ``out`` tensor's dtype with rules of their own: some ops
demand the exact result dtype ("Expected out tensor to have dtype float32 ..."), others a safe cast
("Attempting to cast from ..."), and many don't check at all. CPU's kernels differ op by op:
``abs`` of a complex tensor writes into a float16 ``out``, ``neg`` refuses an int64 input with a
uint8 ``out`` ("Found dtype Byte but expected Long"), ``angle`` refuses an integer ``out``
("result type Float can't be cast to the desired output type Long"), ``isposinf`` says it "does
not support non-boolean outputs". No table of ours could keep up with that, so an ``out=``
kernel asks CPU itself, once per signature when the op's program is built: the same op on
zero-filled CPU stand-ins of the same shapes and dtypes. Dtype checks don't depend on values, and
the answer is CPU's exception type and message.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import torch

# Stand-ins bigger than this are not built (the check would cost more than it is worth); the meta
# kernel's answer stands for such calls.
_MAX_NUMEL = 1 << 22

# The messages of torch's out wrapper (torch/_prims_common/wrappers.py) about an out tensor's
# dtype: when CPU accepts that dtype, the meta kernel's refusal is not CPU's behaviour.
_ABOUT_DTYPES = re.compile(r"dtype|result type|non-boolean|can't be cast|for complex tensors"
                           r"|bool tensor for result|scalar[ _]type")
_META_DTYPE_MESSAGES = ("Expected out tensor to have dtype", "Attempting to cast from")


def _stand_in(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and a.device.type == "tpu":
        if a.numel() > _MAX_NUMEL:
            raise _TooBig
        return torch.zeros(tuple(a.shape), dtype=a.dtype)
    if isinstance(a, (list, tuple)):
        return type(a)(_stand_in(x) for x in a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return torch.device("cpu")
    return a


class _TooBig(Exception):
    pass


def cpu_verdict(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> BaseException | None | bool:
    """Runs ``op`` on CPU stand-ins of its arguments: the exception CPU raises, None when CPU
    accepts the call, False when it can't be asked (a stand-in too big, a dtype CPU lacks)."""
    # out tensors stand in with no elements: CPU resizes those silently (its resize warning would
    # be flushed to the caller, who gets the dispatcher's own at every call)
    outs = {a.name for a in op._schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write}
    try:
        cargs = _stand_in(args)
        ckw = {k: torch.empty(0, dtype=v.dtype) if k in outs and isinstance(v, torch.Tensor) else _stand_in(v)
               for k, v in kwargs.items()}
    except _TooBig:
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the stand-in out tensors' resize warning
            op(*cargs, **ckw)
    except NotImplementedError:
        return False
    except Exception as e:
        # CPU's verdict on the out dtype; any other refusal (a dtype CPU has no kernel for, a
        # check of the stand-ins' zero values) is no verdict on it
        return e if _ABOUT_DTYPES.search(str(e)) and "not implemented for" not in str(e) else False
    return None


def is_meta_dtype_refusal(e: BaseException) -> bool:
    """Whether ``e`` is the meta kernel's out wrapper refusing an out tensor's dtype."""
    text = str(e)
    return any(m in text for m in _META_DTYPE_MESSAGES)
