"""Pointwise ops: arithmetic, comparisons, bitwise ops, unary math and activations.

Results are cast by the dispatcher to the dtype torch's type promotion chose, so a lowering may
compute in a wider type. Two rules keep values equal to CPU's:

* binary ops first bring their operands to torch's common dtype (:func:`_common`), which is not
  jax's: a 0-dim tensor or a Python number does not widen a dimensioned tensor of its category;
* bfloat16/float16 math runs in float32 and is rounded once at the end, as CPU's ``opmath`` does.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch
from jax import lax

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import LOWERINGS, aten, kernel_from_lowerings, lower
from torch_tpu.runtime import executor, fused, metrics
from torch_tpu.tensor import storage as _storage
from torch_tpu.tensor import transfer as _transfer
from torch_tpu.tensor import value_checks as checks
from torch_tpu.tensor.storage import new_tensor

_LOW = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_F32 = np.dtype(jnp.float32)


# ------------------------------------------------------------------------------------ promotion
def _category(dt: np.dtype) -> int:
    if dt == np.bool_:
        return 0
    if jnp.issubdtype(dt, jnp.integer):
        return 1
    if jnp.issubdtype(dt, jnp.floating):
        return 2
    return 3


def _kind(x) -> str:
    """'wrapped' for Python numbers (weakly typed in jax), 'zero' for 0-dim arrays, else 'dim'."""
    if isinstance(x, (bool, int, float, complex)):
        return "wrapped"
    if getattr(getattr(x, "aval", x), "weak_type", False):
        return "wrapped"
    return "zero" if jnp.ndim(x) == 0 else "dim"


def _promote(dts: list) -> np.dtype | None:
    out = None
    for d in dts:
        out = d if out is None else np.dtype(jnp.promote_types(out, d))
    return out


def _combine(higher, lower_):
    """torch's ``combine_categories``: a lower-priority group only matters if its category is higher."""
    if higher is None:
        return lower_
    if lower_ is None:
        return higher
    ch, cl = _category(higher), _category(lower_)
    if ch == 3:
        return higher
    if cl == 3:
        return np.dtype(jnp.complex128) if higher == np.float64 else (
            np.dtype(jnp.complex64) if ch == 2 else lower_)
    if ch == 2:
        return higher
    if ch == 0 or cl == 2:
        return np.dtype(jnp.promote_types(higher, lower_))
    return higher


def result_dtype(*xs) -> np.dtype:
    """The dtype torch's type promotion gives to an op over ``xs`` (None entries ignored)."""
    groups: dict[str, list] = {"dim": [], "zero": [], "wrapped": []}
    for x in xs:
        if x is None:
            continue
        k = _kind(x)
        dt = np.dtype(jnp.result_type(x))
        if k == "wrapped":  # a Python number counts by category, at torch's default precision
            dt = [np.dtype(np.bool_), np.dtype(np.int64), _F32, np.dtype(jnp.complex64)][_category(dt)]
        groups[k].append(dt)
    wrapped = _promote(groups["wrapped"])
    return _combine(_promote(groups["dim"]), _combine(_promote(groups["zero"]), wrapped))


def _opmath(dt: np.dtype) -> np.dtype:
    return _F32 if dt in _LOW else dt


def _common(*xs, floating: bool = False):
    """``xs`` cast to torch's common dtype (float32 for low precision, or when ``floating``
    and the common dtype is integral)."""
    common = result_dtype(*xs)
    dt = _opmath(common)
    if floating and _category(dt) < 2:
        dt = common = _F32
    return tuple(None if x is None else jnp.asarray(jnp.asarray(_wrap_int(x, common), common), dt) for x in xs)


def _wrap_int(x, dt: np.dtype):
    """A Python int outside an integer dtype's range wraps around as CPU's cast does (int8 + 300
    adds 44), where jax refuses it."""
    if type(x) is int and dt.kind in "iu":
        info = np.iinfo(dt)
        if not info.min <= x <= info.max:
            return int(np.array(x, np.int64).astype(dt)) if -(1 << 63) <= x < (1 << 63) else x
    return x


def _fl(x):
    """A unary float op's input: integers and bools become float32, low precision float32."""
    dt = np.dtype(jnp.result_type(x))
    if _category(dt) < 2 or dt in _LOW:
        return jnp.asarray(x, _F32)
    return x


def _is_int(x) -> bool:
    return _category(np.dtype(jnp.result_type(x))) < 2


# ----------------------------------------------------------------------------------- arithmetic
def _scaled(b, alpha):
    return b if alpha is None else b * alpha


def _is_bool(x) -> bool:
    return x.dtype == torch.bool if isinstance(x, torch.Tensor) else isinstance(x, bool)


def _alpha_meta(op, subtracts: bool = False):
    """The meta of add/sub/rsub with CPU's checks of ``alpha`` against the result dtype (torch's
    meta kernel raises a ValueError of its own, or accepts a bool alpha on integers) and, for
    subtraction, of bool operands."""

    def meta(self, other, alpha=1, **out):
        if subtracts and (_is_bool(self) or _is_bool(other)):
            if _is_bool(self) and _is_bool(other):
                raise RuntimeError("Subtraction, the `-` operator, with two bool tensors is not supported. "
                                   "Use the `^` or `logical_xor()` operator instead.")
            raise RuntimeError("Subtraction, the `-` operator, with a bool tensor is not supported. If you are "
                               "trying to invert a mask, use the `~` or `logical_not()` operator instead.")
        if alpha is not None:
            dt = torch.result_type(self, other)
            if isinstance(alpha, bool) and dt != torch.bool:
                raise RuntimeError("Boolean alpha only supported for Boolean results.")
            if isinstance(alpha, float) and not (dt.is_floating_point or dt.is_complex):
                raise RuntimeError("For integral input tensors, argument alpha must not be a floating point number.")
            if isinstance(alpha, complex) and not dt.is_complex:
                raise RuntimeError("For non-complex input tensors, argument alpha must not be a complex number.")
        return op(self, other, alpha=alpha, **out)

    return meta


@lower(aten.add.Tensor, aten.add.Scalar, meta=_alpha_meta(aten.add))
def add(self, other, alpha=None):
    a, b, al = _common(self, other, alpha)
    if al is not None and al.dtype == np.bool_:
        return jnp.logical_or(a, jnp.logical_and(b, al))
    return a + b if alpha is None else a + b * al


@lower(aten.sub.Tensor, aten.sub.Scalar, meta=_alpha_meta(aten.sub, subtracts=True))
def sub(self, other, alpha=None):
    a, b, al = _common(self, other, alpha)
    return a - _scaled(b, al)


@lower(aten.rsub.Tensor, aten.rsub.Scalar, meta=_alpha_meta(aten.rsub, subtracts=True))
def rsub(self, other, alpha=None):
    a, b, al = _common(self, other, alpha)
    return b - _scaled(a, al)


@lower(aten.mul.Tensor, aten.mul.Scalar)
def mul(self, other):
    a, b = _common(self, other)
    if a.dtype == np.bool_:
        return jnp.logical_and(a, b)
    return a * b


def _floor_div(a, b):
    """torch's floor division: Python semantics for integers; for floats the fmod-based form that
    returns exactly what CPU returns (a/b when b is 0)."""
    if _is_int(a):
        return jnp.floor_divide(a, b)
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    fl = jnp.floor(div)
    fl = jnp.where(div - fl > 0.5, fl + 1, fl)
    fl = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), fl)
    return jnp.where(b == 0, a / b, fl)


def _is_zero(xp, a):
    """Zero divisors (a check's predicate)."""
    return a == 0


def _is_bool(x: Any) -> bool:
    return x.dtype is torch.bool if isinstance(x, torch.Tensor) else type(x) is bool


def _check_int_division(kernel: str, self: Any, other: Any) -> None:
    """CPU's refusals of an integer division (floor, trunc, remainder, fmod), before XLA's
    integer division returns arbitrary values for them: bool operands (CPU has no bool kernel:
    NotImplementedError naming it), and a zero divisor ("ZeroDivisionError"), checked at the op
    when the divisor's values are on the host, else at the next host read."""
    if isinstance(self, torch.Tensor) and (self.dtype.is_floating_point or self.dtype.is_complex):
        return
    if _is_bool(self) and _is_bool(other):
        raise NotImplementedError(f'"{kernel}" not implemented for \'Bool\'')
    if isinstance(other, torch.Tensor):
        if other.dtype.is_floating_point or other.dtype.is_complex or type(self) is float:
            return
        checks.check_values(other, _is_zero, (), lambda v: RuntimeError("ZeroDivisionError"))
    elif type(other) in (int, bool) and other == 0 and type(self) is not float:
        raise RuntimeError("ZeroDivisionError")


def _check_div_mode(self: Any, other: Any, rounding_mode: str | None = None, **_: Any) -> None:
    if rounding_mode is not None:  # true division of integers is float's: x / 0 is inf
        _check_int_division(f"div_{rounding_mode}_cpu", self, other)


def _check_floor_divide(self: Any, other: Any, **_: Any) -> None:
    _check_int_division("div_floor_cpu", self, other)


def _check_remainder(self: Any, other: Any, **_: Any) -> None:
    _check_int_division("remainder_cpu", self, other)


def _check_fmod(self: Any, other: Any, **_: Any) -> None:
    _check_int_division("fmod_cpu", self, other)


@lower(aten.div.Tensor, aten.div.Scalar)
@lower(aten.div.Tensor_mode, aten.div.Scalar_mode, check=_check_div_mode)
def div(self, other, rounding_mode=None):
    if rounding_mode is None:
        a, b = _common(self, other, floating=True)
        if jnp.iscomplexobj(b):  # Smith's division: no overflow or underflow in |b|^2
            return _complex_div(a, b)
        return a / b
    a, b = _common(self, other)
    if rounding_mode == "floor":
        return _floor_div(a, b)
    if _is_int(a):
        return lax.div(*jnp.broadcast_arrays(a, b))  # C division truncates, as torch's 'trunc'
    return jnp.trunc(a / b)


@lower(aten.floor_divide.default, aten.floor_divide.Scalar, check=_check_floor_divide)
def floor_divide(self, other):
    a, b = _common(self, other)
    return _floor_div(a, b)


@lower(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor, check=_check_remainder)
def remainder(self, other):
    a, b = _common(self, other)
    if _is_int(a):
        return jnp.remainder(a, b)
    mod = jnp.fmod(a, b)
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@lower(aten.fmod.Tensor, aten.fmod.Scalar, check=_check_fmod)
def fmod(self, other):
    a, b = _common(self, other)
    return jnp.fmod(a, b)


@lower(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def pow_(self, exponent):
    a, b = _common(self, exponent)
    if a.dtype == np.bool_:
        return jnp.logical_or(a, jnp.logical_not(b))
    if jnp.iscomplexobj(a):
        return _complex_pow(a, b)
    if _is_int(a) and jnp.issubdtype(b.dtype, jnp.signedinteger):
        # CPU's integer power of a negative exponent: 1 for a base of 1, +-1 by parity for -1, else
        # 0 (XLA's integer power gives arbitrary values there)
        one = jnp.ones_like(a)
        odd = (b % 2) != 0
        negative = jnp.where(a == 1, one, jnp.where(a == -1, jnp.where(odd, -one, one), jnp.zeros_like(a)))
        return jnp.where(b < 0, negative, jnp.power(a, jnp.maximum(b, 0)))
    return jnp.power(a, b)


def _complex_pow(a, b):
    """a ** b of complex operands as CPU's cpow computes it away from a = 0: exp(b log a), with
    exp's special values (a product whose real part underflows is 0, where XLA's power gives NaN
    for a huge imaginary part). A zero base keeps XLA's answer."""
    return jnp.where(a == 0, jnp.power(a, b), _exp(b * jnp.log(jnp.where(a == 0, jnp.ones_like(a), a))))


def _check_pow(self, exponent, **out):
    if not self.dtype.is_floating_point and not self.dtype.is_complex and type(exponent) is int and exponent < 0:
        raise RuntimeError("Integers to negative integer powers are not allowed.")


@lower(aten.pow.Tensor_Scalar, static_scalars=True, check=_check_pow)
def pow_tensor_scalar(self, exponent):
    """An integer exponent is a compile-time constant: x**2 is x*x, as on CPU."""
    if isinstance(exponent, (bool, int)):
        dt = _opmath(result_dtype(self, exponent))
        x = jnp.asarray(self, dt)
        if dt == np.bool_:
            return x if exponent else jnp.ones_like(x)
        if exponent >= 0:
            return lax.integer_pow(x, exponent)
        if _category(dt) < 2:
            one = jnp.ones_like(x)
            return jnp.where(jnp.abs(x) == 1, jnp.where((exponent % 2 == 1) & (x < 0), -one, one), 0)
        return 1 / lax.integer_pow(x, -exponent)
    a, b = _common(self, exponent)
    b_is_two = b == 2
    return jnp.where(b_is_two, a * a, jnp.power(a, b))


def _binary_float(fn):
    def lowering(self, other):
        a, b = _common(self, other, floating=True)
        return fn(a, b)

    lowering.__doc__ = f"{fn.__name__} over torch's common floating dtype."
    return lowering


lower(aten.atan2.default)(_binary_float(jnp.arctan2))
lower(aten.hypot.default)(_binary_float(jnp.hypot))
lower(aten.copysign.Tensor, aten.copysign.Scalar)(_binary_float(jnp.copysign))


def _logaddexp(a, b):
    """jnp.logaddexp, and for complex inputs CPU's own formula (:func:`complex_logaddexp`)."""
    return complex_logaddexp(a, b) if jnp.iscomplexobj(a) else jnp.logaddexp(a, b)


def complex_logaddexp(a, b):
    """CPU's complex logaddexp: the larger by real part plus ``log1p(exp(smaller - larger))``. Its
    imaginary part is the larger input's, not reduced to (-pi, pi] as a complex log would (jnp's
    answer can differ by multiples of 2 pi); logcumsumexp accumulates with it too."""
    first = jnp.real(a) >= jnp.real(b)
    hi, lo = jnp.where(first, a, b), jnp.where(first, b, a)
    out = hi + jnp.log1p(jnp.exp(lo - hi))
    both_inf = jnp.isinf(jnp.real(lo)) & (jnp.real(lo) == jnp.real(hi))
    # both real parts -inf: the smaller itself; both +inf: an infinite modulus of no defined angle (CPU's inf+nanj)
    # (inf+0j twice: inf+0j)
    real_infs = (jnp.imag(lo) == 0) & (jnp.imag(hi) == 0)
    plus_inf = jnp.where(real_infs, jnp.asarray(complex(np.inf, 0), out.dtype),
                         jnp.asarray(complex(np.inf, np.nan), out.dtype))
    out = jnp.where(both_inf, jnp.where(jnp.real(lo) < 0, lo, plus_inf), out)
    nan = jnp.isnan(jnp.real(lo)) | jnp.isnan(jnp.imag(lo)) | jnp.isnan(jnp.real(hi)) | jnp.isnan(jnp.imag(hi))
    return jnp.where(nan, jnp.asarray(complex(np.nan, np.nan), out.dtype), out)


lower(aten.logaddexp.default)(_binary_float(_logaddexp))
lower(aten.logaddexp2.default)(_binary_float(jnp.logaddexp2))


def _igamma_edges(a, x, value, lower_tail: bool):
    """CPU's values at the edges of the regularized incomplete gamma functions, where XLA's
    series give NaN or the other tail: a = 0 (the whole mass at 0), x = 0, an infinite a (no
    mass below any finite x) or x; a negative argument is NaN. ``value`` elsewhere."""
    one, zero = (1.0, 0.0) if lower_tail else (0.0, 1.0)
    nan = jnp.nan
    out = jnp.where(jnp.isinf(x), one, value)
    out = jnp.where(jnp.isinf(a), jnp.where(jnp.isinf(x), nan, zero), out)
    out = jnp.where(x == 0, zero, out)
    out = jnp.where(a == 0, jnp.where(x > 0, one, nan), out)
    return jnp.where((x < 0) | (a < 0), nan, out).astype(value.dtype)


@lower(aten.igamma.default)
def igamma(self, other):
    a, x = _common(self, other, floating=True)
    return _igamma_edges(a, x, jsp.gammainc(a, x), lower_tail=True)


@lower(aten.igammac.default)
def igammac(self, other):
    a, x = _common(self, other, floating=True)
    return _igamma_edges(a, x, jsp.gammaincc(a, x), lower_tail=False)


@lower(aten.nextafter.default)
def nextafter(self, other):
    a, b = _common(self, other)
    return jnp.nextafter(a, b)


@lower(aten.xlogy.Tensor, aten.xlogy.Scalar_Other, aten.xlogy.Scalar_Self)
def xlogy(self, other):
    x, y = _common(self, other, floating=True)
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(x), x * jnp.log(y)))


@lower(aten.special_xlog1py.default, aten.special_xlog1py.other_scalar, aten.special_xlog1py.self_scalar)
def xlog1py(self, other):
    x, y = _common(self, other, floating=True)
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, jnp.zeros_like(x), x * jnp.log1p(y)))


def _real_only_meta(name: str, op):
    """The meta of an ordering op (maximum, fmax...): CPU has no kernel for complex operands, and
    says so, where torch's meta kernel computes a complex result."""

    def meta(self, other, **out):
        if any(isinstance(t, torch.Tensor) and t.is_complex() for t in (self, other)):
            raise RuntimeError(f"{name} not implemented for complex tensors.")
        return op(self, other, **out)

    return meta


def _heaviside_meta(self, values, **out):
    """CPU's heaviside refuses complex operands, then operands of two dtypes (no promotion)."""
    if self.is_complex() or values.is_complex():
        raise RuntimeError("heaviside is not yet implemented for complex tensors.")
    if self.dtype != values.dtype:
        raise RuntimeError("heaviside is not yet implemented for tensors with different dtypes.")
    return aten.heaviside(self, values, **out)


@lower(aten.maximum.default, meta=_real_only_meta("maximum", aten.maximum))
def maximum(self, other):
    a, b = _common(self, other)
    return jnp.maximum(a, b)


@lower(aten.minimum.default, meta=_real_only_meta("minimum", aten.minimum))
def minimum(self, other):
    a, b = _common(self, other)
    return jnp.minimum(a, b)


@lower(aten.fmax.default, meta=_real_only_meta("fmax", aten.fmax))
def fmax(self, other):
    a, b = _common(self, other)
    return jnp.fmax(a, b)


@lower(aten.fmin.default, meta=_real_only_meta("fmin", aten.fmin))
def fmin(self, other):
    a, b = _common(self, other)
    return jnp.fmin(a, b)


def _clamp(x, lo, hi):
    """min(max(x, lo), hi) with NaN propagated, as CPU's clamp (lo > hi gives hi)."""
    if lo is not None:
        x = jnp.maximum(x, lo)
    if hi is not None:
        x = jnp.minimum(x, hi)
    return x


def _check_clamp(self, min=None, max=None, **out) -> None:  # noqa: A002
    """CPU's error for a clamp without bounds: torch's Python meta kernel raises a ValueError."""
    if min is None and max is None:
        raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")


@lower(aten.clamp.default, aten.clamp.Tensor, check=_check_clamp)
def clamp(self, min=None, max=None):  # noqa: A002
    x, lo, hi = _common(self, min, max)
    return _clamp(x, lo, hi)


@lower(aten.clamp_min.default, aten.clamp_min.Tensor)
def clamp_min(self, min):  # noqa: A002
    x, lo = _common(self, min)
    return _clamp(x, lo, None)


@lower(aten.clamp_max.default, aten.clamp_max.Tensor)
def clamp_max(self, max):  # noqa: A002
    x, hi = _common(self, max)
    return _clamp(x, None, hi)


@lower(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self, end, weight):
    """CPU's two-sided formula, exact at both ends."""
    a, b, w = _common(self, end, weight)
    diff = b - a
    return jnp.where(jnp.abs(w) < 0.5, a + w * diff, b - diff * (1 - w))


@lower(aten.addcmul.default)
def addcmul(self, tensor1, tensor2, value=1):
    a, t1, t2, v = _common(self, tensor1, tensor2, value)
    return a + v * t1 * t2


@lower(aten.addcdiv.default)
def addcdiv(self, tensor1, tensor2, value=1):
    a, t1, t2, v = _common(self, tensor1, tensor2, value)
    return a + v * (t1 / t2)


def _where_meta(condition, self, other, **out):
    """CPU takes a uint8 condition (with its deprecation warning) and refuses other non-bool ones
    in its words, where torch's meta kernel refuses every non-bool one: CPU says which, on empty
    stand-ins of the same dtypes."""
    if condition.dtype != torch.bool:
        torch.where(torch.empty(0, dtype=condition.dtype), torch.empty(0, dtype=self.dtype),
                    torch.empty(0, dtype=other.dtype))
        condition = condition.to(torch.bool)
    return aten.where(condition, self, other, **out)


@lower(aten.where.self, meta=_where_meta)
def where(condition, self, other):
    a, b = _common(self, other)
    return jnp.where(condition.astype(bool), a, b)


def _masked_fill_meta(self, mask, value, **out):
    """CPU's refusals, in its words: a mask that is not bool (torch's meta says "expected predicate
    to be bool", and its in-place form lets uint8 through), and a value tensor with dimensions."""
    if mask.dtype != torch.bool:
        # CPU's message names the mask's C++ type ("unsigned char"): CPU says it, on empty stand-ins
        torch.empty(0, dtype=self.dtype).masked_fill_(torch.empty(0, dtype=mask.dtype), 0)
    if isinstance(value, torch.Tensor) and value.dim():
        raise RuntimeError("masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
                           f"{value.dim()} dimension(s).")
    return aten.masked_fill(self, mask, value, **out)


@lower(aten.masked_fill.Scalar, aten.masked_fill.Tensor, runtime_numbers=("value",), meta=_masked_fill_meta)
def masked_fill(self, mask, value):
    return jnp.where(mask.astype(bool), jnp.asarray(value).astype(self.dtype), self)


@lower(aten.heaviside.default, meta=_heaviside_meta)
def heaviside(self, values):
    a, v = _common(self, values)
    return jnp.where(a == 0, v, (a > 0).astype(a.dtype))


# ---------------------------------------------------------------------------------- comparisons
def _compare(fn):
    def lowering(self, other):
        a, b = _common(self, other)
        return fn(a, b)

    lowering.__doc__ = f"{fn.__name__} in torch's common dtype (a float16 tensor against a float32 0-dim one "
    "compares in float16)."
    return lowering


for _name, _fn in (("eq", jnp.equal), ("ne", jnp.not_equal), ("lt", jnp.less), ("le", jnp.less_equal),
                   ("gt", jnp.greater), ("ge", jnp.greater_equal)):
    lower(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar)(_compare(_fn))


def _truth(x):
    return x if x.dtype == np.bool_ else x != 0


@lower(aten.logical_and.default)
def logical_and(self, other):
    return _truth(self) & _truth(other)


@lower(aten.logical_or.default)
def logical_or(self, other):
    return _truth(self) | _truth(other)


@lower(aten.logical_xor.default)
def logical_xor(self, other):
    return _truth(self) ^ _truth(other)


@lower(aten.logical_not.default)
def logical_not(self):
    return ~_truth(self)


for _name, _fn in (("bitwise_and", jnp.bitwise_and), ("bitwise_or", jnp.bitwise_or),
                   ("bitwise_xor", jnp.bitwise_xor)):
    lower(getattr(aten, _name))(_compare(_fn))


@lower(aten.bitwise_not.default)
def bitwise_not(self):
    return jnp.logical_not(self) if self.dtype == np.bool_ else jnp.invert(self)


def _shift_out_of_range(a, b):
    """CPU shifts by a negative amount, or one at or past the bit width, give 0 (left, or right on
    unsigned) or the sign fill (right on signed)."""
    bits = a.dtype.itemsize * 8
    return (b < 0) | (b >= bits), bits


@lower(aten.bitwise_left_shift, aten.__lshift__.Tensor, aten.__lshift__.Scalar)
def left_shift(self, other):
    a, b = _common(self, other)
    out, _ = _shift_out_of_range(a, b)
    return jnp.where(out, jnp.zeros_like(a), jnp.left_shift(a, jnp.where(out, 0, b)))


@lower(aten.bitwise_right_shift, aten.__rshift__.Tensor, aten.__rshift__.Scalar)
def right_shift(self, other):
    a, b = _common(self, other)
    out, bits = _shift_out_of_range(a, b)
    if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        return jnp.where(out, jnp.zeros_like(a), jnp.right_shift(a, jnp.where(out, 0, b)))
    return jnp.right_shift(a, jnp.where(out, bits - 1, b))


# ----------------------------------------------------------------------------------- unary math
def _unary_float(fn, doc: str = ""):
    def lowering(self):
        return fn(_fl(self))

    lowering.__doc__ = doc or f"{getattr(fn, '__name__', 'op')} in float32 for integer and low-precision inputs."
    return lowering


for _op, _fn in (
    (aten.expm1, jnp.expm1), (aten.log, jnp.log),
    (aten.log2, jnp.log2), (aten.log10, jnp.log10), (aten.log1p, jnp.log1p),
    (aten.sin, jnp.sin), (aten.cos, jnp.cos), (aten.tan, jnp.tan),
    (aten.asin, jnp.arcsin), (aten.acos, jnp.arccos), (aten.sinh, jnp.sinh),
    (aten.cosh, jnp.cosh), (aten.tanh, jnp.tanh), (aten.acosh, jnp.arccosh),
    (aten.erf, lax.erf), (aten.erfc, lax.erfc), (aten.erfinv, lax.erf_inv),
    (aten.i0, jsp.i0), (aten.special_i0e, jsp.i0e), (aten.special_i1, jsp.i1),
    (aten.special_i1e, jsp.i1e), (aten.special_ndtri, jsp.ndtri), (aten.special_log_ndtr, jsp.log_ndtr),
    (aten.special_erfcx, jsp.erfcx), (aten.special_entr, jsp.entr),
    (aten.special_modified_bessel_i0, jsp.i0), (aten.special_modified_bessel_i1, jsp.i1),
):
    lower(_op)(_unary_float(_fn))


@lower(aten.lgamma.default)
def lgamma(self):
    """log|gamma|, exactly 0 at 1 and 2 as on CPU (XLA's approximation is a few ulps off there)."""
    x = _fl(self)
    return jnp.where((x == 1) | (x == 2), jnp.zeros_like(x), lax.lgamma(x))


def _complex_div(a, b):
    """a / b for complex b as CPU's (and NumPy's) Smith division computes it: the ratio of b's
    parts scales the quotient, so a b with an infinite or NaN part gives NaN where XLA's division
    gives 0 (1 / (inf + i*inf) is nan + i*nan on CPU)."""
    a = jnp.asarray(a, b.dtype)
    ar, ai, c, d = jnp.real(a), jnp.imag(a), jnp.real(b), jnp.imag(b)
    c_big = jnp.abs(c) >= jnp.abs(d)
    zero = (c == 0) & (d == 0)
    rat = jnp.where(c_big, d / jnp.where(zero, 1, c), c / d)
    # divided by, not multiplied by its reciprocal: 1 / |b| of a huge b is subnormal, which XLA
    # flushes to zero (CPU's (max/2 + i max/2) / itself is 1, not 0)
    den = jnp.where(c_big, c + d * rat, d + c * rat)
    real = jnp.where(c_big, ar + ai * rat, ar * rat + ai) / den
    imag = jnp.where(c_big, ai - ar * rat, ai * rat - ar) / den
    real = jnp.where(zero, ar / jnp.abs(c), real)  # division by zero: a complex inf or nan
    imag = jnp.where(zero, ai / jnp.abs(d), imag)
    return lax.complex(real, imag)


def _exp(x):
    """exp; of a complex z, C99's (and CPU's) values where exp(re) * (cos + i sin) would multiply
    an infinity by NaN or by zero: an imaginary part of 0 stays exactly 0 (exp(inf + 0j) is
    inf + 0j), exp(-inf + i*inf or nan) is 0, exp(inf + i*inf or nan) is inf + i*nan."""
    if not jnp.iscomplexobj(x):
        return jnp.exp(x)
    re, im = jnp.real(x), jnp.imag(x)
    mag = jnp.exp(re)
    real = jnp.where(im == 0, mag, mag * jnp.cos(im))
    imag = jnp.where(im == 0, im, mag * jnp.sin(im))
    im_bad = ~jnp.isfinite(im)
    real = jnp.where(im_bad & (re == -jnp.inf), 0.0, jnp.where(im_bad & (re == jnp.inf), jnp.inf, real))
    imag = jnp.where(im_bad & (re == -jnp.inf), 0.0, jnp.where(im_bad & (re == jnp.inf), jnp.nan, imag))
    return lax.complex(real.astype(re.dtype), imag.astype(re.dtype))


def _sqrt(x):
    """sqrt; of a complex z with an infinite imaginary part, inf + i*im whatever the real part
    (NaN included), and on the branch cut the imaginary part's sign (-0's too: sqrt(-1 - 0j) is
    -1j), as C99's csqrt and CPU give it."""
    if not jnp.iscomplexobj(x):
        return jnp.sqrt(x)
    re, im = jnp.real(x), jnp.imag(x)
    r = jnp.sqrt(lax.complex(re, jnp.abs(im)))  # on the upper half, given im's sign back (also -0's)
    r = lax.complex(jnp.real(r), jnp.copysign(jnp.imag(r), im))
    return jnp.where(jnp.isinf(im), lax.complex(jnp.full_like(im, jnp.inf), im), r)


@lower(aten.exp.default)
def exp(self):
    return _exp(_fl(self))


@lower(aten.exp2.default)
def exp2(self):
    """2**x; of a complex z, exp(z * ln 2) with each part scaled on its own (a complex product
    would turn inf + 0j into inf + i*nan)."""
    x = _fl(self)
    if not jnp.iscomplexobj(x):
        return jnp.exp2(x)
    ln2 = math.log(2.0)
    return _exp(lax.complex(jnp.real(x) * ln2, jnp.imag(x) * ln2))


@lower(aten.sqrt.default)
def sqrt(self):
    return _sqrt(_fl(self))


@lower(aten.rsqrt.default)
def rsqrt(self):
    x = _fl(self)
    return _complex_div(1, _sqrt(x)) if jnp.iscomplexobj(x) else lax.rsqrt(x)


@lower(aten.sigmoid.default)
def sigmoid(self):
    """1 / (1 + exp(-x)); for complex x with CPU's exp at infinities and its division."""
    x = _fl(self)
    if not jnp.iscomplexobj(x):
        return jax.nn.sigmoid(x)
    return _complex_div(1, 1 + _exp(-x))


@lower(aten.atan.default)
def atan(self):
    """arctan; of nan + i*inf (either sign) nan + i*0 with the sign of the imaginary part, and on
    the branch cut the real part's sign (-0 + i*inf gives -pi/2), as CPU."""
    x = _fl(self)
    if not jnp.iscomplexobj(x):
        return jnp.arctan(x)
    re, im = jnp.real(x), jnp.imag(x)
    edge = jnp.isnan(re) & jnp.isinf(im)
    r = jnp.arctan(lax.complex(jnp.abs(re), im))  # odd and conjugate-symmetric: re's sign (-0's too)
    r = lax.complex(jnp.copysign(jnp.real(r), re), jnp.imag(r))
    return jnp.where(edge, lax.complex(re, jnp.copysign(jnp.zeros_like(im), im)), r)


@lower(aten.atanh.default)
def atanh(self):
    """arctanh; of +-inf + i*nan, +-0 + i*nan, and on the branch cut the imaginary part's sign
    (inf - 0j gives -i*pi/2), as C99's catanh and CPU give it."""
    x = _fl(self)
    if not jnp.iscomplexobj(x):
        return jnp.arctanh(x)
    re, im = jnp.real(x), jnp.imag(x)
    edge = jnp.isinf(re) & jnp.isnan(im)
    r = jnp.arctanh(lax.complex(re, jnp.abs(im)))  # conjugate-symmetric: im's sign (-0's too)
    r = lax.complex(jnp.real(r), jnp.copysign(jnp.imag(r), im))
    return jnp.where(edge, lax.complex(jnp.copysign(jnp.zeros_like(re), re), im), r)


@lower(aten.asinh.default)
def asinh(self):
    """arcsinh; of a complex z computed on |re| and given re's sign back (asinh is odd and
    conjugate-symmetric), so that -0 + i*y beyond the branch point gets the negative real part
    CPU and C99 give it (XLA's gives +)."""
    x = _fl(self)
    if not jnp.iscomplexobj(x):
        return jnp.arcsinh(x)
    re, im = jnp.real(x), jnp.imag(x)
    r = jnp.arcsinh(lax.complex(jnp.abs(re), im))
    return lax.complex(jnp.copysign(jnp.real(r), re), jnp.imag(r))


@lower(aten.reciprocal.default)
def reciprocal(self):
    x = _fl(self)
    return _complex_div(1, x) if jnp.iscomplexobj(x) else 1 / x


@lower(aten.neg.default)
def neg(self):
    return jnp.negative(self)


@lower(aten.abs.default)
def abs_(self):
    """|x|; of a complex x with an infinite part, inf even when the other part is NaN (C99's
    hypot, as CPU)."""
    if self.dtype == np.bool_:
        return self
    if jnp.iscomplexobj(self):
        re, im = jnp.real(self), jnp.imag(self)
        return jnp.where(jnp.isinf(re) | jnp.isinf(im), jnp.inf, jnp.abs(self)).astype(re.dtype)
    return jnp.abs(self)


@lower(aten.sign.default)
def sign(self):
    """(0 < x) - (x < 0): NaN gives 0, as on CPU."""
    if self.dtype == np.bool_:
        return self
    return (self > 0).astype(self.dtype) - (self < 0).astype(self.dtype)


@lower(aten.sgn.default)
def sgn(self):
    if jnp.iscomplexobj(self):
        mag = jnp.abs(self)
        return jnp.where(mag == 0, jnp.zeros_like(self), self / mag)
    return sign(self)


@lower(aten.angle.default)
def angle(self):
    if jnp.iscomplexobj(self):
        return jnp.angle(self)
    x = _fl(self)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.pi, 0.0).astype(x.dtype))


def _digamma(x):
    """jax gives NaN at 0; torch gives -inf at +0 and +inf at -0."""
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x).astype(x.dtype), jsp.digamma(x))


@lower(aten.digamma.default)
def digamma(self):
    return _digamma(_fl(self))


# B_2j / (2j)! for j = 1..12: the Euler-Maclaurin correction terms of the Hurwitz zeta tail.
_BERNOULLI_2J = ((1, 6), (-1, 30), (1, 42), (-1, 30), (5, 66), (-691, 2730), (7, 6), (-3617, 510), (43867, 798),
                 (-174611, 330), (854513, 138), (-236364091, 2730))
_EM_COEFFS = tuple(a / b / math.factorial(2 * j + 2) for j, (a, b) in enumerate(_BERNOULLI_2J))


def _hurwitz_zeta(s, q):
    """zeta(s, q) = sum_k (q + k)^-s, in float64: a direct sum until q + k >= 10 (at least ten
    terms), then the Euler-Maclaurin tail. Negative q is allowed for integer s, as in torch (jax's
    zeta is inaccurate there). Domain: s = 1 gives inf, s < 1 NaN, q a non-positive integer inf."""
    s, q = jnp.broadcast_arrays(jnp.asarray(s, jnp.float64), jnp.asarray(q, jnp.float64))
    bad = jnp.isnan(s) | jnp.isnan(q)
    qs = jnp.where(bad | (q <= 0) & (q == jnp.floor(q)), 1.0, q)
    m = jnp.maximum(10.0, jnp.ceil(10.0 - qs))

    def body(state):
        k, acc = state
        return k + 1, acc + jnp.where(k < m, (qs + k) ** -s, 0.0)

    _, direct = lax.while_loop(lambda st: st[0] < jnp.max(m, initial=0.0), body, (jnp.zeros((), jnp.float64),
                                                                                     jnp.zeros_like(qs)))
    w = qs + m
    tail = w ** (1 - s) / (s - 1) + 0.5 * w**-s
    rising = s
    power = w ** (-s - 1)
    for j, c in enumerate(_EM_COEFFS):
        tail = tail + c * rising * power
        rising = rising * (s + 2 * j + 1) * (s + 2 * j + 2)
        power = power / (w * w)
    out = direct + tail
    out = jnp.where((q <= 0) & (q == jnp.floor(q)), jnp.inf, out)
    out = jnp.where((q < 0) & (s != jnp.floor(s)), jnp.nan, out)
    out = jnp.where(s == 1, jnp.inf, jnp.where(s < 1, jnp.nan, out))
    return jnp.where(bad, jnp.nan, out)


def _trigamma(x):
    """CPU's trigamma, in x's own precision: reflection below 1/2 (so at negative integers it is
    huge but finite, from sin(pi x) rounding), six recurrence steps, then the asymptotic series."""
    reflect = x < 0.5
    sin_pi_x = jnp.sin(jnp.asarray(math.pi, x.dtype) * x)
    result = jnp.where(reflect, -(math.pi**2) / (sin_pi_x * sin_pi_x), jnp.zeros_like(x))
    y = jnp.where(reflect, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (y * y)
        y = y + 1
    ixx = 1 / (y * y)
    result = result + (1 + 1 / (2 * y) + ixx * (1 / 6 - ixx * (1 / 30 - ixx * (1 / 42)))) / y
    return jnp.where(reflect, -result, result)


@lower(aten.polygamma.default)
def polygamma(n, self):
    x = _fl(self)
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    sign = 1.0 if n % 2 else -1.0
    return (sign * math.factorial(n) * _hurwitz_zeta(n + 1, x)).astype(x.dtype)


@lower(aten.mvlgamma.default)
def mvlgamma(self, p):
    x = _fl(self)
    j = jnp.arange(p, dtype=x.dtype)
    terms = lax.lgamma(x[..., None] - j / 2)
    return jnp.sum(terms, axis=-1) + (p * (p - 1) / 4) * math.log(math.pi)


@lower(aten.special_zeta.default, aten.special_zeta.other_scalar, aten.special_zeta.self_scalar)
def zeta(self, other):
    x, q = _common(self, other, floating=True)
    return jsp.zeta(x, q)


@lower(aten.special_spherical_bessel_j0.default)
def spherical_bessel_j0(x):
    x = _fl(x)
    safe = jnp.where(x == 0, 1, x)
    return jnp.where(jnp.isinf(x), 0.0, jnp.where(x == 0, 1.0, jnp.sin(safe) / safe)).astype(x.dtype)


@lower(aten.logit.default)
def logit(self, eps=None):
    x = _fl(self)
    if eps is not None:
        x = jnp.clip(x, eps, 1 - eps)
    return jnp.log(x / (1 - x))


def _integral_identity(fn):
    def lowering(self):
        return self if _is_int(self) else fn(self)

    lowering.__doc__ = f"{fn.__name__}; integers are returned unchanged."
    return lowering


lower(aten.floor.default)(_integral_identity(jnp.floor))
lower(aten.ceil.default)(_integral_identity(jnp.ceil))
lower(aten.trunc.default)(_integral_identity(jnp.trunc))
lower(aten.round.default)(_integral_identity(jnp.round))  # round half to even, as nearbyint


@lower(aten.round.decimals)
def round_decimals(self, decimals):
    """CPU's formula: scale by 10**|decimals|, round half to even, scale back."""
    x = _fl(self)
    scale = float(10.0 ** abs(decimals))
    if decimals < 0:
        return jnp.round(x / scale) * scale
    return jnp.round(x * scale) / scale


@lower(aten.frac.default)
def frac(self):
    return self - jnp.trunc(self)


@lower(aten.frexp.Tensor)
def frexp(self):
    m, e = jnp.frexp(self)
    return m, e.astype(jnp.int32)


@lower(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if not jnp.issubdtype(self.dtype, jnp.inexact):
        return self
    info = jnp.finfo(self.dtype)
    x = jnp.where(jnp.isnan(self), jnp.asarray(0.0 if nan is None else nan).astype(self.dtype), self)
    x = jnp.where(x == jnp.inf, jnp.asarray(info.max if posinf is None else posinf).astype(self.dtype), x)
    return jnp.where(x == -jnp.inf, jnp.asarray(info.min if neginf is None else neginf).astype(self.dtype), x)


@lower(aten.isnan.default)
def isnan(self):
    return jnp.isnan(self)


@lower(aten.isinf.default)
def isinf(self):
    return jnp.isinf(self)


@lower(aten.isposinf.default)
def isposinf(self):
    return jnp.isposinf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lower(aten.isneginf.default)
def isneginf(self):
    return jnp.isneginf(self) if not _is_int(self) else jnp.zeros(self.shape, bool)


@lower(aten.signbit.default)
def signbit(self):
    if self.dtype == np.bool_:
        return jnp.zeros(self.shape, bool)
    return jnp.signbit(self) if not _is_int(self) else self < 0


@lower(aten.deg2rad.default)
def deg2rad(self):
    x = _fl(self)
    return x * jnp.asarray(math.pi / 180, x.dtype)


@lower(aten.rad2deg.default)
def rad2deg(self):
    x = _fl(self)
    return x * jnp.asarray(180 / math.pi, x.dtype)


@lower(aten.sinc.default)
def sinc(self):
    x = _fl(self)
    px = x * jnp.asarray(math.pi, x.dtype)
    safe = jnp.where(x == 0, 1, px)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)


def _fill_check(self, value):
    """CPU's refusal of a number the tensor's dtype cannot hold (``fill_(inf)`` of an int64
    tensor, 300 into uint8, 1e10 into float16: "value cannot be converted to type uint8_t without
    overflow"), or a complex number for a float tensor, whose imaginary part the program would drop
    silently. Numbers every dtype holds pass at once; any other is converted by CPU torch itself,
    so its rules and words are CPU's."""
    t = type(value)
    dt = self.dtype
    if t is complex:  # CPU refuses one with an imaginary part for a float tensor, not for others
        if not dt.is_complex:
            torch.empty(min(self.numel(), 2), dtype=dt).fill_(value)
        return
    if t is bool or not (t is int or t is float):
        return
    if dt is torch.bool or dt.is_complex:
        return
    if t is int and -128 <= value <= 127:  # held by every dtype (uint8 takes -255..255, as CPU wraps)
        return
    if t is float and dt.is_floating_point and (not math.isfinite(value) or abs(value) <= 65504.0):
        return
    torch.empty(min(self.numel(), 2), dtype=dt).fill_(value)  # CPU skips the check for one element


@lower(aten.fill.Scalar, aten.fill.Tensor, runtime_numbers=("value",), check=_fill_check)
def fill(self, value):
    return jnp.broadcast_to(jnp.asarray(value).astype(self.dtype), self.shape)


# fill_ of a whole small storage with a Python number, outside a recording: the storage takes a
# constant array kept here by (shape, dtype, value), uploaded once. torch.full, scalar_tensor and
# ones reach the backend as empty + fill_, and a decoding loop makes the same few constants at every
# token (the -inf of a logits processor, an all-False mask); each was a program launched to write a
# constant. Sharing the array is safe as in _clone_kernel (a write replaces it, donations check).
_CONSTANTS: dict[tuple, Any] = {}
_CONSTANTS_KEPT = 256
_CONSTANT_ELEMENTS = 4096


def _fill_kernel(adapt):
    lowered = adapt(aten.fill_.Scalar, LOWERINGS[aten.fill.Scalar], "inplace")
    counts = metrics.op_counts
    lazy = fused.Lazy

    def run(self, value):
        t = type(value)
        if ((t is float or t is int or t is bool) and self.device.type == "tpu" and not executor.recording()
                and self.numel() <= _CONSTANT_ELEMENTS):
            st = self.untyped_storage()
            v = getattr(st, "_jx", 0)
            if (type(v) is not lazy and st._dtype is self.dtype and st._shape == self.shape
                    and not self.storage_offset() and self.is_contiguous() and not self.is_conj()
                    and not self.is_neg() and not self.dtype.is_complex):
                key = (st._shape, self.dtype, t, repr(value) if t is float else value)
                array = _CONSTANTS.get(key)
                if array is None:
                    # CPU's conversion of the number; one the dtype cannot hold raises CPU's error
                    data = _dtypes.cpu_to_numpy(torch.full(st._shape, value, dtype=self.dtype))
                    if len(_CONSTANTS) >= _CONSTANTS_KEPT:
                        del _CONSTANTS[next(iter(_CONSTANTS))]
                    array = _CONSTANTS[key] = _transfer.numpy_to_device(data)
                counts["aten.fill_.Scalar"] += 1
                _storage._replace(st, array)
                return self
        return lowered(self, value)

    run.counts_itself = True
    return run


kernel_from_lowerings(aten.fill_.Scalar, _fill_kernel, "lowering (inplace), small constants kept")


@lower(aten.zero.default)
def zero(self):
    return jnp.zeros_like(self)


@lower(aten.clone.default)
def clone(self, memory_format=None):
    """jax arrays are immutable, so a copy is the same array; a later write replaces it."""
    return self


_PLAIN_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


def _clone_kernel(adapt):
    """``clone`` of a whole contiguous storage outside a recording: a new storage holding the same
    jax array, no program launched. Sharing is safe because arrays are immutable (a write replaces
    a storage's array) and every donation first checks that nothing else holds the array
    (``fused._donatable``, a graph replay's reference count). A decoding loop clones its scores
    and masks at every token; each clone was a dispatch through XLA for an identity. Views,
    strided layouts, conjugate or negative bits (applied to the copy), pending values and
    recordings take the lowering."""
    lowered = adapt(aten.clone.default, LOWERINGS[aten.clone.default], "functional")
    counts = metrics.op_counts
    lazy = fused.Lazy

    def run(self, memory_format=None):
        if memory_format in _PLAIN_FORMATS and self.device.type == "tpu" and not executor.recording():
            st = self.untyped_storage()
            v = getattr(st, "_jx", None)
            if (v is not None and type(v) is not lazy and st._dtype is self.dtype and st._shape == self.shape
                    and not self.storage_offset() and self.is_contiguous() and not self.is_conj()
                    and not self.is_neg()):
                counts["aten.clone.default"] += 1
                return new_tensor(st._shape, self.dtype, v)
        out = lowered(self, memory_format=memory_format)
        if self.is_neg():  # a negative or conjugate view (clone passes through torch's fallbacks
            out.neg_()     # for those bits): the clone holds the values, without the bit, as on CPU
        if self.is_conj():
            out.conj_physical_()
        return out

    run.counts_itself = True
    return run


kernel_from_lowerings(aten.clone.default, _clone_kernel, "lowering (functional), a whole array shared")


# ---------------------------------------------------------------------------------- activations
@lower(aten.relu.default)
def relu(self):
    return jnp.maximum(self, jnp.zeros_like(self))


_SQRT1_2 = 1 / math.sqrt(2)
_GELU_BETA = math.sqrt(2 / math.pi)
_GELU_KAPPA = 0.044715


@lower(aten.gelu.default)
def gelu(self, approximate="none"):
    """Through erf, not erfc: measured faster on TPU."""
    x = _fl(self)
    if approximate == "tanh":
        return 0.5 * x * (1 + jnp.tanh(_GELU_BETA * (x + _GELU_KAPPA * x * x * x)))
    return x * 0.5 * (1 + lax.erf(x * _SQRT1_2))


@lower(aten.gelu_backward.default)
def gelu_backward(grad_output, self, approximate="none"):
    g, x = _common(grad_output, self)
    if approximate == "tanh":
        x_sq = x * x
        inner = _GELU_BETA * (x + _GELU_KAPPA * x_sq * x)
        t = jnp.tanh(inner)
        left = 0.5 * x
        right = 1 + t
        d_inner = _GELU_BETA * (1 + 3 * _GELU_KAPPA * x_sq)
        return g * (0.5 * right + left * (1 - t * t) * d_inner)
    cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
    pdf = jnp.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return g * (cdf + x * pdf)


@lower(aten.silu.default)
def silu(self):
    x = _fl(self)
    return x / (1 + jnp.exp(-x))


@lower(aten.mish.default)
def mish(self):
    x = _fl(self)
    return x * jnp.tanh(jax.nn.softplus(x))


@lower(aten.elu.default)
def elu(self, alpha=1, scale=1, input_scale=1):
    x = _fl(self)
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * (alpha * scale))


def _negative_slope_check(kind: str, extra: str = ""):
    """CPU refuses the backward of an in-place activation whose negative part was scaled by a
    negative slope: the result no longer tells which inputs were negative."""

    def elu_args(grad_output, alpha, scale, input_scale, is_result, self_or_result):
        return alpha, is_result

    def leaky_args(grad_output, self, negative_slope, self_is_result):
        return negative_slope, self_is_result

    def check(*args, **kwargs):
        slope, is_result = (elu_args if kind == "elu" else leaky_args)(*args, **kwargs)
        if is_result and float(slope) < 0:
            raise RuntimeError(
                f"In-place {kind} backward calculation is triggered with a negative slope which is not supported. "
                "This is caused by calling in-place forward function with a negative slope, please call "
                f"out-of-place version instead.{extra}"
            )

    return check


@lower(aten.elu_backward.default, check=_negative_slope_check("elu"))
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    g, x = _common(grad_output, self_or_result)
    negcoef = alpha * scale
    if is_result:
        neg = g * input_scale * (x + negcoef)
    else:
        neg = g * input_scale * negcoef * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, neg, g * scale)


@lower(aten.celu.default)
def celu(self, alpha=1.0):
    x = _fl(self)
    return jnp.where(x > 0, x, jnp.expm1(x / alpha) * alpha)


@lower(aten.leaky_relu.default)
def leaky_relu(self, negative_slope=0.01):
    x = _fl(self)
    return jnp.where(x > 0, x, x * negative_slope)


@lower(aten.leaky_relu_backward.default, check=_negative_slope_check(
    "leakyReLu", " File an issue at https://github.com/pytorch/pytorch if you do require supporting in-place "
    "leakRelu backward calculation with negative slope"))
def leaky_relu_backward(grad_output, self, negative_slope, self_is_result):
    g, x = _common(grad_output, self)
    return jnp.where(x > 0, g, g * negative_slope)


@lower(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    x, lo, hi = _common(self, min_val, max_val)
    return _clamp(x, lo, hi)


@lower(aten.hardtanh_backward.default)
def hardtanh_backward(grad_output, self, min_val, max_val):
    g, x = _common(grad_output, self)
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros_like(g), g)


@lower(aten.hardsigmoid.default)
def hardsigmoid(self):
    x = _fl(self)
    return jnp.clip(x + 3, 0, 6) / 6


@lower(aten.hardsigmoid_backward.default)
def hardsigmoid_backward(grad_output, self):
    g, x = _common(grad_output, self)
    return jnp.where((x > -3) & (x < 3), g / 6, jnp.zeros_like(g))


@lower(aten.hardswish.default)
def hardswish(self):
    x = _fl(self)
    return x * jnp.clip(x + 3, 0, 6) / 6


@lower(aten.hardswish_backward.default)
def hardswish_backward(grad_output, self):
    g, x = _common(grad_output, self)
    # CPU's kernel: the ends of the ramp belong to the flat parts (0 at -3, the gradient at 3)
    return jnp.where(x <= -3, jnp.zeros_like(g), jnp.where(x < 3, g * (x / 3 + 0.5), g))


@lower(aten.softplus.default)
def softplus(self, beta=1, threshold=20):
    x = _fl(self)
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


@lower(aten.softplus_backward.default)
def softplus_backward(grad_output, self, beta, threshold):
    g, x = _common(grad_output, self)
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1))


@lower(aten.threshold.default)
def threshold(self, threshold, value):
    x, t, v = _common(self, threshold, value)
    return jnp.where(x <= t, v, x)


@lower(aten.threshold_backward.default)
def threshold_backward(grad_output, self, threshold):
    g, x = _common(grad_output, self)
    return jnp.where(x <= threshold, jnp.zeros_like(g), g)


@lower(aten.sigmoid_backward.default)
def sigmoid_backward(grad_output, output):
    g, y = _common(grad_output, output)
    d = (1 - y) * y
    return g * (jnp.conj(d) if jnp.iscomplexobj(d) else d)  # CPU's Wirtinger convention: the conjugate


@lower(aten.tanh_backward.default)
def tanh_backward(grad_output, output):
    g, y = _common(grad_output, output)
    d = 1 - y * y
    return g * (jnp.conj(d) if jnp.iscomplexobj(d) else d)  # CPU's Wirtinger convention: the conjugate


@lower(aten.logit_backward.default)
def logit_backward(grad_output, self, eps=None):
    g, x = _common(grad_output, self)
    d = g / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.nan, d)
    return jnp.where((x < eps) | (x > 1 - eps), 0.0, d)


@lower(aten._prelu_kernel.default)
def prelu(self, weight):
    x, w = _common(self, weight)
    return jnp.where(x > 0, x, w * x)


@lower(aten._prelu_kernel_backward.default)
def prelu_backward(grad_output, self, weight):
    g, x, w = _common(grad_output, self, weight)
    return jnp.where(x > 0, g, w * g), jnp.where(x > 0, jnp.zeros_like(g), x * g)


def _glu(x, dim):
    a, b = jnp.split(x, 2, axis=dim)
    return a * jax.nn.sigmoid(b)


@lower(aten.glu.default)
def glu(self, dim=-1):
    return _glu(_fl(self), dim)


@lower(aten.glu_backward.default)
def glu_backward(grad_output, self, dim):
    g, x = _common(grad_output, self)
    _, vjp = jax.vjp(lambda v: _glu(v, dim), x)
    return vjp(g)[0]


@lower(aten.softshrink.default)
def softshrink(self, lambd=0.5):
    x = _fl(self)
    return jnp.where(x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, jnp.zeros_like(x)))


@lower(aten.softshrink_backward.default)
def softshrink_backward(grad_output, self, lambd):
    g, x = _common(grad_output, self)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(g), g)


@lower(aten.hardshrink.default)
def hardshrink(self, lambd=0.5):
    x = _fl(self)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(x), x)


@lower(aten.hardshrink_backward.default)
def hardshrink_backward(grad_out, self, lambd):
    g, x = _common(grad_out, self)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(g), g)


@lower(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    """min(x, 0) - log1p(exp(-|x|)); the buffer is unused by the backward below."""
    x = _fl(self)
    out = jnp.minimum(x, 0) - jnp.log1p(jnp.exp(-jnp.abs(x)))
    return out, jnp.zeros((), x.dtype)


@lower(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output, self, buffer):
    g, x = _common(grad_output, self)
    neg = x < 0
    z = jnp.exp(-jnp.abs(x))
    return g * (jnp.where(neg, 1.0, 0.0) - jnp.where(neg, 1.0, -1.0) * (z / (1 + z)))


# --------------------------------------------------------------------------- orthogonal polynomials
def _poly_args(x, n):
    """x and n broadcast in the common float dtype, with n truncated to an integer as CPU does."""
    xf, nf = _common(x, n, floating=True)
    xf, nf = jnp.broadcast_arrays(xf, nf)
    return xf, jnp.trunc(nf)


def _recurrence(p0, q0, step, k0: int, last):
    """Three-term recurrence: for k = k0 .. ``last`` (per element), (p, q) <- (q, step(k, p, q)).
    Runs to the largest ``last`` with a lax.while_loop; elements whose ``last`` is passed stay put."""
    k_max = jnp.max(last, initial=k0 - 1)

    def cond(state):
        return state[0] <= k_max

    def body(state):
        k, p, q = state
        r = step(k.astype(q.dtype), p, q)
        active = k <= last
        return k + 1, jnp.where(active, q, p), jnp.where(active, r, q)

    _, _, q = lax.while_loop(cond, body, (jnp.asarray(k0, jnp.int64), p0, q0))
    return q


def _chebyshev(kind: str, x, n, shifted: bool = False):
    """Chebyshev polynomials of the four kinds by recurrence, with CPU's closed forms at |x| = 1 and
    for large n inside (-1, 1). ``shifted`` evaluates at 2x - 1, testing the ends on x itself."""
    x, n = _poly_args(x, n)
    one = jnp.ones_like(x)
    y = x + x - 1 if shifted else x
    at_pos = (x == 1) if shifted else (x == 1)
    at_neg = (x == 0) if shifted else (x == -1)
    odd = jnp.fmod(n, 2) != 0
    q1 = {"t": y, "u": y + y, "v": y + y - 1, "w": y + y + 1}[kind]
    body = _recurrence(one, q1, lambda k, p, q: (y + y) * q - p, 2, n.astype(jnp.int64))
    body = jnp.where(n == 0, one, body)
    theta = jnp.arccos(jnp.clip(y, -1, 1))
    inside = jnp.abs(y) < 1
    sign = jnp.where(odd, -one, one)
    if kind == "t":
        ends = jnp.where(at_pos, one, sign)
        closed = jnp.cos(n * theta)
        big = 6
    elif kind == "u":
        ends = jnp.where(at_pos, n + 1, sign * (n + 1))
        s = jnp.sin(theta)
        closed = jnp.where(s != 0, jnp.sin((n + 1) * theta) / jnp.where(s != 0, s, 1),
                           (n + 1) * jnp.cos((n + 1) * theta) / y)
        big = 8
    elif kind == "v":
        ends = jnp.where(at_pos, one, sign * (n + n + 1))
        c = jnp.cos(theta / 2)
        closed = jnp.where(jnp.sin(theta / 2) != 1, jnp.cos((n + 0.5) * theta) / c, sign * (n + n + 1))
        big = 8
    else:
        ends = jnp.where(at_pos, n + n + 1, sign)
        s = jnp.sin(theta / 2)
        closed = jnp.where(jnp.cos(theta / 2) != 1, jnp.sin((n + 0.5) * theta) / jnp.where(s != 0, s, 1),
                           jnp.where(y > 0, n + n + 1, sign))
        big = 8
    out = jnp.where((n > big) & inside, closed, body)
    out = jnp.where(at_pos | at_neg, ends, out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


def _poly_lowering(fn):
    def lowering(x, n):
        return fn(x, n)

    lowering.__doc__ = fn.__doc__
    return lowering


for _k_name in "tuvw":
    lower(getattr(aten, f"special_chebyshev_polynomial_{_k_name}"))(
        _poly_lowering(lambda x, n, _k=_k_name: _chebyshev(_k, x, n)))
    lower(getattr(aten, f"special_shifted_chebyshev_polynomial_{_k_name}"))(
        _poly_lowering(lambda x, n, _k=_k_name: _chebyshev(_k, x, n, shifted=True)))


def _simple_poly(x, n, q1, step, k0: int, last_offset: int):
    """Polynomials without closed forms: 1 at n = 0, ``q1`` at n = 1, then the recurrence."""
    one = jnp.ones_like(x)
    out = _recurrence(one, q1, step, k0, n.astype(jnp.int64) + last_offset)
    out = jnp.where(n == 0, one, out)
    return jnp.where(n < 0, jnp.zeros_like(x), out)


@lower(aten.special_hermite_polynomial_h)
def hermite_polynomial_h(x, n):
    """Physicists' Hermite: H_{k+1} = 2x H_k - 2k H_{k-1}."""
    x, n = _poly_args(x, n)
    return _simple_poly(x, n, x + x, lambda k, p, q: (x + x) * q - 2 * (k - 1) * p, 2, 0)


@lower(aten.special_hermite_polynomial_he)
def hermite_polynomial_he(x, n):
    """Probabilists' Hermite: He_{k+1} = x He_k - k He_{k-1}."""
    x, n = _poly_args(x, n)
    return _simple_poly(x, n, x, lambda k, p, q: x * q - (k - 1) * p, 2, 0)


@lower(aten.special_laguerre_polynomial_l)
def laguerre_polynomial_l(x, n):
    """L_{k+1} = ((2k + 1 - x) L_k - k L_{k-1}) / (k + 1); 1 at x = 0."""
    x, n = _poly_args(x, n)
    out = _simple_poly(x, n, 1 - x, lambda k, p, q: (((k - 1) * 2 + (1 - x)) * q - (k - 1) * p) / k, 2, 0)
    return jnp.where((x == 0) & (n >= 0), jnp.ones_like(x), out)


@lower(aten.special_legendre_polynomial_p)
def legendre_polynomial_p(x, n):
    """P_{k+1} = ((2k + 1) x P_k - k P_{k-1}) / (k + 1); +-1 at |x| = 1."""
    x, n = _poly_args(x, n)
    out = _simple_poly(x, n, x, lambda k, p, q: ((2 * k - 1) * x * q - (k - 1) * p) / k, 2, 0)
    odd = jnp.fmod(n, 2) != 0
    ends = jnp.where((x > 0) | ~odd, 1.0, -1.0).astype(x.dtype)
    return jnp.where((jnp.abs(x) == 1) & (n >= 0), ends, out)


@lower(aten.ldexp.Tensor, graph_only=True)
def ldexp(self, other):
    """``self * 2 ** other`` (eager mode runs torch's decomposition, which is the same)."""
    return self * jnp.exp2(other.astype(jnp.result_type(self, jnp.float32)))
