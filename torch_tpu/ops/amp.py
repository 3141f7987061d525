"""Lowerings: the ops of mixed-precision loss scaling (``torch.amp.GradScaler``).

``GradScaler`` unscales the gradients and updates its scale with two in-place ops, each of which
writes more than one argument. Their functional forms, which AOTAutograd puts in a graph, are
lowered here. Eager mode serves the in-place forms with kernels in :mod:`torch_tpu.dispatch.hand_kernels` that
run these same functions and write each result back. The arithmetic follows CPU's kernels.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from torch_tpu.ops._registry import aten, lower


def unscale(grads: list, found_inf: Any, inv_scale: Any) -> tuple[list, Any]:
    """Every gradient times ``inv_scale``, computed in float32 at least and cast back (left as it is
    when ``inv_scale`` is 1); ``found_inf`` becomes 1 when an element of a gradient is inf or NaN,
    and otherwise keeps its value."""
    bad = jnp.zeros((), jnp.bool_)
    outs = []
    for g in grads:
        wide = g.astype(jnp.promote_types(g.dtype, jnp.float32))
        bad = bad | ~jnp.all(jnp.isfinite(wide))
        s = inv_scale.reshape(()).astype(wide.dtype)
        outs.append(jnp.where(s == 1, wide, wide * s).astype(g.dtype))
    return outs, jnp.where(bad, jnp.ones_like(found_inf), found_inf)


def update_scale(scale: Any, growth_tracker: Any, found_inf: Any, growth_factor: float, backoff_factor: float,
                 growth_interval: int) -> tuple[Any, Any]:
    """After a step with an inf or NaN: the scale times ``backoff_factor``, and the count of good
    steps back to 0. After a good step: the count plus one, and once it reaches
    ``growth_interval`` the scale times ``growth_factor`` (kept when that overflows) and the count
    back to 0. CPU multiplies the float32 scale by the double factors in double."""
    found = found_inf.reshape(scale.shape) != 0
    successful = growth_tracker + 1
    wide = scale.astype(jnp.float64)
    grown = (wide * growth_factor).astype(scale.dtype)
    grow = successful == growth_interval
    new_scale = jnp.where(found, (wide * backoff_factor).astype(scale.dtype),
                          jnp.where(grow & jnp.isfinite(grown), grown, scale))
    new_tracker = jnp.where(found | grow, jnp.zeros_like(growth_tracker), successful)
    return new_scale, new_tracker


@lower(aten._amp_foreach_non_finite_check_and_unscale.default, graph_only=True)
def _unscale_in_graph(self: list, found_inf: Any, inv_scale: Any) -> tuple[list, Any]:
    return unscale(self, found_inf, inv_scale)


@lower(aten._amp_update_scale.default, graph_only=True)
def _update_scale_in_graph(self: Any, growth_tracker: Any, found_inf: Any, scale_growth_factor: float,
                           scale_backoff_factor: float, growth_interval: int) -> tuple[Any, Any]:
    return update_scale(self, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval)
