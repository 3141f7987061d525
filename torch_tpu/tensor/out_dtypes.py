"""CPU's dtype rules that torch's meta kernels don't know, asked of CPU itself.

Two kinds: an ``out=`` tensor whose dtype differs from the op's result (below), and an integer
or bool input that CPU's kernel has no implementation for (:func:`integral_refusal`).

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
_SMALL = 4096  # a bigger stand-in is shrunk to one element per dim (int mm of a big matrix is slow on CPU)

# The messages of torch's out wrapper (torch/_prims_common/wrappers.py) about an out tensor's
# dtype: when CPU accepts that dtype, the meta kernel's refusal is not CPU's behaviour.
_ABOUT_DTYPES = re.compile(r"dtype|result type|non-boolean|can't be cast|for complex tensors"
                           r"|bool tensor for result|scalar[ _]type")
_META_DTYPE_MESSAGES = ("Expected out tensor to have dtype", "Attempting to cast from")


def _stand_in(a: Any, shrink: bool = False) -> Any:
    """A CPU stand-in for one argument of a call CPU is asked about: zeros of a tpu tensor's shape
    and dtype, CPU for the tpu device, a fresh generator for the user's (asking must not advance
    it). A tensor of more than ``_MAX_NUMEL`` elements raises ``_TooBig``, or with ``shrink`` (a
    question about dtypes only) more than ``_SMALL`` stand in with one element per dimension."""
    if isinstance(a, torch.Tensor) and a.device.type == "tpu":
        n = a.numel()
        if shrink and n > _SMALL:
            return torch.zeros(tuple(min(d, 1) for d in a.shape), dtype=a.dtype)
        if n > _MAX_NUMEL:
            raise _TooBig
        return torch.zeros(tuple(a.shape), dtype=a.dtype)
    if isinstance(a, (list, tuple)):
        return type(a)(_stand_in(x, shrink) for x in a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return torch.device("cpu")
    if isinstance(a, torch.Generator):
        return torch.Generator()
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


# CPU's refusals of an integer or bool input, by the kernel's dtype switch ("softplus_cpu" not
# implemented for 'Long') or by its own check ("std and var only support floating point", "argmax():
# does not support bool input", "Boolean inputs not supported for relu"). A refusal CPU calls its
# own ("topk does not support bool dtypes on CPU") is not adopted.
_INTEGRAL_REFUSAL = re.compile(r"not implemented for '(Bool|Byte|Char|Short|Int|Long|UInt\d+)'"
                               r"|only supports? floating|does not support bool"
                               r"|[Bb]oolean inputs? (is |are )?not supported"
                               r"|Integer division with|can't be cast to the desired output type")
_INTEGRAL = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.uint16, torch.uint32, torch.uint64})


def _has_integral(args: Any) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.dtype in _INTEGRAL:
                return True
        elif isinstance(a, (list, tuple)) and a and _has_integral(a):
            return True
    return False


# CPU kernels that index memory by their integer inputs' values without checking them: zero
# stand-ins corrupt the heap there (CPU's _ctc_loss_backward with all-zero targets), and their
# integer inputs (targets, lengths) are what they take anyway
_TRUSTS_ITS_VALUES = frozenset(("aten::_ctc_loss", "aten::_ctc_loss_backward", "aten::ctc_loss"))


def integral_refusal(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> BaseException | None:
    """CPU's refusal of this call's integer or bool inputs, or None: the op run once on zero
    CPU stand-ins, when its program is built. torch's meta kernels accept what XLA computes
    (``softplus``, ``lerp`` or ``hardshrink`` of an int tensor, ``addcmul`` of bools), where CPU
    raises; tpu raises as CPU does. Only a refusal about the dtype is adopted: an error of the
    stand-ins' zeros or shapes is no verdict (and a call CPU accepts runs on tpu as before)."""
    if not (_has_integral(args) or (kwargs and _has_integral(kwargs.values()))):
        return None
    return _cpu_refusal(op, args, kwargs, _INTEGRAL_REFUSAL)


# Those, and a dtype CPU's kernel has no case for, whatever the dtype ("lshift_cpu" not implemented
# for 'Float'), or CPU's own words for one ("Negation, the `-` operator, on a bool tensor is not supported")
_ANY_DTYPE_REFUSAL = re.compile(_INTEGRAL_REFUSAL.pattern
                                + r"|not implemented for '\w+'|on a bool tensor is not supported")


def dtype_refusal(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> BaseException | None:
    """CPU's refusal of this call's dtypes, or None, asked after the meta kernel refused the call.

    A meta kernel's dtype check is its own RuntimeError ("lshift: Expected input tensor to have an
    integral dtype"), where CPU's dtype switch raises NotImplementedError, or RuntimeError in an
    older torch; the user's except clause must see CPU's. Runs only on this error path, so any
    dtype is asked, float ones included. Only a refusal of a dtype is adopted."""
    return _cpu_refusal(op, args, kwargs, _ANY_DTYPE_REFUSAL)


def _cpu_refusal(op: torch._ops.OpOverload, args: tuple, kwargs: dict, words: re.Pattern) -> BaseException | None:
    """The exception CPU raises for this call on zero stand-ins when its message matches ``words``
    (a refusal of a dtype), else None. A refusal CPU calls its own ("... on CPU") is not adopted."""
    if op._schema.name in _TRUSTS_ITS_VALUES:
        return None
    try:
        cargs, ckw = _stand_in(args, True), {k: _stand_in(v, True) for k, v in kwargs.items()}
        # a random op CPU accepts draws from CPU's generator, which the user's CPU draws must not see
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            op(*cargs, **ckw)
    except Exception as e:  # noqa: BLE001 - only a dtype refusal is an answer
        text = str(e)
        if words.search(text) and "on CPU" not in text:
            return e
    return None


_verdicts: dict = {}  # (op, the call's dtypes and other arguments) -> integral_refusal's answer


def _dtype_key(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return a.dtype, a.dim()
    if isinstance(a, (list, tuple)):
        return tuple(_dtype_key(x) for x in a)
    try:
        hash(a)
    except TypeError:
        return type(a)
    return a


def integral_refusal_by_dtypes(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> BaseException | None:
    """:func:`integral_refusal`, remembered per op and dtypes: for ops that run at every call
    without a program of their own to build (a decomposition), where CPU is asked once."""
    if not (_has_integral(args) or (kwargs and _has_integral(kwargs.values()))):
        return None
    key = (op, _dtype_key(args), _dtype_key(tuple(sorted(kwargs.items()))))
    try:
        return _verdicts[key]
    except KeyError:
        pass
    if len(_verdicts) > 4096:
        _verdicts.clear()
    verdict = _verdicts[key] = integral_refusal(op, args, kwargs)
    return verdict


def is_meta_dtype_refusal(e: BaseException) -> bool:
    """Whether ``e`` is the meta kernel's out wrapper refusing an out tensor's dtype."""
    text = str(e)
    return any(m in text for m in _META_DTYPE_MESSAGES)
