"""Lowerings: random sampling. Each gets a PRNG key derived from ``torch.manual_seed`` and a
counter (``torch_tpu/core/rng.py``), so a seed gives the same numbers every run; they are not CPU's
numbers (a different generator), only the same distributions.

Numbers are drawn in float32 at least (float64 for float64 tensors) and cast, so half-precision
tensors get properly rounded samples. Argument checks raise CPU's errors before any drawing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.ops._registry import aten, kernel, lower
from torch_tpu.runtime.executor import Program, execute
from torch_tpu.tensor import value_checks as checks
from torch_tpu.tensor.storage import is_tpu, read


def _float(dtype) -> jnp.dtype:
    """The dtype to draw in for a result of ``dtype``."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _uniform01(key, shape, dtype):
    """Uniform on the open interval (0, 1): safe under log and tan."""
    dt = _float(dtype)
    return jax.random.uniform(key, shape, dt, minval=jnp.finfo(dt).tiny, maxval=1.0)


# ----------------------------------------------------------------------------------- checks
def _checker(op: str, test, message: str):
    """A check calling ``test(*args)`` on the op's Python arguments; raises CPU's RuntimeError."""

    def check(*args, **kwargs):
        bad = test(*args, **kwargs)
        if bad:
            raise RuntimeError(f"{op} {message.format(*bad)}")

    return check


def _uniform_bad(self, *args, **kw):
    lo = kw.get("from", args[0] if args else 0.0)
    hi = kw.get("to", args[1] if len(args) > 1 else 1.0)
    return (lo, hi) if lo > hi else None


def _normal_bad(*args, **kwargs):
    std = kwargs.get("std", args[2] if len(args) > 2 else 1.0)
    return (std,) if isinstance(std, float | int) and std < 0 else None


# ---------------------------------------------------------------------------- distributions
_UNIFORM_MSG = "expects to return a [from, to) range, but found from={} > to={}"


@lower(aten.uniform, random=True, check=_checker("uniform_", _uniform_bad, _UNIFORM_MSG))
def uniform(key, self, *args, **kw):
    """Uniform on [from, to). (``from`` is a Python keyword: read by position or from ``kw``.)"""
    lo = kw.get("from", args[0] if args else 0.0)
    hi = kw.get("to", args[1] if len(args) > 1 else 1.0)
    dt = _float(self.dtype)
    u = jax.random.uniform(key, self.shape, dt)
    return (u * (jnp.asarray(hi, dt) - lo) + lo).astype(self.dtype)


# normal_functional: the functional twin that graphs hold where a traced function wrote normal_
@lower(aten.normal_functional.default, random=True, graph_only=True)
@lower(aten.normal_, random=True, check=_checker("normal_", _normal_bad, "expects std >= 0.0, but found std {}"))
def normal_(key, self, mean=0.0, std=1.0):
    dt = _float(self.dtype)
    return (jax.random.normal(key, self.shape, dt) * std + mean).astype(self.dtype)


def _normal_std_check(mean, std=1.0, *args, **kwargs):
    if isinstance(std, float | int) and std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    if isinstance(std, torch.Tensor) and std.numel() and is_tpu(std):
        if bool(execute(_ANY_NEGATIVE, read(std))):
            raise RuntimeError("normal expects all elements of std >= 0.0")


_ANY_NEGATIVE = Program("any negative", lambda a: jnp.any(a < 0))


@lower(
    aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor, random=True, check=_normal_std_check
)
def normal(key, mean, std=1.0):
    shape = jnp.broadcast_shapes(jnp.shape(mean), jnp.shape(std))
    dt = _float(jnp.result_type(mean, std))
    return jax.random.normal(key, shape, dt) * std + mean


@lower(aten.normal.float_float, random=True, check=_normal_std_check)
def normal_float_float(key, mean, std, size, dtype=None):
    dt = jnp.float64 if dtype == torch.float64 else jnp.float32
    return jax.random.normal(key, tuple(size), dt) * std + mean


def _bernoulli_p_check(self, p=0.5, **kwargs):
    if not 0 <= p <= 1:
        raise RuntimeError(f"bernoulli_ expects p to be in [0, 1], but got p={p}")


@lower(aten.bernoulli.default, aten.bernoulli.Tensor, random=True)
def bernoulli(key, self, p=None):
    prob = self if p is None else p
    dt = _float(jnp.result_type(prob))
    u = jax.random.uniform(key, self.shape, dt)
    return (u < prob.astype(dt)).astype(self.dtype)


@lower(aten.bernoulli.p, aten.bernoulli_.float, random=True, check=_bernoulli_p_check)
def bernoulli_p(key, self, p=0.5):
    u = jax.random.uniform(key, self.shape, _float(self.dtype))
    return (u < p).astype(self.dtype)


def _exponential_check(self, lambd=1.0, **kwargs):
    if not lambd > 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")


@lower(aten.exponential, random=True, check=_exponential_check)
def exponential(key, self, lambd=1.0):
    return -jnp.log(_uniform01(key, self.shape, self.dtype)) / lambd


def _geometric_check(self, p, **kwargs):
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")


@lower(aten.geometric, random=True, check=_geometric_check)
def geometric(key, self, p):
    """Trials up to the first success: ceil(log(u) / log(1 - p)), at least 1."""
    u = _uniform01(key, self.shape, self.dtype)
    return jnp.maximum(jnp.ceil(jnp.log(u) / jnp.log1p(-p)), 1)


def _log_normal_check(self, mean=1.0, std=2.0, **kwargs):
    if not std > 0:
        raise RuntimeError(f"log_normal_ expects std > 0.0, but found std={std}")


@lower(aten.log_normal, random=True, check=_log_normal_check)
def log_normal(key, self, mean=1.0, std=2.0):
    return jnp.exp(jax.random.normal(key, self.shape, _float(self.dtype)) * std + mean)


def _cauchy_check(self, median=0.0, sigma=1.0, **kwargs):
    if not sigma > 0:
        raise RuntimeError(f"cauchy_ expects sigma > 0.0, but found sigma={sigma}")


@lower(aten.cauchy, random=True, check=_cauchy_check)
def cauchy(key, self, median=0.0, sigma=1.0):
    u = _uniform01(key, self.shape, self.dtype)
    return median + sigma * jnp.tan(jnp.pi * (u - 0.5))


# ---------------------------------------------------------------------------------- random_
_DIGITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def _top(dtype: torch.dtype) -> int:
    """The exclusive upper bound of ``random_`` without ``to``: every integer a float type holds
    exactly (up to 2**digits), or the type's largest value for integer types (which is itself left
    out so the bound fits in int64)."""
    if dtype == torch.bool:
        return 2
    if dtype.is_floating_point:
        return 2 ** _DIGITS[dtype] + 1
    return torch.iinfo(dtype).max


def _randint(key, shape, low: int, high: int, jdt):
    return jax.random.randint(key, shape, low, high, dtype=jnp.int64).astype(jdt)


def _check_range(low: int, high: int) -> None:
    if low >= high:
        raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got from={low} >= to={high}")


@lower(aten.random.default, random=True)
def random(key, self):
    return _randint(key, self.shape, 0, _top(_dtypes.to_torch(self.dtype)), self.dtype)


@lower(aten.random.to, random=True, check=lambda self, to, **kw: _check_range(0, to))
def random_to(key, self, to):
    return _randint(key, self.shape, 0, to, self.dtype)


def _check_from(self, *args, **kw):
    low = kw.get("from", args[0] if args else 0)
    high = kw.get("to", args[1] if len(args) > 1 else None)
    _check_range(low, _top(self.dtype) if high is None else high)


@lower(getattr(aten.random, "from"), random=True, check=_check_from)
def random_from(key, self, *args, **kw):
    """[from, to); ``to=None`` means up to the type's largest value. (``from`` is a Python
    keyword, so the arguments are read by position or from ``kw``.)"""
    low = kw.get("from", args[0] if args else 0)
    high = kw.get("to", args[1] if len(args) > 1 else None)
    high = _top(_dtypes.to_torch(self.dtype)) if high is None else high
    return _randint(key, self.shape, low, high, self.dtype)


# -------------------------------------------------------------------- permutations, sampling
@lower(aten.randperm.default, aten.randperm.generator, random=True, check=lambda n, **kw: _randperm_check(n))
def randperm(key, n, dtype=None):
    return jax.random.permutation(key, n)


def _randperm_check(n: int) -> None:
    if n < 0:
        raise RuntimeError(f"randperm: n must be non-negative, got {n}")


_MULTINOMIAL_STATS = Program(
    "multinomial check",
    lambda p: (
        jnp.all(jnp.isfinite(p)) & jnp.all(p >= 0),
        jnp.min(jnp.sum(p, axis=-1)),
        jnp.min(jnp.sum(p > 0, axis=-1)),
    ),
)


def _multinomial_check(self, num_samples, replacement=False, **kwargs):
    if self.dim() not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if not self.dtype.is_floating_point:
        raise RuntimeError(f"multinomial only supports floating-point dtypes for input, got: {self.dtype}")
    if num_samples <= 0:
        raise RuntimeError("cannot sample n_sample <= 0 samples")
    if not replacement and num_samples > self.shape[-1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without replacement")
    if self.numel() == 0 or not is_tpu(self):
        return
    ok, total, nonzero = execute(_MULTINOMIAL_STATS, read(self))
    if not bool(ok):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if not float(total) > 0:
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement and int(nonzero) < num_samples:
        raise RuntimeError(
            "invalid multinomial distribution (with replacement=False, not enough non-negative category to sample)"
        )


@lower(aten.multinomial, random=True, check=_multinomial_check)
def multinomial(key, self, num_samples, replacement=False):
    """With replacement: independent categorical draws. Without: the Gumbel top-k trick, which
    samples categories in the same order-weighted way as sequential draws."""
    p = self.astype(jnp.float64 if self.dtype == jnp.float64 else jnp.float32)
    logits = jnp.where(p > 0, jnp.log(p), -jnp.inf)
    if replacement:
        draws = jax.random.categorical(key, logits, axis=-1, shape=(num_samples,) + logits.shape[:-1])
        return jnp.moveaxis(draws, 0, -1)
    g = jax.random.gumbel(key, logits.shape, logits.dtype)
    return jax.lax.top_k(logits + g, num_samples)[1]


# --------------------------------------------------------------------------------- dropout
@lower(aten.native_dropout, random=True)
def native_dropout(key, input, p, train):
    """Keeps each element with probability 1 - p and scales kept ones by 1 / (1 - p), as CPU."""
    if train is False:
        return input, jnp.ones(input.shape, bool)
    keep = 1.0 - p
    mask = jax.random.uniform(key, input.shape, _float(input.dtype)) < keep
    scale = jnp.where(keep == 0, 0.0, 1.0 / jnp.where(keep == 0, 1.0, keep))
    out = input * mask.astype(input.dtype) * scale.astype(input.dtype)
    return out, mask


@lower(aten.native_dropout_backward)
def native_dropout_backward(grad_output, mask, scale):
    # an integer or bool gradient times the float scale is float32 on CPU, computed in float32
    dt = grad_output.dtype if jnp.issubdtype(grad_output.dtype, jnp.inexact) else jnp.float32
    return grad_output.astype(dt) * mask.astype(dt) * jnp.asarray(scale).astype(dt)



def _negative_or_nan(xp, values):
    return ~(values >= 0)


def _poisson_check(self, generator=None):
    # CPU rejects a negative (or NaN) rate: checked on the host copy, else with the step (checks.py)
    checks.check_values(self, _negative_or_nan, (),
                        lambda _: RuntimeError("invalid Poisson rate, expected rate to be non-negative"))


@lower(aten.poisson.default, random=True, check=_poisson_check)
def poisson(key, self, generator=None):
    """Counts drawn with rate ``self`` (rate 0 gives 0), in the rate's dtype as on CPU."""
    rate = self.astype(jnp.float32) if self.dtype in (jnp.bfloat16, jnp.float16) else self
    return jax.random.poisson(key, rate, rate.shape).astype(self.dtype)


def _binomial_check(count, prob, generator=None):
    names = _dtypes.SCALAR_NAMES
    if not count.dtype.is_floating_point:
        raise ValueError(f"binomial only supports floating-point dtypes for count, got: {names[count.dtype]}")
    if prob.dtype != count.dtype:
        raise RuntimeError(f"Found dtype {names.get(prob.dtype, prob.dtype)} but expected {names[count.dtype]}")


def _binomial_meta(count, prob, generator=None):
    # torch has no meta kernel for binomial: the result has the broadcast shape, in count's dtype
    return torch.empty(torch.broadcast_shapes(count.shape, prob.shape), dtype=count.dtype, device="meta")


@lower(aten.binomial.default, random=True, check=_binomial_check, meta=_binomial_meta)
def binomial(key, count, prob, generator=None):
    """Successes in ``count`` trials of probability ``prob``, in count's dtype, as CPU draws them:
    a count at or below 0 gives 0, a probability at or above 1 gives the count."""
    dt = _float(count.dtype)
    n, p = jnp.broadcast_arrays(count.astype(dt), prob.astype(dt))
    n = jnp.maximum(n, 0)
    draws = jax.random.binomial(key, n, jnp.clip(p, 0, 1), n.shape, dt)
    return jnp.where(p >= 1, n, jnp.where(p <= 0, 0, draws)).astype(count.dtype)


def _gamma_draws(key, alpha):
    """Gamma(alpha, 1) draws in alpha's dtype (float32 arithmetic for bf16/f16), kept at or above the
    smallest normal number as CPU keeps them, so a later log or division stays finite."""
    a = alpha.astype(jnp.float32) if alpha.dtype in (jnp.bfloat16, jnp.float16) else alpha
    draws = jax.random.gamma(key, a, a.shape, a.dtype)
    return jnp.maximum(draws, jnp.finfo(a.dtype).tiny)


@lower(aten._standard_gamma.default, random=True, meta=lambda self, generator=None: torch.empty_like(self))
def standard_gamma(key, self, generator=None):
    return _gamma_draws(key, self).astype(self.dtype)


@lower(aten._standard_gamma_grad.default, meta=lambda self, output: torch.empty_like(self))  # torch has none
def standard_gamma_grad(self, output):
    """d sample / d alpha of Gamma(alpha, 1) draws (the reparameterised gradient of
    ``Gamma.rsample``), XLA's implicit derivative; CPU evaluates its own approximation of the same
    quantity, so the two agree to about 1e-4 relative."""
    a = self.astype(jnp.float32) if self.dtype in (jnp.bfloat16, jnp.float16) else self
    return jax.lax.random_gamma_grad(a, output.astype(a.dtype)).astype(self.dtype)


# torch has no meta kernel for _sample_dirichlet, which the dispatcher needs for shapes and dtypes
_meta_lib = torch.library.Library("aten", "IMPL")
_meta_lib.impl("_sample_dirichlet", lambda self, generator=None: torch.empty_like(self), "Meta")


@lower(aten._sample_dirichlet.default, random=True)
def sample_dirichlet(key, self, generator=None):
    """Gamma draws normalised over the last dimension, as CPU samples a Dirichlet."""
    g = _gamma_draws(key, self)
    return (g / g.sum(-1, keepdims=True)).astype(self.dtype)


# ---------------------------------------------------------------------------------- RReLU
def _rrelu_check(self, noise, lower=0.125, upper=1.0 / 3, training=False, generator=None, **_):
    """CPU's argument checks of ``rrelu_with_noise``, raised before anything runs."""
    if float(lower) > float(upper):
        raise RuntimeError("Lower bound should be less than or equal to the upper bound")
    if tuple(noise.shape) != tuple(self.shape):
        raise RuntimeError(f"noise tensor shape must match self tensor shape. Got self.shape = {list(self.shape)} "
                           f"noise.shape = {list(noise.shape)}")
    names = _dtypes.SCALAR_NAMES
    if not self.dtype.is_floating_point:
        raise NotImplementedError(f'"rrelu_with_noise" not implemented for \'{names.get(self.dtype, self.dtype)}\'')
    if noise.dtype != self.dtype:
        raise RuntimeError(f"expected scalar type {names[self.dtype]} but found {names.get(noise.dtype, noise.dtype)}")


@lower(aten.rrelu_with_noise_functional.default, random=True, check=_rrelu_check)
def rrelu_with_noise_functional(key, self, noise, lower=0.125, upper=1.0 / 3, training=False, generator=None):
    """RReLU as CPU computes it: in training each element <= 0 is scaled by its own uniform draw
    from [lower, upper), which ``noise`` keeps (1 where the element is positive) for the backward;
    otherwise leaky ReLU with slope (lower + upper) / 2 and ``noise`` unchanged. In float32 at
    least, rounded once, as CPU's opmath."""
    dt = _float(self.dtype)
    x = self.astype(dt)
    if not training:
        slope = ((jnp.asarray(lower) + jnp.asarray(upper)) / 2).astype(dt)  # in double, as CPU's negval
        return jnp.where(x > 0, x, x * slope).astype(self.dtype), noise
    lo, hi = jnp.asarray(lower).astype(dt), jnp.asarray(upper).astype(dt)
    r = jax.random.uniform(key, self.shape, dt) * (hi - lo) + lo
    neg = x <= 0
    return jnp.where(neg, x * r, x).astype(self.dtype), jnp.where(neg, r, 1).astype(noise.dtype)


@kernel(aten.rrelu_with_noise.default, aten.rrelu_with_noise.out, fusable=True,
        how="kernel (rrelu_with_noise_functional, then the writes)")
def _rrelu_with_noise(self, noise, lower=0.125, upper=1.0 / 3, training=False, generator=None, *, out=None):
    """The eager forms write ``noise`` (and ``self`` or ``out``): the functional lowering computes,
    then the results are copied in, so eager code and compiled graphs share one entry."""
    result, noise_out = aten.rrelu_with_noise_functional.default(self, noise, lower, upper, training, generator)
    if training:
        noise.copy_(noise_out)
    return result if out is None else out.copy_(result)


@kernel(aten.rrelu_with_noise_.default, fusable=True, how="kernel (rrelu_with_noise_functional, then the writes)")
def _rrelu_with_noise_(self, noise, lower=0.125, upper=1.0 / 3, training=False, generator=None):
    result, noise_out = aten.rrelu_with_noise_functional.default(self, noise, lower, upper, training, generator)
    if training:
        noise.copy_(noise_out)
    return self.copy_(result)
