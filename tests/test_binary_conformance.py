"""Binary ops as CPU has them where OpInfo's samples don't look: CPU's refusals (complex operands
of ordering ops, heaviside's mixed dtypes, add's and sub's ``alpha`` and bool operands, in-place
results ``self`` cannot hold) with CPU's words, and Python ints outside an integer dtype."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import like_cpu

C = torch.tensor([1 + 2j, -1j])
F = torch.tensor([0.5, -2.0])


@pytest.mark.parametrize("op", [torch.maximum, torch.minimum, torch.fmax, torch.fmin, torch.max, torch.min])
def test_ordering_ops_refuse_complex(op):
    like_cpu(op, C, F)
    like_cpu(op, F, C)
    like_cpu(op, F, F)


def test_heaviside_refuses_complex_and_mixed_dtypes():
    ints = torch.tensor([-1, 0, 3])
    like_cpu(torch.heaviside, C, C.real)
    like_cpu(torch.heaviside, ints, ints.float())
    like_cpu(torch.heaviside, ints, ints)
    like_cpu(lambda a, b, o: torch.heaviside(a, b, out=o), ints, ints.float(), torch.empty(3, dtype=torch.long))


@pytest.mark.parametrize("op", [torch.add, torch.sub, torch.rsub])
def test_alpha_and_bool_operands(op):
    i8 = torch.tensor([1, 2], dtype=torch.int8)
    b = torch.tensor([True, False])
    like_cpu(lambda x: op(x, x, alpha=True), i8)
    like_cpu(lambda x: op(x, x, alpha=1.5), i8)
    like_cpu(lambda x: op(x, x, alpha=2j), F)
    like_cpu(lambda x: op(x, x, alpha=2), i8)
    like_cpu(op, b, b)
    like_cpu(op, b, i8)
    like_cpu(lambda x: op(x, True), i8)
    like_cpu(lambda x, o: op(x, x, alpha=0.5, out=o), F, torch.empty(2))



def test_in_place_result_self_cannot_hold():
    """The functional result dtype must cast to ``self``'s: a 0-dim float tensor makes an int
    tensor's product float, as does a float divisor its remainder."""
    like_cpu(lambda y, x: y.mul_(x), torch.tensor(3, dtype=torch.int32), torch.tensor(1.5))
    like_cpu(lambda y, x: y.mul_(x), torch.tensor([3], dtype=torch.int32), torch.tensor(1.5))
    like_cpu(lambda y, x: y.fmod_(x), torch.tensor([5, 7]), torch.tensor([2.5, 3.0]))
    like_cpu(lambda y: y.div_(2), torch.tensor([5, 7]))
    like_cpu(lambda y, x: y.eq_(x), torch.tensor([5, 7]), torch.tensor([5.0, 3.0]))
    like_cpu(lambda y, x: y.mul_(x), torch.tensor([1.5]), torch.tensor(2.0, dtype=torch.float64))


def test_python_int_outside_the_dtype_wraps():
    like_cpu(lambda x: x + 300, torch.tensor([1, -2], dtype=torch.int8))
    like_cpu(lambda x: x * 300, torch.tensor([1, 2], dtype=torch.uint8))
    like_cpu(lambda x: x.add_(-129), torch.tensor([1, 2], dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_complex_division_near_the_range_limits(dtype):
    """Smith's division as CPU does it: no |b|^2 that overflows or underflows (a / a is 1 for
    a huge or tiny a, where the textbook formula gives NaN or 0)."""
    fi = torch.finfo(dtype)
    big, tiny = fi.max / 2, fi.tiny
    num = torch.tensor([complex(-big, -big), complex(big, big), complex(tiny, tiny), complex(tiny, 0), 0j, 1],
                       dtype=dtype)
    den = torch.tensor([complex(-big, -big), complex(big, big), complex(tiny, tiny), complex(0, tiny),
                        complex(tiny, tiny), complex(float("inf"), float("inf"))], dtype=dtype)
    like_cpu(torch.div, num, den)


def test_in_place_twins_match_by_signature():
    """An in-place overload is served by the lowering whose arguments it has: ``pow_.Scalar``
    (a Tensor to a Scalar power, with its negative-integer check) is not ``pow.Scalar`` (a
    Scalar to a Tensor power), nor ``polygamma_(self, n)`` ``polygamma(n, self)``."""
    ints = torch.tensor([2, 3], dtype=torch.int32)
    like_cpu(lambda t: t.pow_(-2), ints)
    like_cpu(lambda t, o: torch.pow(t, -2, out=o), ints, torch.empty(2, dtype=torch.int32))
    like_cpu(lambda t: t.pow_(2), ints)
    like_cpu(lambda t: t.pow_(t), ints)
    like_cpu(lambda t: t.polygamma_(1), torch.tensor([0.5, 1.5]))
    like_cpu(lambda t, d: t.floor_divide_(d), torch.tensor([7.0, -9.0]), torch.tensor([2.0, 4.0]))


def test_out_of_another_shape_warns_once_per_call():
    """CPU resizes an ``out=`` tensor of the wrong shape with a deprecation warning, each call,
    once, and silently when the out tensor is empty."""
    import warnings

    a, b = torch.tensor([1.0, 2.0, 3.0], device="tpu"), torch.tensor([4.0, 5.0, 6.0], device="tpu")
    for op, args in ((torch.exp, (a,)), (torch.add, (a, b)), (torch.mul, (a[:1], a[:1, None]))):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            op(*args, out=torch.empty(0, device="tpu"))
            assert len(w) == 0
            for _ in range(2):
                op(*args, out=torch.empty(7, device="tpu"))
            assert len(w) == 2 and all("was resized" in str(x.message) for x in w)


def test_complex_power_whose_real_part_underflows():
    """exp(b log a) with a real part far below the float range is 0 on CPU, whatever the
    (huge, finite) angle; XLA's complex power gave NaN there."""
    a = torch.tensor([complex(-1e10, 3e9), complex(5e8, -7e9), complex(2e9, 0), complex(-1e6, 1e6)],
                     dtype=torch.complex128)
    b = torch.tensor([complex(1e9, -2e9), complex(-3e8, 4e8), complex(2, 0), complex(0.5, 0.2)],
                     dtype=torch.complex128)
    like_cpu(torch.pow, a, b)
    like_cpu(torch.float_power, a, b)


def test_in_place_op_cannot_broadcast_self():
    for base, exp in (((), (3,)), ((2,), (2, 1)), ((2, 1), (2, 2)), ((2, 2), (2, 1, 1)), ((2, 3), (3,))):
        like_cpu(lambda b, e: b.pow_(e), torch.full(base, 2.0), torch.full(exp, 3.0))
        like_cpu(lambda b, e: b.add_(e), torch.full(base, 2.0), torch.full(exp, 3.0))


def test_complex_logaddexp_keeps_cpus_branch_and_edges():
    """CPU's complex logaddexp is the larger input (by real part) plus log1p(exp(smaller - larger)):
    its imaginary part is not reduced into (-pi, pi] as a complex log's is, and the infinite and
    NaN cases are CPU's."""
    inf, nan = math.inf, math.nan
    a = torch.tensor([-1.3986 + 6.6604j, 1 + 2j, complex(-inf, 1), complex(inf, 1), complex(nan, 0), complex(1, nan),
                      complex(-inf, 2), 3 + 1j, complex(inf, 0), 100 + 1j], dtype=torch.complex128)
    b = torch.tensor([-8.4 - 1.7j, 0.5 - 1j, complex(-inf, 2), complex(inf, 2), 1 + 0j, 2 + 0j, 5 + 1j,
                      complex(-inf, 0), complex(inf, 0), 99 + 2j], dtype=torch.complex128)
    like_cpu(torch.logaddexp, a, b)
    like_cpu(torch.logaddexp, a.to(torch.complex64), b.to(torch.complex64))


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64])
def test_integer_power_of_negative_exponents_like_cpu(dtype):
    """CPU's integer power with a negative exponent tensor: 1 for a base of 1, +-1 by the
    exponent's parity for -1, else 0 (XLA's integer power returned arbitrary values)."""
    base = torch.tensor([-3, -2, -1, 0, 1, 2, 3], dtype=dtype).repeat(3)
    exponent = torch.tensor([-3] * 7 + [-2] * 7 + [5] * 7, dtype=dtype)
    like_cpu(torch.pow, base, exponent)
    like_cpu(lambda e: 2 ** e, exponent)
    like_cpu(lambda b, e: b[:, None] ** e, base, exponent)


@pytest.mark.parametrize("fn", [
    lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    lambda a, b: torch.div(a, b, rounding_mode="floor"),
    lambda a, b: a // b,
    lambda a, b: a % b,
    lambda a, b: torch.fmod(a, b),
    lambda a, b: torch.remainder(5, b),
    lambda a, b: torch.div(a, 0, rounding_mode="trunc"),
    lambda a, b: a.float() // b,  # floats divide by zero to infinities, as on CPU
    lambda a, b: torch.fmod(a.float(), 0),
], ids=["trunc", "floor", "floordiv", "mod", "fmod", "rscalar", "scalar0", "float", "float-fmod"])
@pytest.mark.parametrize("zero", [False, True])
def test_integer_division_broadcasts_and_refuses_zero_like_cpu(fn, zero):
    """Integer division broadcasts (``trunc`` raised TypeError for [3, 1] by [2]) and, by a zero
    divisor, raises CPU's "ZeroDivisionError" (at the next host read when the divisor was computed
    on the device), where XLA returns arbitrary integers."""
    a = torch.tensor([[7], [-7], [5]])
    b = torch.tensor([2, 0]) if zero else torch.tensor([2, -3])
    like_cpu(lambda a, b: fn(a, b).cpu(), a, b)
    like_cpu(lambda a, b: fn(a, b + 0).cpu(), a, b)  # a divisor the device computed


@pytest.mark.parametrize("fn", [
    lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    lambda a, b: torch.div(a, b, rounding_mode="floor"),
    lambda a, b: a // b,
    lambda a, b: a // True,
    lambda a, b: a % b,
    lambda a, b: torch.remainder(True, b),
    lambda a, b: torch.fmod(a, b),
    lambda a, b: a.clone().remainder_(b),
    lambda a, b: a % 2,  # bool and int: an int64 remainder, which CPU computes
    lambda a, b: torch.fmod(a, 1),
], ids=["trunc", "floor", "floordiv", "floordiv-scalar", "mod", "rscalar", "fmod", "inplace", "int-mod",
        "int-fmod"])
def test_integer_division_of_bools_is_refused_as_on_cpu(fn):
    """CPU has no bool kernel for an integer division: NotImplementedError naming the kernel
    ('"remainder_cpu" not implemented for 'Bool''), not the zero-divisor check that a False divisor
    would trip, nor torch's reference's RuntimeError."""
    a = torch.tensor([True, False, True])
    b = torch.tensor([True, True, False])
    like_cpu(lambda a, b: fn(a, b).cpu(), a, b)


@pytest.mark.parametrize("divisor", [0, torch.tensor([0, 2])], ids=["scalar", "tensor"])
def test_true_division_of_integers_by_zero_is_infinite_as_on_cpu(divisor):
    """``rounding_mode=None`` is true division, float's rules: no zero-divisor refusal."""
    like_cpu(lambda a: torch.div(a, divisor if type(divisor) is int else divisor.to(a.device),
                                 rounding_mode=None).cpu(), torch.tensor([1, -3]))
