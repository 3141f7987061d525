"""The ``torch.compile`` backend.

Dynamo captures a graph; AOTAutograd splits it into functional forward and backward ATen graphs,
decomposed to core ATen. Each graph is lowered node by node through :data:`LOWERINGS` (the same
table eager mode uses) into one jax function, which becomes one :class:`Program`.

Graphs are deferred, in strict mode as in fused mode: each is recorded as one node of the pending
trace (:mod:`torch_tpu.runtime.fused`). When a graph already in the trace is called again (the next
step's forward), or a host read or an eager op needs a pending value, the trace runs as one XLA
program. A training step's forward, backward and optimizer graphs thus become one program, with
no intermediate copied out between them. Debug mode runs each graph at once.

Dynamic shapes: a graph is compiled once per distinct set of input shapes (``jax.jit`` retraces),
and each new shape is counted in ``torch_tpu.metrics()`` under ``compile_count``. Symbolic sizes
that Dynamo passes as integer inputs are compile-time constants.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import logging
import math
import operator
import sys
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch._decomp

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.core import extension as _extension
from torch_tpu.core import rng as _rng
from torch_tpu.core.devices import platform
from torch_tpu.ops._registry import IGNORED_KWARGS, LOWERINGS, Lowering
from torch_tpu.ops.graph import foreach_lowering
from torch_tpu.ops.indexing import INDEX_CHECKS
from torch_tpu.runtime import executor, fused, metrics
from torch_tpu.runtime import target as _target
from torch_tpu.runtime.executor import EagerMode, Program, execute
from torch_tpu.tensor import storage as _storage
from torch_tpu.tensor import value_checks
from torch_tpu.tensor.storage import TPU_DEVICE, is_tpu, new_tensor, read, write

_EARLY_MODES = (EagerMode.FUSED, EagerMode.STRICT)


def _assert_scalar(cond: Any, msg: str) -> None:
    """A guard of a dynamic-shape graph on its sizes (known when the program is built)."""
    if not bool(cond):
        raise RuntimeError(f"torch.compile(backend='tpu'): {msg}")


def _assert_tensor_metadata(a: Any, size: Any = None, stride: Any = None, dtype: Any = None, **_: Any) -> None:
    """``torch.export``'s record of what a ``.to()`` call saw: checked on the traced array's shape
    and dtype when the program is built (strides and devices are not the program's)."""
    if dtype is not None and hasattr(a, "dtype") and a.dtype != _dtypes.to_jax(dtype):
        raise RuntimeError(f"torch.compile(backend='tpu'): a tensor expected as {dtype} is {a.dtype} in the graph")
    if size is not None and hasattr(a, "shape") and tuple(a.shape) != tuple(size):
        raise RuntimeError(f"torch.compile(backend='tpu'): a tensor expected of shape {list(size)} is "
                           f"{list(a.shape)} in the graph")


# Node targets computed in Python while the program is traced: tuple access and the arithmetic on
# sizes of dynamic-shape graphs, whose sizes are plain ints then (a program per set of sizes).
_PYTHON_OPS: dict[Callable, Callable] = {
    operator.getitem: operator.getitem,
    operator.add: operator.add,
    operator.sub: operator.sub,
    operator.mul: operator.mul,
    operator.floordiv: operator.floordiv,
    operator.truediv: operator.truediv,
    operator.mod: operator.mod,
    operator.pow: operator.pow,
    operator.neg: operator.neg,
    operator.eq: operator.eq,
    operator.ne: operator.ne,
    operator.lt: operator.lt,
    operator.le: operator.le,
    operator.gt: operator.gt,
    operator.ge: operator.ge,
    torch.sym_max: max,
    torch.sym_min: min,
    torch.sym_float: float,
    torch.sym_int: int,
    torch.sym_not: operator.not_,
    torch.ops.aten.sym_size.int: lambda x, dim: x.shape[dim],
    torch.ops.aten.sym_numel.default: lambda x: math.prod(x.shape),
    torch.ops.aten._assert_scalar.default: _assert_scalar,
    torch.ops.aten.sym_constrain_range_for_size.default: lambda *args, **kwargs: None,
    torch.ops.aten._assert_tensor_metadata.default: _assert_tensor_metadata,
}


aten = torch.ops.aten
_DATA_DEPENDENT_SHAPE = "its result's shape depends on the values (Dynamo breaks the graph before it)"
# Ops eager mode serves (hand kernels) that no graph computes, each with why. A graph naming one
# raises NotImplementedError with the reason; tests/test_serving.py keeps this list and the serving
# table in step. Mutating overloads are not listed: functional graphs name their functional twin.
GRAPH_UNSERVED: dict[torch._ops.OpOverload, str] = {
    aten.masked_select.default: _DATA_DEPENDENT_SHAPE,
    aten.nonzero.default: _DATA_DEPENDENT_SHAPE,
    aten.bincount.default: _DATA_DEPENDENT_SHAPE,
    aten.repeat_interleave.Tensor: _DATA_DEPENDENT_SHAPE,
    aten._unique.default: _DATA_DEPENDENT_SHAPE,
    aten._unique2.default: _DATA_DEPENDENT_SHAPE,
    aten.unique_dim.default: _DATA_DEPENDENT_SHAPE,
    aten.unique_consecutive.default: _DATA_DEPENDENT_SHAPE,
    aten.linalg_lstsq.default: "which results CPU returns depends on the matrices' ranks (a host read)",
    aten._local_scalar_dense.default: "it reads a value on the host (.item()); Dynamo breaks the graph there",
    aten.equal.default: "its result is a Python bool read on the host; Dynamo breaks the graph there",
    aten._copy_from.default: "a transfer between devices; graphs move tensors with _to_copy",
    aten._copy_from_and_resize.default: "a transfer between devices; graphs move tensors with _to_copy",
    aten.native_batch_norm.default: "it writes the running statistics; AOTAutograd traces "
                                    "_native_batch_norm_legit_functional instead",
    aten.is_set_to.default: "its result is a Python bool about storage identity, read on the host; Dynamo "
                            "breaks the graph there",
    aten._new_zeros_with_same_feature_meta.default: "forward-mode AD calls it on concrete tensors to make a "
                                                    "view's tangent; AOTAutograd's graphs do not name it",
    aten._assert_async.default: "an eager value check (a deferred check, hand_kernels._assert_async); functionalized "
                                "graphs hold _functional_assert_async, not lowered yet",
    aten._assert_async.msg: "an eager value check (a deferred check, hand_kernels._assert_async); functionalized "
                            "graphs hold _functional_assert_async, not lowered yet",
}


def _lowering_of(target: Any) -> Any:
    lowering = LOWERINGS.get(target)
    if lowering is not None and lowering.variants and getattr(lowering.choose, "settings_only", False):
        return _variant(target, lowering.choose())  # the float32 matmul precision, as eager mode takes it
    if lowering is None and isinstance(target, torch._ops.OpOverload):
        lowering = foreach_lowering(target) or _python_custom_op(target)
    if lowering is None:
        why = GRAPH_UNSERVED.get(target)
        raise NotImplementedError(f"torch.compile(backend='tpu'): no lowering for {target} in the graph"
                                  + (f": {why}" if why else ""))
    return lowering


@functools.cache
def _variant(target: Any, name: str) -> Lowering:
    """``target``'s lowering with the keywords of its variant ``name``. Dynamo's global-state guard
    recompiles a graph when the float32 matmul precision moves to or from ``"highest"``."""
    lowering = LOWERINGS[target]
    return dataclasses.replace(lowering, fn=functools.partial(lowering.fn.func, **lowering.variants[name]),
                               variants=None, choose=None)


@functools.cache
def _python_custom_op(target: torch._ops.OpOverload) -> Lowering | None:
    """A custom op written in Python (``torch.library.custom_op``, such as torch's chunked
    ``linear_cross_entropy``): graphs keep it whole, and eager mode runs its Python body op by op.
    In a graph, the body is traced to ATen on meta tensors of the node's shapes and lowered like
    any graph, so it joins the step's program. Its backward is whatever its registered autograd
    formula computes, which AOTAutograd traces into the backward graph."""
    if target.namespace in ("aten", "prims"):
        return None
    from torch._library.custom_ops import _maybe_get_opdef

    opdef = _maybe_get_opdef(target)
    if opdef is None:
        return None
    body = opdef._init_fn
    # per signature, the body's lowered graph: a later trace of the same signature (the TPU target's
    # compile, on its worker thread) reuses it, for make_fx sets torch's process-wide "FX tracing"
    # flag, which would fail a torch.compile call running meanwhile on another thread
    traced: dict[str, tuple[Callable, bool]] = {}

    def fn(*args: Any, **kwargs: Any) -> Any:
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.utils._pytree import tree_flatten, tree_unflatten

        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        signature = repr((spec, [(x.shape, str(x.dtype)) if i in where else x for i, x in enumerate(leaves)]))
        known = traced.get(signature)
        if known is not None:
            out = known[0]([], *[leaves[i] for i in where])
            return out[0] if known[1] else tuple(out)
        metas = [torch.empty(leaves[i].shape, dtype=_dtypes.to_torch(leaves[i].dtype), device="meta") for i in where]
        single: list[bool] = []

        def call(*tensors: torch.Tensor) -> tuple:
            values = list(leaves)
            for i, t in zip(where, tensors):
                values[i] = t
            a, k = tree_unflatten(values, spec)
            out = body(*a, **k)
            single.append(not isinstance(out, (tuple, list)))
            return (out,) if single[-1] else tuple(out)

        # functional, as AOTAutograd's graphs are: the body may write in place (mm(out=...), div_)
        gm = make_fx(torch.func.functionalize(call, remove="mutations"),
                     decomposition_table=_decompositions())(*metas)
        lowered, n_random, _ = lower_graph(gm)
        if n_random:
            raise NotImplementedError(f"torch.compile(backend='tpu'): random ops inside the custom op {target}")
        traced[signature] = (lowered, single[-1])
        out = lowered([], *[leaves[i] for i in where])
        return out[0] if single[-1] else tuple(out)

    return Lowering(fn)


def _is_random(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target in LOWERINGS and LOWERINGS[target].random


def _value(env: dict, a: Any) -> Any:
    """A node argument with every graph node replaced by its value in ``env`` (lists kept)."""
    if isinstance(a, torch.fx.Node):
        return env[a]
    if isinstance(a, (list, tuple)):
        return type(a)(_value(env, x) for x in a)
    return a


def _mutations(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """``copy_(input, value)`` nodes: input mutations AOTAutograd left in the graph.

    With ``keep_inference_input_mutations`` an inference graph (an optimizer step under no_grad)
    ends with one ``copy_`` per updated input. Running them here (a storage swap per input) costs
    far less than AOTAutograd's epilogue, which dispatches one ``copy_`` per input each step.
    """
    return {
        n: n.args[0]
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default and n.args[0].op == "placeholder"
    }


_WITH_EFFECTS = torch.ops.higher_order.with_effects
# Token bookkeeping AOTAutograd may leave in a graph (with ``unlift_effect_tokens``).
_TOKEN_OPS = (torch.ops.prims._make_token.default, torch.ops.prims._sink_tokens.default)
# Side-effecting ops a graph cannot run: ``_linalg_check_errors`` raises CPU's error for a failed
# factorization after reading ``info`` on the host, and a graph cannot stop on a value it has not
# computed yet. The compiled graph returns ``info`` as an extra output instead, and the backend
# checks it like a device-side assert (:mod:`torch_tpu.runtime.checks`): the error, CPU's own,
# surfaces at the next host read (at once in debug mode).
_DROPPED_EFFECTS = frozenset((torch.ops.aten._linalg_check_errors.default,))


def _token() -> Any:
    """The value of an effect token: ordering is the graph's, so the token carries nothing."""
    return jnp.zeros((0,), jnp.float32)


def _check_effect(n: torch.fx.Node) -> None:
    """A ``with_effects(token, op, *args)`` node must wrap an op the table lowers (or one it drops)."""
    op = n.args[1]
    if op not in _DROPPED_EFFECTS:
        _lowering_of(op)


def _run_effect(op: Any, args: tuple, kwargs: dict, meta: Any) -> tuple:
    """``with_effects``: (new token, *the op's results), as the higher-order op returns them."""
    if op in _DROPPED_EFFECTS:
        return (_token(),)
    lowering = _lowering_of(op)
    if lowering.random:
        raise NotImplementedError(f"torch.compile(backend='tpu'): random op {op} under with_effects")
    r = lowering.fn(*args, **kwargs)
    rest = meta[1:] if isinstance(meta, (list, tuple)) else None
    r = tuple(r) if isinstance(r, tuple) else (r,)
    return (_token(), *(_match_meta(x, m) for x, m in zip(r, rest or [None] * len(r))))


def _bool_index_error(n: torch.fx.Node) -> None:
    """``index`` with a boolean mask has a data-dependent shape: no static graph computes it."""
    if n.target is not torch.ops.aten.index.Tensor:
        return
    for i in n.args[1]:
        v = i.meta.get("val") if isinstance(i, torch.fx.Node) else None
        if isinstance(v, torch.Tensor) and v.dtype in (torch.bool, torch.uint8):
            raise NotImplementedError(
                "torch.compile(backend='tpu'): aten.index.Tensor with a boolean mask has a data-dependent shape; "
                "index with integer indices, or leave this op out of the compiled region"
            )


def _linalg_error(api_name: str, info: Any) -> Exception:
    """CPU's exception for a failed factorization with this ``info`` (torch builds the message)."""
    try:
        torch.ops.aten._linalg_check_errors(torch.tensor(int(info), dtype=torch.int32), api_name, is_matrix=True)
    except Exception as e:
        return e
    return RuntimeError(f"{api_name}: the factorization failed (info={info})")


def _nonzero(xp: Any, values: Any) -> Any:
    return values != 0


def _value_checks(n: torch.fx.Node) -> list[tuple]:
    """The value checks eager mode makes for node ``n``'s op (index bounds, class targets, integer
    division by zero), as ``(node checked, predicate, params, error, position)``. Found by running
    the op's own check on the traced values of the node's arguments with the checks collected, not
    made (``value_checks.collecting``): one rule for eager ops and graphs. A check that needs more than
    traced values (a value read on the host, a random op's) gives none, as before."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
        return []

    check = INDEX_CHECKS.get(n.target)
    if check is None:
        lowering = LOWERINGS.get(n.target)
        if lowering is None or lowering.check is None or lowering.random:
            return []
        check = lowering.check
    metas = {id(a.meta.get("val")): a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)}
    if not metas:
        return []
    args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
    kwargs = {k: v for k, v in kwargs.items() if k not in IGNORED_KWARGS}
    try:
        with value_checks.collecting() as found:
            check(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the trace already passed the meta kernel: nothing to add
        return []
    checks = []
    for t, bad, params, error, position in found:
        if id(t) not in metas or not all(type(p) in (int, float, bool) for p in params):
            continue
        source = _values_source(metas[id(t)])
        if not _statically_passes(source, bad, params):
            checks.append((source, bad, params, error, position))
    return checks


# Ops whose result holds exactly its first argument's elements, in the same flat order, perhaps
# repeated: a check of the result is a check of the argument, found at the same first bad value.
_SAME_VALUES = frozenset((
    torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.default, torch.ops.aten.squeeze.dim,
    torch.ops.aten.squeeze.dims, torch.ops.aten.flatten.using_ints, torch.ops.aten.alias.default,
    torch.ops.aten.clone.default, torch.ops.aten.expand.default,
))


def _values_source(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose values a check of ``node`` reads: through reshapes to a graph input where
    there is one, so that targets viewed as ``(-1,)`` are checked on the host copy the input
    often has (run's ``on_host``) rather than waited for on the device."""
    while (node.op == "call_function" and node.target in _SAME_VALUES and node.args
           and isinstance(node.args[0], torch.fx.Node)):
        node = node.args[0]
    return node


def _statically_passes(node: torch.fx.Node, bad: Callable, params: tuple) -> bool:
    """Whether ``node``'s values pass the check whatever the graph's inputs: an ``arange`` of
    constant bounds (positions for a position embedding) is checked once, here, on its values."""
    if node.op != "call_function" or node.target not in (torch.ops.aten.arange.default, torch.ops.aten.arange.start,
                                                          torch.ops.aten.arange.start_step):
        return False
    bounds = node.args
    if not all(type(b) in (int, float) for b in bounds):
        return False  # a symbolic length: the check stays in the graph
    values = np.arange(*bounds)
    return values.size <= 1 << 16 and not np.asarray(bad(np, values, *params)).any()


def _mask_rows(n: torch.fx.Node) -> tuple[torch.fx.Node, int, Callable[[Any], Exception]] | None:
    """``x[mask] = values`` with one row of values per true element: CPU raises when the counts
    differ, which a static graph cannot see. (mask node, rows, CPU's error from the difference), or
    None when the values broadcast (any count is right) or the put is not by one boolean mask."""
    if n.op != "call_function" or n.target is not torch.ops.aten.index_put.default or len(n.args[1]) != 1:
        return None
    mask = n.args[1][0]
    metas = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in (n.args[0], mask, n.args[2])]
    if not all(isinstance(m, torch.Tensor) for m in metas) or metas[1].dtype not in (torch.bool, torch.uint8):
        return None
    x, m, v = metas
    rest = list(x.shape[m.dim():])
    if v.dim() != len(rest) + 1 or v.shape[0] == 1:
        return None
    rows = int(v.shape[0])

    def error(difference: Any) -> Exception:
        return RuntimeError(f"shape mismatch: value tensor of shape {list(v.shape)} cannot be broadcast to "
                            f"indexing result of shape {[rows + int(difference)] + rest}")

    return mask, rows, error


_COND = torch.ops.higher_order.cond


def _lower_branch(gm: torch.fx.GraphModule) -> Callable:
    """One branch of ``torch.cond``: a graph of its own, lowered the same way."""
    fn, n_random, _ = lower_graph(gm)
    if n_random:
        raise NotImplementedError("torch.compile(backend='tpu'): random ops inside a torch.cond branch")
    return lambda operands: tuple(fn([], *operands))


def _run_cond(pred: Any, true_fn: Callable, false_fn: Callable, operands: Any, meta: Any) -> Any:
    """``torch.cond`` as ``lax.cond``: XLA runs one branch, chosen on the device."""
    out = jax.lax.cond(jnp.asarray(pred).reshape(()).astype(bool), true_fn, false_fn, tuple(operands))
    return _match_meta(list(out), list(meta) if isinstance(meta, (list, tuple)) else meta)


def lower_graph(gm: torch.fx.GraphModule, skip: frozenset = frozenset(),
                checks: bool = False) -> tuple[Callable, int, list]:
    """A jax function computing ``gm``: (function, number of random ops, output metas).

    The function returns the graph's outputs, then the new value of each input a ``copy_`` node
    mutates (in graph order), except the mutations in ``skip`` (computed on the host instead).
    """
    nodes = list(gm.graph.nodes)
    mutations = _mutations(gm)
    for n in nodes:  # fail at compile time, naming the op, rather than at the first call
        if n.op == "call_function" and n.target is _WITH_EFFECTS:
            _check_effect(n)
        elif n.op == "call_function" and n.target in _TOKEN_OPS:
            continue
        elif n.op == "call_function" and n.target is _COND:
            for branch in n.args[1:3]:
                lower_graph(getattr(gm, branch.target))  # names an op without lowering now
        elif (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n not in mutations
              and n.target not in _PYTHON_OPS):
            _lowering_of(n.target)
            _bool_index_error(n)
    n_random = sum(1 for n in nodes if n.op == "call_function" and _is_random(n.target))
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    out_metas = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in out_node.args[0]]
    device_mutations = [n for n in mutations if n not in skip]
    # value checks a graph cannot raise at the op: each becomes an extra output, nonzero when failed
    # (value, error, metas): ``value(env)`` gives one array per meta. One array: nonzero where the
    # check failed (``error(first nonzero value)``); three: ``value_checks.first_bad``'s (failed, first
    # bad value, its flat index), ``error`` then (the error builder, whether it takes the index, the
    # position of the graph input checked or None, the predicate, its parameters)
    checked: list[tuple[Callable[[dict], Any], Any, list]] = []
    seen: set[tuple] = set()
    for n in nodes if checks else ():
        if n.op == "call_function" and n.target is _WITH_EFFECTS and n.args[1] in _DROPPED_EFFECTS:
            api_name = n.args[3] if len(n.args) > 3 else n.kwargs["api_name"]
            checked.append((lambda env, a=n.args[2]: (_value(env, a),), functools.partial(_linalg_error, api_name),
                            [n.args[2].meta.get("val")]))
        elif (mask_rows := _mask_rows(n)) is not None:
            mask, rows, error = mask_rows
            count = torch.empty((), dtype=torch.int64, device="meta")
            checked.append((lambda env, m=mask, r=rows: ((jnp.sum(env[m] != 0) - r).astype(jnp.int64),), error,
                            [count]))
        elif n not in mutations and n.op == "call_function":
            for node, bad, params, error, position in _value_checks(n):
                # the same check of the same values (a static cache's index_copy_ of each layer's
                # keys and values at one position): computed and read once; of equal checks the first
                # fails first, so its error is the one raised either way
                if (node, bad, params) in seen:
                    continue
                seen.add((node, bad, params))
                dtype = node.meta["val"].dtype
                metas = [torch.empty((), dtype=d, device="meta") for d in (torch.bool, dtype, torch.int64)]
                # a graph input's values may be on the host (token ids): checked there first, see run
                given = placeholders.index(node) if node.op == "placeholder" else None
                checked.append((lambda env, x=node, b=bad, p=params: value_checks.first_bad(b, p, env[x]),
                                (error, position, given, bad, params), metas))

    def fn(rng: list, *inputs: Any) -> tuple:
        env: dict[torch.fx.Node, Any] = {}
        it = iter(inputs)
        rng_it = iter(rng)
        val = functools.partial(_value, env)

        for n in nodes:
            if n.op == "placeholder":
                env[n] = next(it)
            elif n.op == "get_attr":  # a tensor the graph holds as an attribute (a lifted constant)
                c = getattr(gm, n.target)
                if isinstance(c, torch.Tensor):
                    c = read(c) if is_tpu(c) else jnp.asarray(_dtypes.cpu_to_numpy(c))
                env[n] = c
            elif n.op == "call_function" and n.target is _WITH_EFFECTS:
                kwargs = {k: val(v) for k, v in n.kwargs.items() if k not in IGNORED_KWARGS}
                env[n] = _run_effect(n.args[1], val(n.args[2:]), kwargs, n.meta.get("val"))
            elif n.op == "call_function" and n.target in _TOKEN_OPS:
                env[n] = _token() if n.target is _TOKEN_OPS[0] else None
            elif n.op == "call_function" and n.target is _COND:
                pred, true_gm, false_gm, operands = n.args[:4]
                branches = [_lower_branch(getattr(gm, b.target)) for b in (true_gm, false_gm)]
                env[n] = _run_cond(val(pred), *branches, val(operands), n.meta.get("val"))
            elif n in mutations:
                if n not in skip:
                    dst = n.args[0].meta["val"]
                    v = jnp.asarray(val(n.args[1])).astype(_dtypes.to_jax(dst.dtype))
                    env[n] = jnp.broadcast_to(v, tuple(dst.shape))
            elif n.op == "call_function":
                args = val(n.args)
                kwargs = {k: val(v) for k, v in n.kwargs.items() if k not in IGNORED_KWARGS}
                if n.target in _PYTHON_OPS:
                    env[n] = _PYTHON_OPS[n.target](*args, **kwargs)
                    continue
                lowering = _lowering_of(n.target)
                key = _rng.key_from(*next(rng_it)) if lowering.random else None
                env[n] = _apply(lowering, key, args, kwargs, n.meta.get("val"), n.target)
            elif n.op == "output":
                found = tuple(x for value, _, _ in checked for x in value(env))
                if grouped:  # any of the first_bad checks failed: the one flag the host reads
                    at = 0
                    flags = []
                    for _, _, metas in checked:
                        if len(metas) == 3:
                            flags.append(found[at])
                        at += len(metas)
                    found += (functools.reduce(jnp.logical_or, flags),)
                return tuple(val(a) for a in n.args[0]) + tuple(env[m] for m in device_mutations) + found
        raise AssertionError("graph without output")

    # with ``checks``: after the outputs and mutations, each check's arrays (see ``checked``), then,
    # with more than one first_bad check (``fn.grouped``), whether any of those failed;
    # ``fn.checks`` holds (its error, the arrays' metas)
    grouped = sum(1 for _, _, metas in checked if len(metas) == 3) > 1
    fn.checks = [(error, metas) for _, error, metas in checked]
    fn.grouped = grouped
    return fn, n_random, out_metas


def _out_spec(m: Any) -> tuple | None:
    """What :meth:`Lowering.apply` checks a result against, from the node's traced value."""
    if m is None:
        return None
    shape = tuple(m.shape) if all(type(d) is int for d in m.shape) else None  # symbolic: not checked
    return shape, _dtypes.to_jax(m.dtype)


def _apply(lowering: Lowering, key: Any, args: Any, kwargs: dict, meta: Any, target: Any) -> Any:
    """One node through the protocol eager mode uses (:meth:`Lowering.apply`): a tensor, or a
    tuple or list of tensors (None where undefined), shaped as the node's traced value."""
    if isinstance(meta, torch.Tensor):
        return lowering.apply(key, args, kwargs, [_out_spec(meta)], str(target))[0]
    if isinstance(meta, (list, tuple)) and all(m is None or isinstance(m, torch.Tensor) for m in meta):
        return type(meta)(lowering.apply(key, args, kwargs, [_out_spec(m) for m in meta], str(target)))
    r = lowering.fn(key, *args, **kwargs) if lowering.random else lowering.fn(*args, **kwargs)
    return _match_meta(r, meta)  # nested results (a tuple of lists) or no traced value


def _match_meta(r: Any, meta: Any) -> Any:
    """Casts a lowering's result to the dtype torch's tracing recorded for the node."""
    if isinstance(meta, torch.Tensor):
        r = jnp.asarray(r)
        want = _dtypes.to_jax(meta.dtype)
        return r.astype(want) if r.dtype != want else r
    if isinstance(meta, (list, tuple)) and isinstance(r, (list, tuple)):
        return type(r)(_match_meta(x, m) for x, m in zip(r, meta))
    return r


def _host_part(gm: torch.fx.GraphModule) -> tuple[list[torch.fx.Node], dict[int, torch.fx.Node], frozenset]:
    """The nodes computed on the host: (nodes in order, graph outputs among them, input mutations).

    Optimizers keep small CPU tensors (AdamW's step counters when not ``capturable``) that the
    graph updates. Computed on the device, each would come back with a device-to-host read that
    waits for the whole step. A node is on the host when torch's trace put its value on the CPU
    and every tensor it reads is on the host too; torch computes those on the CPU (a few scalar ops).
    """
    host: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()

    def on_cpu(n: torch.fx.Node) -> bool:
        v = n.meta.get("val")
        vs = v if isinstance(v, (list, tuple)) and v else [v]
        return all(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in vs)

    for n in gm.graph.nodes:
        if n.op == "placeholder" and on_cpu(n):
            seen.add(n)
        elif n.op == "call_function" and on_cpu(n) and (
            isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem
        ):
            if all(a in seen for a in n.all_input_nodes) and n.all_input_nodes:
                host.append(n)
                seen.add(n)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = {i: a for i, a in enumerate(out_node.args[0]) if isinstance(a, torch.fx.Node) and a in seen}
    mutations = frozenset(n for n in _mutations(gm) if n in seen)
    needed: set[torch.fx.Node] = set()
    stack = [*outs.values(), *mutations]
    while stack:  # only what the host results read; the rest runs on the device anyway
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    return [n for n in host if n in needed], outs, mutations


def _host_program(gm: torch.fx.GraphModule, host: list[torch.fx.Node],
                  outs: dict[int, torch.fx.Node]) -> Callable[[list], dict[int, Any]]:
    """The host nodes as one straight-line function (torch's FX code generation), which takes the
    graph's inputs and returns the host outputs by output position; mutations happen in place.
    Interpreting the nodes one by one cost AdamW's 59 (29 step counters) 0.35 ms per step."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    counted = _counters_incremented(host) if not outs else None
    if counted is not None:  # an optimizer's step counts, += 1 each: one in-place foreach op
        positions = [placeholders.index(p) for p in counted[0]]
        op, scalar = torch.ops.aten._foreach_add_.Scalar, counted[1]
        views: list[tuple] = [(None, None, 0)] * len(positions)  # per counter: (tensor, numpy view, address)

        def increment(args: list) -> dict[int, Any]:
            """Each counter's new value written through a numpy view of its memory: 60 ns a counter,
            where ``_foreach_add_`` on CPU scalars takes torch's slow path at 1.7 us each (AdamW
            holds one per parameter). The same value: the sum is exact in a Python float, and
            rounds once to the counter's dtype, as torch's add does. A counter numpy cannot view
            (bfloat16) takes the op, as does any step in which one is new or moved."""
            for k, i in enumerate(positions):
                t = args[i]
                known = views[k]
                if known[0] is not t or known[2] != t.data_ptr():
                    if t.dtype not in _NUMPY_COUNTERS or t.requires_grad or t.dim() or t.device.type != "cpu":
                        op([args[j] for j in positions], scalar)
                        return {}
                    views[k] = (t, t.numpy(), t.data_ptr())
            for _, v, _ in views:
                v[()] = v.item() + scalar
            return {}

        return increment
    inputs_read = {a for n in host for a in n.all_input_nodes if a.op == "placeholder"}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    positions = []
    for i, p in enumerate(placeholders):
        if p in inputs_read:
            env[p] = graph.placeholder(p.name)
            positions.append(i)
    # the epilogue that writes the new values into mutated inputs: one foreach copy, not one op each
    tail = len(host)
    while tail and host[tail - 1].target is torch.ops.aten.copy_.default and not host[tail - 1].users:
        tail -= 1
    for n in host[:tail]:
        env[n] = graph.node_copy(n, lambda a: env[a])
    copies = host[tail:]
    if len(copies) > 1 and all(not c.kwargs for c in copies):
        graph.call_function(torch.ops.aten._foreach_copy_.default,
                            ([env[c.args[0]] for c in copies], [env[c.args[1]] for c in copies]))
    else:
        for n in copies:
            env[n] = graph.node_copy(n, lambda a: env[a])
    keys = list(outs)
    graph.output(tuple(env[outs[i]] for i in keys))
    module = torch.fx.GraphModule(torch.nn.Module(), graph)

    def run(args: list) -> dict[int, Any]:
        return dict(zip(keys, module(*[args[i] for i in positions])))

    return run


_NUMPY_COUNTERS = frozenset((torch.float32, torch.float64, torch.float16))


def _counters_incremented(host: list[torch.fx.Node]) -> tuple[list[torch.fx.Node], Any] | None:
    """(inputs, n) when the host nodes are ``copy_(x_i, _foreach_add(xs, n)[i])`` for every input
    ``x_i`` of floating dtype, which is what AOTAutograd makes of AdamW's ``state_steps += 1``:
    then ``_foreach_add_(xs, n)`` does the same in place, at two thirds of the cost. None otherwise."""
    if not host or host[0].target is not torch.ops.aten._foreach_add.Scalar or host[0].kwargs:
        return None
    add = host[0]
    xs, n = add.args[0], add.args[1]
    if (not isinstance(n, (int, float)) or isinstance(n, bool) or len(set(xs)) != len(xs)
            or not all(isinstance(x, torch.fx.Node) and x.op == "placeholder" for x in xs)):
        return None
    items = {}
    copied = set()
    for node in host[1:]:
        if node.target is operator.getitem and node.args[0] is add and not node.kwargs:
            items[node] = node.args[1]
        elif (node.target is torch.ops.aten.copy_.default and not node.kwargs and not node.users
              and node.args[1] in items and node.args[0] is xs[items[node.args[1]]]):
            copied.add(items[node.args[1]])
        else:
            return None
    if copied != set(range(len(xs))) or len(items) != len(xs):
        return None
    for x in xs:
        v = x.meta.get("val")
        if not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
            return None
    return list(xs), n


def _static_avals(metas: list) -> list | None:
    """The program's output shapes and dtypes from torch's trace, when every output is a tensor of
    static shape (or None): the pending trace then needs no abstract run of the graph to know them."""
    avals = []
    for m in metas:
        if m is None:
            avals.append(None)
        elif isinstance(m, torch.Tensor) and all(type(n) is int for n in m.shape):
            avals.append(jax.ShapeDtypeStruct(tuple(m.shape), _dtypes.to_jax(m.dtype)))
        else:
            return None
    return avals


def _own_shapes(gm: torch.fx.GraphModule) -> bool:
    """Whether a node's lowering gives results of shapes other than the trace's (``own_shapes``)."""
    return any(n.op == "call_function" and getattr(LOWERINGS.get(n.target), "own_shapes", False)
               for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload))


def _size_symbols(placeholders: list[torch.fx.Node]) -> dict[Any, tuple[int, int | None]]:
    """Where each symbolic size of a dynamic-shape graph comes from: (input position, None) for a
    symbolic int input, (input position, dim) for a tensor input's symbolic dimension."""
    where: dict[Any, tuple[int, int | None]] = {}
    for i, p in enumerate(placeholders):
        v = p.meta.get("val")
        if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
            where.setdefault(v.node.expr, (i, None))
        elif isinstance(v, torch.Tensor):
            for d, n in enumerate(v.shape):
                if isinstance(n, torch.SymInt) and n.node.expr.is_Symbol:
                    where.setdefault(n.node.expr, (i, d))
    return where


def _scalar_output(value: Any, meta: Any, key: list, symbols: dict) -> Any:
    """A graph output that is a number, not a tensor: a symbolic size AOTAutograd saves for the
    backward of a dynamic-shape graph. Worked out on the host from the sizes of this call, so the
    step's trace need not run (and wait for the device) to know it; a value the sizes cannot give
    comes from the program."""
    if not isinstance(meta, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return meta if isinstance(meta, (int, float, bool)) else value
    if type(value) is not fused.Lazy:
        return value.item() if isinstance(value, jax.Array) else value
    import sympy

    sizes = {s: sympy.Integer(key[i] if d is None else key[i][0][d]) for s, (i, d) in symbols.items()}
    expr = meta.node.expr.xreplace(sizes)
    if expr.is_number:
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(meta)](expr)
    return fused.concrete(value).item()


class _Tensor(tuple):
    """A graph input's (shape, dtype) in a program's key: the explainer shows it as a tensor. Named
    as the dispatcher's signature type is, which the explainer recognises by name."""



def _without_tpu_kernel(gm: torch.fx.GraphModule) -> str | None:
    """The first op of an AOTAutograd graph that XLA cannot compile for a TPU (``host_on_tpu``:
    eig), when the platform or the TPU target is a TPU; else None."""
    if not (_target.active() or platform() == "tpu"):
        return None
    for n in gm.graph.nodes:
        lowering = LOWERINGS.get(n.target) if n.op == "call_function" else None
        when = getattr(lowering, "host_on_tpu", False)
        if not when:
            continue
        if when is True:
            return str(n.target)
        args, kwargs = torch.fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta.get("val"))
        if when(*args, **kwargs):
            return str(n.target)
    return None


def _op_by_op(gm: torch.fx.GraphModule, op: str) -> Callable:
    """An AOTAutograd graph run op by op in eager mode, where ``op`` runs on the host (it has no
    TPU kernel): one program of the graph would not compile for a TPU. Counted in
    ``metrics()["eager_graphs"]`` and warned once per op."""
    if op not in _WARNED_EAGER:
        _WARNED_EAGER.add(op)
        warnings.warn(f"torch.compile(backend='tpu'): {op} has no TPU kernel in XLA; the graph holding it runs "
                      "op by op in eager mode, that op on the host", stacklevel=2)

    def run(args: list) -> Any:
        metrics.eager_graphs[op] += 1
        flat = list(args)
        args.clear()
        return gm(*flat)

    run._boxed_call = True  # AOTAutograd passes a list it may clear
    return run


def _compile_inference(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    return _compile(gm, example_inputs, inference=True)


_HOST = "host"  # the third element of a key entry for a 0-d CPU tensor input: ((), dtype, _HOST)
_PLAIN_CPU = frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                        torch.int16, torch.int8, torch.uint8, torch.bool))


def _compile(gm: torch.fx.GraphModule, example_inputs: list, inference: bool = False) -> Callable:
    """One graph AOTAutograd hands over (a forward, a backward, or an inference graph such as an
    optimizer step) as the function AOTAutograd calls per step.

    A call reads its inputs' arrays, records the graph's :class:`Program` into the pending trace,
    writes the inputs it mutates and wraps its outputs. 0-d CPU inputs (an optimizer's step counts)
    travel as one vector per dtype, not as an array each: the trace then has 2 inputs where
    AdamW has one per parameter, each of which costs a host-to-device transfer per step.

    Once the graph has one program and no symbolic sizes, calls trust Dynamo's guards (and, for a
    backward, the autograd engine's checks of its gradients) for the inputs' shapes, dtypes and
    devices instead of building and looking up the input signature each time: a guard that fails
    recompiles, so a call never sees another signature. The inputs' storages (views, offsets,
    pending values) are still checked at every call. A graph capture checks every input.

    ``inference``: AOTAutograd's inference graph (no autograd: a decoding step under no_grad). One
    that returns values runs as soon as it is called, see ``run``; one that returns nothing (an
    optimizer step, whose updates are its input mutations) waits, like a training step's graphs.
    In strict mode, with nothing recorded, such a graph calls its executable itself rather than
    record a one-graph trace and run it (a decoding step's host time: the trace's record, flush and
    replay cost about as much as the rest of the call); the inputs it updates (a static KV cache)
    are donated when nothing else holds their buffers, as the trace would donate them.
    """
    no_kernel = _without_tpu_kernel(gm)
    if no_kernel is not None:
        return _op_by_op(gm, no_kernel)
    host_nodes, host_outs, host_mutations = _host_part(gm)
    fn, n_random, out_metas = lower_graph(gm, skip=host_mutations, checks=True)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbols = _size_symbols(placeholders)
    mutated = [placeholders.index(m.args[0]) for m in _mutations(gm) if m not in host_mutations]
    avals = None if _own_shapes(gm) else _static_avals(
        out_metas + [placeholders[i].meta.get("val") for i in mutated] + [m for _, metas in fn.checks for m in metas]
        + ([torch.empty((), dtype=torch.bool, device="meta")] if fn.grouped else []))
    run_host = _host_program(gm, host_nodes, host_outs) if host_outs or host_mutations else None
    cache: dict[tuple, Program] = {}
    # per program (by id), the positions among its inputs of the arrays it updates: donated when
    # it runs at once and nothing else holds them
    updated_at: dict[int, tuple[int, ...]] = {}
    name = f"compiled graph ({len(gm.graph.nodes)} nodes)"
    graph_id = id(cache)
    n_out = len(out_metas)
    n_mutated = len(mutated)
    runs_early = inference and any(isinstance(m, torch.Tensor) for m in out_metas)
    # per output: 0 a tensor, 1 a number (or anything else), 2 computed on the host
    out_kinds = [2 if i in host_outs else 0 if isinstance(m, torch.Tensor) else 1 for i, m in enumerate(out_metas)]
    out_dtypes = [m.dtype if k == 0 else None for m, k in zip(out_metas, out_kinds)]
    checks = fn.checks
    grouped = fn.grouped
    input_checks = any(len(metas) == 3 and error[2] is not None for error, metas in checks)
    Lazy = fused.Lazy
    key_of_tensors = _extension.key_of_tensors()  # None without the extension
    trusted: list[Program] = []  # the one program, once Dynamo's guards stand for its key
    kinds: list[int] = []  # per input, 0 a tpu tensor, 1 a 0-d CPU tensor, 2 another CPU tensor
    # per input, the (shape, dtype) Dynamo's guards fix for a tpu tensor: its storage is compared
    # with these, which costs less than reading the tensor's own shape and dtype at every call
    fixed: list[tuple] = []
    # once trusted: the positions of the tpu inputs, and their keys as the extension's
    # key_of_tensors gives them for tensors over their whole storage ((shape, dtype), as ``fixed``),
    # or None where an input is another CPU tensor (the loop below reads those)
    whole: list = [None, None]
    can_trust = not symbols

    def program_for(key: list) -> Program:
        """The program for this input signature, built on first sight."""
        statics = {i: k for i, k in enumerate(key) if not isinstance(k, tuple)}
        host_at: dict[int, tuple[int, int]] = {}  # input position -> (vector, element)
        groups: dict[Any, list] = {}
        for i, k in enumerate(key):
            if isinstance(k, tuple) and len(k) == 3:
                g = groups.setdefault(k[1], [])
                host_at[i] = (list(groups).index(k[1]), len(g))
                g.append(i)
        n_arrays = sum(1 for i, k in enumerate(key) if isinstance(k, tuple) and i not in host_at)
        n = len(key)

        def body(*xs: Any) -> tuple:
            # the first 2 * n_random inputs are the random ops' (seed, counter) pairs, then the
            # arrays, then one vector per dtype of 0-d CPU inputs
            rng = [(xs[2 * i], xs[2 * i + 1]) for i in range(n_random)]
            start = 2 * n_random
            it = iter(xs[start:start + n_arrays])
            vectors = xs[start + n_arrays:]
            values = []
            for i in range(n):
                if i in statics:
                    values.append(statics[i])
                elif i in host_at:
                    g, j = host_at[i]
                    values.append(vectors[g][j])
                else:
                    values.append(next(it))
            return fn(rng, *values)

        plain = [(tuple(k[0]), *k[1:]) if isinstance(k, tuple) else k for k in key]
        # the input signature as a short checksum: shapes show in the trace's wiring anyway
        signature = zlib.crc32(repr(plain).encode())
        labelled = tuple((f"graph input {i}", _Tensor(k[:2]) if isinstance(k, tuple) else k)
                         for i, k in enumerate(plain))
        program = Program(f"{name}, inputs #{signature:08x}", body, multi=True, avals=avals, key=labelled)
        if avals is not None:
            program.shapes[()] = avals  # known from the trace: recording skips the abstract run
        in_arrays = (i for i, k in enumerate(key) if isinstance(k, tuple) and i not in host_at)
        array_at = {i: j for j, i in enumerate(in_arrays)}  # input position -> its place among the arrays
        updated_at[id(program)] = tuple(2 * n_random + array_at[i] for i in mutated if i in array_at)
        return program

    def run(args: list) -> list:
        if runs_early and executor.runs_at_once():
            return _run(args, True)
        previous = executor.defer()
        try:
            results = _run(args)
        finally:
            executor.undefer(previous)
        if runs_early and previous in _EARLY_MODES:
            # inference (a decoding step): the device starts on the graph now, with the ops
            # recorded before it, while Python goes on to the next ones (in strict mode they then
            # run one by one). In training the graphs wait, so that forward, backward and the
            # optimizer become one program
            fused.flush(reason="inference graph")
        return results

    def _run(args: list, at_once: bool = False) -> list:
        arrays: list = []
        key: list = []
        host: dict[Any, list] = {}  # dtype -> the values of 0-d CPU inputs
        capture = _storage._capture
        trust = trusted and capture is None  # a graph capture checks every input
        recording = executor.recording()
        found = None
        if trust and whole[0] is not None and key_of_tensors is not None:
            # every tpu input's array at once, in C++; its keys say each covers its whole storage, of
            # the shape and dtype the guards fixed (else, a view or another storage, the loop reads it)
            at = whole[0]
            found = key_of_tensors(args if at is True else [args[i] for i in at], recording)
            if found is not None and found[0] == whole[1]:
                arrays = found[1]
                if at is not True:
                    for a, kind in zip(args, kinds):
                        if kind == 1:
                            host.setdefault(a.dtype, []).append(a.item())
            else:
                found = None
        if found is not None:
            pass  # read in C++ above
        elif trust:  # Dynamo's guards fixed each input's device, dims and dtype: its kind is known
            for a, kind, (shape, dtype) in zip(args, kinds, fixed):
                if kind == 0:
                    st = a.untyped_storage()
                    v = st._jx
                    if type(v) is Lazy:
                        if v.value is not None:
                            v = st._jx = v.value
                        elif not recording:
                            v = None
                    if (v is None or st._dtype is not dtype or st._shape != shape or a.storage_offset()
                            or not a.is_contiguous()):
                        v = read(a)
                    arrays.append(v)
                elif kind == 1:
                    host.setdefault(a.dtype, []).append(a.item())
                else:
                    arrays.append(_dtypes.cpu_to_numpy(a).copy())
        else:
            learn = can_trust and not trusted
            if learn:  # a call while trusted (a graph capture checks every input) keeps what was learnt
                kinds.clear()
                fixed.clear()
            for a in args:
                if isinstance(a, torch.Tensor):
                    if a.device == TPU_DEVICE:
                        st = a.untyped_storage()
                        v = st._jx
                        if type(v) is Lazy:
                            if v.value is not None:
                                v = st._jx = v.value  # computed by an earlier trace: drop the placeholder
                            elif not recording:
                                v = None  # read() runs its trace
                        # the whole storage: read's common case, inline
                        if (v is None or capture is not None or a.dtype != st._dtype or a.shape != st._shape
                                or a.storage_offset() or not a.is_contiguous()):
                            v = read(a)
                        arrays.append(v)
                        key.append((a.shape, a.dtype))
                        if learn:
                            kinds.append(0)
                            fixed.append((tuple(a.shape), a.dtype))
                    elif a.dim() == 0 and a.dtype in _PLAIN_CPU:
                        # read now: AOTAutograd's host part writes the step count's new value after
                        host.setdefault(a.dtype, []).append(a.item())
                        key.append(((), a.dtype, _HOST))
                        if learn:
                            kinds.append(1)
                            fixed.append(((), a.dtype))
                    else:
                        # a CPU tensor: a batch the graph moves to tpu (torch's trace already refused one
                        # used on tpu without a move). A copy: XLA:CPU may alias host memory
                        arrays.append(_dtypes.cpu_to_numpy(a).copy())
                        key.append((a.shape, a.dtype))
                        if learn:
                            kinds.append(2)
                            fixed.append(((), None))
                else:
                    key.append(a)
        vectors = [np.array(vs, dtype=_dtypes.to_jax(dt)) for dt, vs in host.items()] if host else ()
        if recording:
            fused.begin_graph(graph_id, arrays)
        # checks of graph inputs whose values the host has (token ids): made now, as eager mode
        # makes them at the op; the device's copy of the check is then not waited on
        on_host = [i for i, (error, metas) in enumerate(checks) if len(metas) == 3 and error[2] is not None
                   and value_checks.check_on_host(args[error[2]], error[3], error[4], error[0], error[1])
                   ] if input_checks else ()
        # after the inputs are read: the host part updates CPU inputs in place
        host_results = run_host(args) if run_host is not None else None
        targets = [args[i] for i in mutated] if n_mutated else ()
        args.clear()  # the boxed calling convention: free inputs as soon as possible
        if trust:
            program = trusted[0]
        else:
            program = cache.get(tuple(key))
            if program is None:  # a new set of shapes, or new values of symbolic sizes (ints)
                program = cache[tuple(key)] = program_for(key)
            if can_trust and not trusted and len(cache) == 1 and all(isinstance(k, tuple) for k in key):
                trusted.append(program)
                if 2 not in kinds:
                    at = [i for i, k in enumerate(kinds) if k == 0]
                    whole[0] = True if len(at) == len(kinds) else at
                    whole[1] = tuple(fixed[i] for i in at)
        # recorded, the graph is compiled by XLA with the trace that holds it, and counted there;
        # run at once (debug mode, an inference graph in strict mode) the program counts its own compile
        rng = [x for _ in range(n_random) for x in _rng.next_inputs()] if n_random else ()
        if at_once:
            v = None  # the input loop's last array: not a holder
            # a buffer held by the argument list, the updated tensor's storage and getrefcount's
            # argument alone: nothing reads it after the step, whose output replaces it
            donate = tuple(p for p in updated_at[id(program)] if isinstance(arrays[p - len(rng)], jax.Array)
                           and sys.getrefcount(arrays[p - len(rng)]) <= 3)
            outs = program.run_donating(donate, *rng, *arrays, *vectors)
        else:
            outs = execute(program, *rng, *arrays, *vectors)
        arrays = None
        for t, v in zip(targets, outs[n_out:n_out + n_mutated]):
            st = t.untyped_storage()
            # write's common case, inline: the whole storage, with a value of its shape and dtype
            if (capture is None and t.dtype == st._dtype and v is not None and v.shape == st._shape
                    and t.shape == st._shape and not t.storage_offset() and t.is_contiguous()
                    and v.dtype == _dtypes.TORCH_TO_JAX.get(st._dtype)):
                _storage._replace(st, v)
            else:
                write(t, v)
        if checks:
            at = n_out + n_mutated
            group: list | None = [] if grouped else None
            for i, (error, metas) in enumerate(checks):
                if len(metas) == 3:  # found on the device with the step: deferred as it is
                    if i in on_host:
                        pass
                    elif group is not None:
                        group.append((outs[at], outs[at + 1], outs[at + 2], error[0], error[1]))
                    else:
                        value_checks.defer_found(outs[at], outs[at + 1], outs[at + 2], error[0], error[1])
                else:
                    meta = metas[0]
                    value_checks.check_values(new_tensor(tuple(meta.shape), meta.dtype, outs[at]), _nonzero, (), error)
                at += len(metas)
            if group:  # one flag read for all of them (a decoding step's cache writes and token lookup)
                value_checks.defer_found_any(outs[at], group)
        results = []
        for i, (o, kind, dtype) in enumerate(zip(outs, out_kinds, out_dtypes)):
            if kind == 0:
                results.append(new_tensor(o.shape, dtype, o) if o is not None else None)
            elif kind == 2:
                results.append(host_results[i])
            else:
                results.append(_scalar_output(o, out_metas[i], key, symbols))
        return results

    run._boxed_call = True  # AOTAutograd passes a list it may clear
    return run


_SKIPPED: list[str] = []


# Whole layers where they can be: every module of core, runtime, tensor, ops, dispatch and compile runs
# beneath the dispatcher; of the device layer, what a kernel or a capture calls.
_BENEATH_THE_DISPATCHER = (
    "torch_tpu.core", "torch_tpu.runtime", "torch_tpu.tensor", "torch_tpu.ops", "torch_tpu.dispatch",
    "torch_tpu.compile", "torch_tpu.device.tpu_module", "torch_tpu.device.graphs", "torch_tpu.device.graphed_callables",
    "jax", "jaxlib", "ml_dtypes",
)
# torch_tpu's modules below the public surface that user code calls directly, above the dispatcher:
# Dynamo may trace them
TRACEABLE_PRIVATE = ("torch_tpu.device.module_move", "torch_tpu.device.streams")


def skip_our_frames(trace_rules: Any = None) -> None:
    """Dynamo must never trace torch_tpu's kernels or the jax code they call: they run beneath
    the dispatcher, also when eager code between graph breaks calls them. User-facing wrappers
    (``jax_op`` functions) stay traceable, so their ops land in the graph."""
    if trace_rules is None:
        from torch._dynamo import trace_rules

    for name in _BENEATH_THE_DISPATCHER:
        if name not in _SKIPPED:
            trace_rules.add(name)
            _SKIPPED.append(name)


@functools.cache
def _decompositions() -> dict:
    """The core ATen decompositions, except for ops the table lowers whole: a layer norm or a
    softmax stays one op, which is shorter for AOTAutograd to trace (gpt-issue's first step: 5.6 s
    to 5.2 s) and leaves XLA the op to fuse as it likes.

    The table is torch's post-autograd core set. ``core_aten_decompositions()`` adds every
    CompositeImplicitAutograd op, which AOTAutograd decomposes anyway since it traces beneath
    autograd, and listing them costs 0.05 to 0.1 s of a process's first compiled step."""
    post_autograd = getattr(torch._decomp, "_core_aten_decompositions_post_autograd", None)
    table = post_autograd() if post_autograd is not None else dict(torch._decomp.core_aten_decompositions().items())
    return {op: fn for op, fn in table.items() if op not in LOWERINGS}


def _replace_in_torch(module: str, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replaces torch's ``module.name`` by ``wrap(original)``, once. Where a torch version lacks
    it, nothing is replaced: these are shortcuts, never needed for correct results."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    original = getattr(mod, name, None)
    if original is None or getattr(original, "_tpu_answered", False):
        return
    replacement = wrap(original)
    replacement._tpu_answered = True  # type: ignore[attr-defined]
    setattr(mod, name, replacement)


def _no_inductor_for_optimizer_guards() -> None:
    """Dynamo asks, for every tensor an optimizer holds, whether CUDA graphs keep its address; to
    ask, it imports Inductor's CUDA-graph trees (0.7 s on this machine, a third of a small model's
    first compiled step), even for a tensor that is not on CUDA, whose answer is always yes. The
    question is answered without the import for those tensors; CUDA tensors still go to torch."""

    def wrap(original: Callable) -> Callable:
        def is_static_for_cudagraphs(x: torch.Tensor) -> bool:
            return original(x) if x.is_cuda else True

        return is_static_for_cudagraphs

    _replace_in_torch("torch._dynamo.variables.optimizer", "_is_static_for_cudagraphs", wrap)


def _no_guard_latency_profile() -> None:
    """After compiling a frame, Dynamo times its guards once for a debug log line and the
    ``guard_latency_us`` compile metric, first flushing the CPU caches to time them cold: 15 ms per
    frame here, a tenth of a small model's first compiled step. Once the tpu backend is in use, the
    timing runs only while Dynamo's guard log is on at debug level; otherwise the metric reads 0."""

    def wrap(original: Callable) -> Callable:
        from torch._dynamo.guards import guards_log

        def profile_guard_manager(root: Any, scope: Any, n_iters: int) -> float:
            return original(root, scope, n_iters) if guards_log.isEnabledFor(logging.DEBUG) else 0.0

        return profile_guard_manager

    _replace_in_torch("torch._dynamo.guards", "profile_guard_manager", wrap)


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Adjusts Dynamo's modules as soon as each is loaded, whatever backend or tool loads them
    (``torch._dynamo.explain``, ``backend="eager"``), before Dynamo traces anything: our frames
    skipped (with any backend, eager code between graph breaks runs our kernels under Dynamo's
    frame hook, which would otherwise try to compile the jax functions they call, and fail on jax's
    internals), and the optimizer guards' and guard profile's shortcuts in place before the first
    optimizer is traced. Importing Dynamo up front instead would add 0.65 s to ``import torch_tpu``."""

    def __init__(self, pending: dict[str, Callable[[Any], None]]) -> None:
        self.pending = pending

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        then = self.pending.pop(fullname, None)
        if then is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Then(spec.loader, then)
        return spec


class _Then(importlib.abc.Loader):
    """A loader that runs a module as its own loader would, then calls ``then`` with it."""

    def __init__(self, inner: Any, then: Callable[[Any], None]) -> None:
        self._inner = inner
        self._then = then

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        self._then(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package...: the file's own
        return getattr(self._inner, name)


def adjust_dynamo_when_loaded() -> None:
    """Called at ``import torch_tpu``: each adjustment is made now if its Dynamo module is loaded,
    else when it is."""
    adjustments: dict[str, Callable[[Any], None]] = {
        "torch._dynamo.trace_rules": skip_our_frames,
        "torch._dynamo.variables.optimizer": lambda module: _no_inductor_for_optimizer_guards(),
        "torch._dynamo.guards": lambda module: _no_guard_latency_profile(),
    }
    pending = {}
    for name, then in adjustments.items():
        if name in sys.modules:
            then(sys.modules[name])
        else:
            pending[name] = then
    if pending and not any(isinstance(f, _WhenDynamoLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _WhenDynamoLoads(pending))


_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def tpu_backend(gm: torch.fx.GraphModule, example_inputs: list, mode: str | None = None,
                options: dict | None = None) -> Callable:
    """The Dynamo backend registered as ``"tpu"``.

    ``torch.compile`` passes its ``mode`` and ``options`` on to the backend (torch hands a
    registered backend ``mode`` unless it is ``"default"``). Every mode compiles the same XLA
    program: XLA makes its own fusion and tuning choices. Every mode also replays a training step's
    program once it repeats (one executable call, see ``fused._Template``), which is what CUDA
    graphs give ``"reduce-overhead"`` on CUDA, and trusts Dynamo's guards for the graphs' input
    signatures (see :func:`_compile`). Unlike CUDA graphs, no mode
    overwrites earlier outputs: each call's outputs are new tensors, so values kept from one step
    stay valid after the next. ``options`` are inductor's settings; none means anything here, so
    they raise rather than be ignored."""
    from torch._functorch.aot_autograd import aot_module_simplified

    if mode is not None and mode not in _MODES:
        raise RuntimeError(f"torch.compile(backend='tpu'): unrecognized mode={mode!r}, should be one of: "
                           f"{', '.join(_MODES)}")
    if options:
        raise NotImplementedError(
            f"torch.compile(backend='tpu'): the tpu backend takes no options (got {sorted(options)}, which are "
            "inductor's); leave options unset"
        )

    skip_our_frames()
    _no_inductor_for_optimizer_guards()
    _no_guard_latency_profile()
    try:
        return aot_module_simplified(
            gm, example_inputs, fw_compiler=_compile, bw_compiler=_compile, inference_compiler=_compile_inference,
            decompositions=_decompositions(), keep_inference_input_mutations=True,
        )
    except SystemError as e:  # an error of the backward's trace, lost by torch's engine (_torch_tpu_autoload._Guard)
        lost = torch.tpu.take_lost_exception()
        if lost is None:
            raise
        if not isinstance(lost, _DATA_DEPENDENT):
            raise lost from e
        return _eager_graph(gm, lost)
    except _DATA_DEPENDENT as e:
        return _eager_graph(gm, e)


def _data_dependent() -> tuple[type[BaseException], ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode


_DATA_DEPENDENT = _data_dependent()


def _eager_graph(gm: torch.fx.GraphModule, why: BaseException) -> Callable:
    """A graph whose forward or backward has an op with a data-dependent shape (the gradient of
    ``x[mask] = v`` reads ``grad[mask]``): no static XLA program computes it, so Dynamo's graph runs
    op by op in eager mode, where every op is served; warned once per op."""
    what = str(getattr(why, "func", "")) or type(why).__name__
    if what not in _WARNED_EAGER:
        _WARNED_EAGER.add(what)
        warnings.warn(
            f"torch.compile(backend='tpu'): {what} has a data-dependent shape in this graph (forward or backward); "
            "the graph runs in eager mode", stacklevel=2,
        )
    metrics.eager_graphs[what] += 1
    return gm.forward


_WARNED_EAGER: set[str] = set()
