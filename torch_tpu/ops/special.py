"""Lowerings: Bessel functions of integer order 0 and 1, and the Airy function Ai.

XLA has none of these, so each is written here from classical approximations, evaluated in
float64 and cast back by the dispatcher (CPU computes them in the input's precision with
Cephes; float64 keeps our error far below float32's resolution):

* J0, J1, Y0, Y1: the polynomial fits of Abramowitz & Stegun 9.4.1-9.4.6 (|x| <= 3 as
  polynomials in (x/3)^2, beyond as modulus and phase in 3/x), absolute error below 2e-7 of the
  function's envelope;
* K0, K1 (and their ``exp(x)``-scaled forms): A&S 9.8.5-9.8.8, split at x = 2, with I0 and I1
  from ``jax.scipy.special``;
* Ai: its Maclaurin series (A&S 10.4.2) for |x| <= 5, the asymptotic expansions A&S 10.4.59
  (x > 5, exponentially small) and 10.4.60 (x < -5, oscillating) beyond.

Accuracy: about 1e-7 of each function's envelope, so float32 results match CPU's to rounding
while float64 results are good to ~1e-7, not to full double precision.

Edge values follow CPU: NaN for negative arguments of Y and K, -inf for Y at 0, inf for K at 0,
NaN at +-inf for J, Y and Ai.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import torch

from torch_tpu.ops._registry import aten, lower

_F64 = jnp.float64
_TWO_OVER_PI = 2.0 / math.pi
_QUARTER_PI = math.pi / 4


_UNSUPPORTED = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.complex64: "ComplexFloat",
                torch.complex128: "ComplexDouble"}


def _real_only(name: str):
    """CPU implements these for float32/float64 (and integers, promoted) only: same error here."""

    def check(self, *args, **kwargs) -> None:
        kind = _UNSUPPORTED.get(self.dtype)
        if kind is not None:
            raise NotImplementedError(f'"{name}_cpu" not implemented for \'{kind}\'')

    return check


def _f64(x):
    return jnp.asarray(x).astype(_F64)


def _poly(t, coeffs: tuple[float, ...]):
    """sum(c_k t^k), by Horner's rule; ``coeffs`` lowest order first."""
    acc = jnp.full_like(t, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * t + c
    return acc


# ------------------------------------------------------------------------ J0, J1, Y0, Y1 (A&S 9.4)
_J0_SMALL = (1.0, -2.2499997, 1.2656208, -0.3163866, 0.0444479, -0.0039444, 0.0002100)
_Y0_SMALL = (0.36746691, 0.60559366, -0.74350384, 0.25300117, -0.04261214, 0.00427916, -0.00024846)
_F0 = (0.79788456, -0.00000077, -0.00552740, -0.00009512, 0.00137237, -0.00072805, 0.00014476)
_TH0 = (0.0, -0.04166397, -0.00003954, 0.00262573, -0.00054125, -0.00029333, 0.00013558)
_J1_SMALL = (0.5, -0.56249985, 0.21093573, -0.03954289, 0.00443319, -0.00031761, 0.00001109)
_Y1_SMALL = (-0.6366198, 0.2212091, 2.1682709, -1.3164827, 0.3123951, -0.0400976, 0.0027873)
_F1 = (0.79788456, 0.00000156, 0.01659667, 0.00017105, -0.00249511, 0.00113653, -0.00020033)
_TH1 = (0.0, 0.12499612, 0.00005650, -0.00637879, 0.00074348, 0.00079824, -0.00029166)


def _modulus_phase(ax, f_coeffs, th_coeffs, shift: float):
    """(envelope, phase) of J and Y for ax >= 3: J = env cos(phase), Y = env sin(phase)."""
    big = jnp.maximum(ax, 3.0)
    y = 3.0 / big
    env = _poly(y, f_coeffs) / jnp.sqrt(big)
    phase = big - shift + _poly(y, th_coeffs)
    return env, phase


def _j0(x):
    ax = jnp.abs(x)
    t = jnp.square(jnp.minimum(ax, 3.0) / 3.0)
    env, phase = _modulus_phase(ax, _F0, _TH0, _QUARTER_PI)
    return jnp.where(ax <= 3.0, _poly(t, _J0_SMALL), env * jnp.cos(phase))


def _j1(x):
    ax = jnp.abs(x)
    xs = jnp.clip(x, -3.0, 3.0)
    t = jnp.square(xs / 3.0)
    env, phase = _modulus_phase(ax, _F1, _TH1, 3 * _QUARTER_PI)
    return jnp.where(ax <= 3.0, xs * _poly(t, _J1_SMALL), jnp.sign(x) * env * jnp.cos(phase))


def _y_edges(x, value):
    """Y at x < 0 is NaN, at 0 it is -inf (the series would give NaN there)."""
    return jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, value))


def _y0(x):
    xs = jnp.clip(x, 1e-300, 3.0)
    small = _TWO_OVER_PI * jnp.log(xs / 2) * _j0(xs) + _poly(jnp.square(xs / 3.0), _Y0_SMALL)
    env, phase = _modulus_phase(x, _F0, _TH0, _QUARTER_PI)
    return _y_edges(x, jnp.where(x <= 3.0, small, env * jnp.sin(phase)))


def _y1(x):
    xs = jnp.clip(x, 1e-300, 3.0)
    small = _TWO_OVER_PI * jnp.log(xs / 2) * _j1(xs) + _poly(jnp.square(xs / 3.0), _Y1_SMALL) / xs
    env, phase = _modulus_phase(x, _F1, _TH1, 3 * _QUARTER_PI)
    return _y_edges(x, jnp.where(x <= 3.0, small, env * jnp.sin(phase)))


def _nan_at_inf(x, value):
    return jnp.where(jnp.isinf(x), jnp.nan, value)


@lower(aten.special_bessel_j0.default, check=_real_only("bessel_j0"))
def special_bessel_j0(self):
    x = _f64(self)
    return _nan_at_inf(x, _j0(x))


@lower(aten.special_bessel_j1.default, check=_real_only("bessel_j1"))
def special_bessel_j1(self):
    x = _f64(self)
    return _nan_at_inf(x, _j1(x))


@lower(aten.special_bessel_y0.default, check=_real_only("bessel_y0"))
def special_bessel_y0(self):
    x = _f64(self)
    return _nan_at_inf(x, _y0(x))


@lower(aten.special_bessel_y1.default, check=_real_only("bessel_y1"))
def special_bessel_y1(self):
    x = _f64(self)
    return _nan_at_inf(x, _y1(x))


# ------------------------------------------------------------------------------- K0, K1 (A&S 9.8)
_K0_SMALL = (-0.57721566, 0.42278420, 0.23069756, 0.03488590, 0.00262698, 0.00010750, 0.00000740)
_K0_LARGE = (1.25331414, -0.07832358, 0.02189568, -0.01062446, 0.00587872, -0.00251540, 0.00053208)
_K1_SMALL = (1.0, 0.15443144, -0.67278579, -0.18156897, -0.01919402, -0.00110404, -0.00004686)
_K1_LARGE = (1.25331414, 0.23498619, -0.03655620, 0.01504268, -0.00780353, 0.00325614, -0.00068245)


def _k_edges(x, value):
    """K at x < 0 is NaN, at 0 it is +inf."""
    return jnp.where(x == 0, jnp.inf, jnp.where(x < 0, jnp.nan, value))


def _scaled_k(x, order: int):
    """exp(x) K_order(x) for x >= 0 (edges handled by the caller)."""
    xs = jnp.clip(x, 1e-300, 2.0)
    t = jnp.square(xs / 2)
    if order == 0:
        small = -jnp.log(xs / 2) * jsp.i0(xs) + _poly(t, _K0_SMALL)
    else:
        small = (xs * jnp.log(xs / 2) * jsp.i1(xs) + _poly(t, _K1_SMALL)) / xs
    big = jnp.maximum(x, 2.0)
    large = _poly(2.0 / big, _K0_LARGE if order == 0 else _K1_LARGE) / jnp.sqrt(big)
    return jnp.where(x <= 2.0, small * jnp.exp(xs), large)


def _k(self, order: int, scaled: bool):
    x = _f64(self)
    value = _scaled_k(x, order)
    if not scaled:
        value = value * jnp.exp(-x)
    return _k_edges(x, value)


@lower(aten.special_modified_bessel_k0.default, check=_real_only("modified_bessel_k0"))
def special_modified_bessel_k0(self):
    return _k(self, 0, scaled=False)


@lower(aten.special_modified_bessel_k1.default, check=_real_only("modified_bessel_k1"))
def special_modified_bessel_k1(self):
    return _k(self, 1, scaled=False)


@lower(aten.special_scaled_modified_bessel_k0.default, check=_real_only("scaled_modified_bessel_k0"))
def special_scaled_modified_bessel_k0(self):
    return _k(self, 0, scaled=True)


@lower(aten.special_scaled_modified_bessel_k1.default, check=_real_only("scaled_modified_bessel_k1"))
def special_scaled_modified_bessel_k1(self):
    return _k(self, 1, scaled=True)


# ---------------------------------------------------------------------------------- Ai (A&S 10.4)
_AI0 = 0.355028053887817239  # Ai(0)
_AIP0 = 0.258819403792806798  # -Ai'(0)
_SERIES_TERMS = 40
_ASYMPTOTIC_TERMS = 14


def _u_coefficients(n: int) -> list[float]:
    """u_k of the Airy asymptotic expansions: u_k = (6k-5)(6k-3)(6k-1) / (216 k (2k-1)) u_(k-1)."""
    u = [1.0]
    for k in range(1, n):
        u.append(u[-1] * (6 * k - 5) * (6 * k - 3) * (6 * k - 1) / (216 * k * (2 * k - 1)))
    return u


_U = _u_coefficients(_ASYMPTOTIC_TERMS)


def _ai_series(x):
    """Ai(x) = Ai(0) f(x) - (-Ai'(0)) g(x), f and g the two Maclaurin series."""
    x3 = x * x * x
    a, b = jnp.ones_like(x), x
    f, g = a, b
    for k in range(1, _SERIES_TERMS):
        a = a * x3 / ((3 * k - 1) * (3 * k))
        b = b * x3 / ((3 * k) * (3 * k + 1))
        f, g = f + a, g + b
    return _AI0 * f - _AIP0 * g


def _ai_positive(x):
    """x > 5: Ai(x) ~ exp(-z) / (2 sqrt(pi) x^(1/4)) sum (-1)^k u_k z^-k, z = 2/3 x^(3/2)."""
    z = (2.0 / 3.0) * x * jnp.sqrt(x)
    s = _poly(-1.0 / z, tuple(_U))
    return jnp.exp(-z) * s / (2.0 * math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(x)))


def _ai_negative(x):
    """x < -5: Ai(x) ~ (sin(z + pi/4) P - cos(z + pi/4) Q) / (sqrt(pi) |x|^(1/4))."""
    ax = -x
    z = (2.0 / 3.0) * ax * jnp.sqrt(ax)
    w = -1.0 / (z * z)
    p = _poly(w, tuple(_U[0::2]))
    q = _poly(w, tuple(_U[1::2])) / z
    phase = z + _QUARTER_PI
    return (jnp.sin(phase) * p - jnp.cos(phase) * q) / (math.sqrt(math.pi) * jnp.sqrt(jnp.sqrt(ax)))


@lower(aten.special_airy_ai.default, check=_real_only("airy_ai"))
def special_airy_ai(self):
    x = _f64(self)
    mid = jnp.clip(x, -5.0, 5.0)
    value = jnp.where(
        x > 5.0, _ai_positive(jnp.maximum(x, 5.0)),
        jnp.where(x < -5.0, _ai_negative(jnp.minimum(x, -5.0)), _ai_series(mid)),
    )
    return _nan_at_inf(x, value)
