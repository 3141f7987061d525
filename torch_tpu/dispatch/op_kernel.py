"""From the PyTorch dispatcher to the lowering table: one plan per (op, input signature).

For every lowered functional overload this registers three ``PrivateUse1`` kernels: the
functional one, its in-place twin and its ``out=`` twins. Each kernel has two paths.

* **The fast path**, every call (:meth:`_OpKernel.__call__`): the checks that depend on values or
  on which tensors alias which (a plan cannot answer them, so they are named in it:
  :attr:`Plan.value_checks`), the call's signature (tensor shapes and dtypes, static values) with
  its runtime inputs (jax arrays and Python numbers), the plan looked up by that signature, its
  program run or recorded, the outputs wrapped as tpu tensors.
* **The slow path**, once per signature (:meth:`_OpKernel._slow_path`): where the call runs (the
  placement heuristics: ``host_placement``, ``view_reads``, ``runtime_ints``), then
  :meth:`_OpKernel._plan`: torch's own meta kernel (exactly CPU's shape, dtype and in-place-cast
  errors, and the results' shapes and dtypes), CPU's out-dtype and integer refusals, the written
  tensor's internal overlap, and the :class:`Program` that calls the lowering and casts to the
  meta kernel's dtypes.

CompositeImplicitAutograd overloads are never registered: a backend kernel would hide their
autograd formula.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.core import extension as _extension
from torch_tpu.core import rng as _rng
from torch_tpu.dispatch import host_placement as _host_placement
from torch_tpu.dispatch import runtime_ints as _runtime_ints
from torch_tpu.dispatch import view_reads as _view_reads
from torch_tpu.dispatch.fallback import cpu_stream_kernel, host_on_tpu_kernel
from torch_tpu.ops._registry import (
    HAND_KERNELS,
    IGNORED_KWARGS,
    LOWERINGS,
    Lowering,
    dispatcher_overloads,
    is_mutating,
)
from torch_tpu.runtime import checks, executor, fused, metrics
from torch_tpu.runtime.errors import raise_named
from torch_tpu.runtime.executor import Program
from torch_tpu.tensor import math_bits as _math_bits
from torch_tpu.tensor import out_dtypes as _out_dtypes
from torch_tpu.tensor import overlap as _overlap
from torch_tpu.tensor import storage as _storage
from torch_tpu.tensor import value_checks as _value_checks
from torch_tpu.tensor.meta import device_mismatch, meta_outputs, to_meta
from torch_tpu.tensor.storage import TPU_DEVICE, base_array, is_tpu, new_tensor, read, read_view, set_base, write

aten = torch.ops.aten


class _Tensor(tuple):
    """Signature of a tensor argument: (shape, dtype). A distinct type so it can't be confused
    with a user's tuple."""


class _View(tuple):
    """Signature of a tensor argument that is a strided view: (shape, dtype, base shape, stride,
    offset). The base array is the runtime input and the strided read happens inside the op's
    program, so a transposed or sliced input costs no separate device call."""


class _Empty(tuple):
    """Signature of a whole uninitialised storage (``empty`` before ``fill_``): (shape, dtype, None).
    Its zeros are made inside the op's program, not by a program of their own."""


class _Scalar(tuple):
    """Signature of a runtime Python number or CPU 0-dim tensor: (python type or dtype,)."""


# How an argument's Python numbers are treated: all static, or floats (and complex) at run time.
# Python ints stay static: lowerings may branch on them, and they rarely change between steps;
# NUMBERS (``Lowering.runtime_numbers``) makes ints and bools runtime arguments too.
STATIC, FLOATS, NUMBERS = 0, 1, 2


def _spec(a: Any, dynamic: int, dyn: list, op_name: str) -> Any:
    """The signature of one argument, appending its runtime inputs to ``dyn``."""
    if isinstance(a, torch.Tensor):
        if a.device == TPU_DEVICE:
            st = a.untyped_storage()
            size = tuple(a.shape)
            dtype = a.dtype
            if dtype is st._dtype:
                if size == st._shape and a.storage_offset() == 0 and a.is_contiguous():
                    if st._jx is None and (_storage._capture is None or _storage._capture.materialize(st) is None):
                        return _Empty((size, dtype, None))  # not equal to _Tensor((size, dtype)) as a key
                    dyn.append(base_array(st))  # the whole base: no read at all
                    return _Tensor((size, dtype))
                dyn.append(base_array(st))
                return _View((size, dtype, st._shape, tuple(a.stride()), a.storage_offset()))
            dyn.append(read(a))  # another element type over the storage (view_as_real)
            return _Tensor((size, dtype))
        if a.dim() == 0 and a.device.type == "cpu":  # a wrapped number, allowed as on CUDA
            dyn.append(_dtypes.cpu_to_numpy(a).copy())  # XLA:CPU may alias host memory; the op is async
            return _Scalar((a.dtype,))
        raise device_mismatch(op_name, a.device)
    t = type(a)
    if dynamic and (t is float or t is complex or (dynamic == NUMBERS and (t is int or t is bool))):
        dyn.append(a)
        return _Scalar((t,))
    if t is list or t is tuple:
        return tuple(_spec(x, dynamic, dyn, op_name) for x in a)
    return a


_op_counts = metrics.op_counts  # never rebound (a reset clears it)
_FUSED = executor.EagerMode.FUSED  # the mode read directly: recording() is a call more per tensor
_STRICT = executor.EagerMode.STRICT
_SLOW = object()  # _key_of's answer for an argument only _spec handles
_Lazy = fused.Lazy
_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter
_extension.set_key_types(_Lazy)
# a list of tpu tensors keyed in C++ (csrc/keys.cpp); None without the extension: _key_of's loop
_KEY_OF_TENSORS = _extension.key_of_tensors()
_FLOAT_KEY = _Scalar((float,))
_INT_KEY = _Scalar((int,))
_BOOL_KEY = _Scalar((bool,))
# 0-d CPU tensors (Python numbers torch wraps, ``x * 0.5``) of these dtypes _key_of reads with
# ``item()``, exactly, into a 0-d array of the same dtype: several times cheaper than _spec's copy
_WRAPPED = {d: _dtypes.TORCH_TO_JAX[d] for d in (torch.float64, torch.float32, torch.int64, torch.int32, torch.bool)}


def _key_of(a: Any, dynamic: int, dyn: list) -> Any:
    """:func:`_spec` for the arguments of nearly every call (a tpu tensor whose array is at hand,
    a number, a list of ints or of tensors), with the same runtime inputs and a key equal to
    _spec's: its (shape, dtype) tuples are plain ones (a tuple subclass compares and hashes as a
    tuple), which a kernel's cache lookup needs, while building a program needs _spec's types.
    ``_SLOW`` (nothing appended) for anything else: an empty storage, a capture in progress, a
    placeholder to run outside fused mode, a CPU tensor, a wrong device."""
    t = type(a)
    if t is _TENSOR or t is _PARAMETER:
        # only tpu storages carry an array (tensors live on tpu:0): a CPU tensor's has none
        st = a.untyped_storage()
        try:
            v = st._jx
            dtype = st._dtype
        except AttributeError:  # a CPU tensor: a wrapped number (``x + 1``) is _spec's runtime 0-d input
            to_np = _WRAPPED.get(a.dtype)
            if to_np is None or a.dim() or a.device.type != "cpu":
                return _SLOW
            dyn.append(np.array(a.item(), to_np))  # a fresh 0-d array, as _spec's copy: the op may run later
            return (a.dtype,)
        if dtype is not a.dtype or v is None or _storage._capture is not None:
            return _SLOW
        if type(v) is _Lazy:
            if v.value is not None:
                v = st._jx = v.value  # computed: drop the placeholder (as base_array does)
            elif executor._mode is not _FUSED and not executor.recording():
                return _SLOW  # base_array runs the trace
        size = a.shape
        offset = a.storage_offset()
        dyn.append(v)
        if not offset and size == st._shape and a.is_contiguous():
            return (size, dtype)
        return (size, dtype, st._shape, a.stride(), offset)
    if t is int or t is bool:
        if dynamic == NUMBERS:
            dyn.append(a)
            return _INT_KEY if t is int else _BOOL_KEY
        return a
    if t is float:
        if dynamic:
            dyn.append(a)
            return _FLOAT_KEY
        return a
    if t is list:
        if not a:
            return ()
        first = type(a[0])
        if first is int and dynamic != NUMBERS:
            for x in a:
                if type(x) is not int:
                    return _SLOW
            return tuple(a)
        if first is float and all(type(x) is float for x in a):
            # a foreach op's scalars (AdamW's bias corrections, one per parameter): each float as
            # the loop below would key it, without a call per element
            if not dynamic:
                return tuple(a)
            dyn.extend(a)
            return (_FLOAT_KEY,) * len(a)
        # a foreach op's list: the tensor case above, inline, for tensors whose storage holds an
        # array of their dtype (a pending placeholder only while recording); in C++ where it can
        fast = _storage._capture is None
        recording = executor._mode is _FUSED or executor.recording()
        if fast and _KEY_OF_TENSORS is not None and (first is _TENSOR or first is _PARAMETER):
            found = _KEY_OF_TENSORS(a, recording)
            if found is not None:
                dyn.extend(found[1])
                return found[0]
        out = []
        start = len(dyn)
        for x in a:
            tx = type(x)
            if fast and (tx is _TENSOR or tx is _PARAMETER):
                st = x.untyped_storage()
                try:
                    v = st._jx
                    same = x.dtype is st._dtype
                except AttributeError:  # not a tpu tensor
                    v = None
                if v is not None and same:
                    if type(v) is _Lazy:
                        if v.value is not None:
                            v = st._jx = v.value
                        elif not recording:
                            v = None
                    if v is not None and not x.storage_offset():
                        size = x.shape
                        if size == st._shape and x.is_contiguous():
                            dyn.append(v)
                            out.append((size, st._dtype))
                            continue
            k = _key_of(x, dynamic, dyn)
            if k is _SLOW:
                del dyn[start:]  # _spec redoes the whole list
                return _SLOW
            out.append(k)
        return tuple(out)
    if a is None or t is torch.dtype:
        return a
    return _SLOW


def _rebuild(s: Any, it) -> Any:
    """The lowering's argument from its signature, taking runtime inputs from ``it``."""
    t = type(s)
    if t is _Tensor or t is _Scalar:
        return next(it)
    if t is _Empty:
        return jnp.zeros(s[0], _dtypes.to_jax(s[1]))
    if t is _View:
        return read_view(s[2], s[0], s[3], s[4], s[1], next(it))
    if t is tuple:
        return [_rebuild(x, it) for x in s]
    return s


class Plan:
    """What the calls of one (op, input signature) run, decided once by the slow path.

    ``program``: the XLA program; ``avals``: per result its (shape, dtype), None where an
    ``output_mask`` leaves it undefined; ``exact``: True when every result is defined, contiguous
    and of the meta kernel's shape, a list of per-result layouts (``_layout``) when some are
    strided, else False (the lowering's own shapes). ``value_checks`` names what the fast path
    still checks at every call, because it depends on values or identities, not on the signature.
    """

    __slots__ = ("program", "avals", "exact", "value_checks")

    def __init__(self, program: Program, avals: list, exact: Any, value_checks: tuple[str, ...]) -> None:
        self.program = program
        self.avals = avals
        self.exact = exact
        self.value_checks = value_checks + (("the inputs' host copies (a host op follows)",)
                                            if program.host_follows else ())

    def __repr__(self) -> str:
        checks = "; ".join(self.value_checks) or "none"
        return f"Plan({self.program.name}, every call checks: {checks})"


class _OpKernel:
    """The PrivateUse1 kernel of one ATen overload, backed by one lowering."""

    counts_itself = True  # in metrics()["op_counts"], first thing in __call__

    def __init__(self, op: torch._ops.OpOverload, lowering: Lowering, kind: str) -> None:
        self.op = op
        self.name = str(op)
        self.lowering = lowering
        self.kind = kind  # functional | inplace | out
        schema = op._schema
        self.dynamic = {a.name: NUMBERS if a.name in lowering.runtime_numbers else
                        STATIC if lowering.static_scalars else FLOATS for a in schema.arguments}
        self.pos_dynamic = [self.dynamic[a.name] for a in schema.arguments if not a.kwarg_only]
        positional = [a.name for a in schema.arguments if not a.kwarg_only]
        # value arguments whose Python ints become runtime inputs once they change at every call
        # (torch_tpu/dispatch/runtime_ints.py); not for lowerings that take their numbers as constants
        at, kw = _runtime_ints.value_arguments(schema)
        if lowering.static_scalars or lowering.random:
            at, kw = [], set()
        self.value_at = [i for i in at if self.pos_dynamic[i] != NUMBERS]
        self.value_kw = {k for k in kw if self.dynamic[k] != NUMBERS}
        self.ints = _runtime_ints.WATCH if self.value_at or self.value_kw else None
        self.int_values: dict = {}  # a call's pattern -> the sets of ints it met
        self.int_sites: set = set()  # the user lines whose ints are runtime inputs
        # the signature of the last cache hit of a program that may follow the host (see __call__)
        self.follow_key: Any = None
        self.int_dynamic = {**self.dynamic, **{k: NUMBERS for k in self.value_kw},
                            **{positional[i]: NUMBERS for i in self.value_at}}
        self.int_pos_dynamic = [NUMBERS if i in self.value_at else d for i, d in enumerate(self.pos_dynamic)]
        self.generator_at = positional.index("generator") if "generator" in positional else None  # poisson
        self.out_names = [a.name for a in schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write]
        self.returns_list = len(schema.returns) == 1 and isinstance(schema.returns[0].type, torch.ListType)
        self.single = len(schema.returns) == 1 and not self.returns_list
        self.checks_overlap = kind != "functional" and _checks_overlap(op)
        # per call, what the written tensor may share with the inputs: an indexed write's check, or
        # the positions of an elementwise op's inputs (checked inline)
        rule = _overlap.rule(op, kind)
        self.overlap = rule if callable(rule) else None
        self.overlap_at = rule if type(rule) is tuple else ()
        self.out_name = self.out_names[0] if self.out_names else None
        self.plans: dict[Any, Plan] = {}  # signature -> its plan
        # the checks the fast path makes at every call (values and identities, which no plan answers)
        named = []
        if lowering.check is not None:
            named.append(f"values ({getattr(lowering.check, '__qualname__', 'the lowering check')})")
        if self.overlap_at or self.overlap is not None:
            named.append("the written tensor's overlap with the inputs")
        self.value_checks = tuple(named)

    # -- the slow path: a plan for one signature
    def _plan(self, key: Any, args: tuple, kwargs: dict) -> Plan:
        """Every check that the signature decides, and the program: once per (op, signature)."""
        pos_spec, kw_spec = key[0], key[1]
        sig = ", ".join(_describe(s) for s in pos_spec)
        try:
            with warnings.catch_warnings():  # the resize warning is the kernel's, at every call
                warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
                metas = meta_outputs(self.op, args, kwargs, self.lowering.meta)
        except Exception as e:  # CPU's error type, with the op and the input shapes named
            metas = self._out_dtype_refused(e, args, kwargs, sig)
        else:
            refusal = _out_dtypes.integral_refusal(self.op, args, kwargs)  # an integer input CPU has no kernel for
            if refusal is not None:
                raise_named(refusal, f"{self.name}({sig})")
            if self.kind == "out":
                verdict = _out_dtypes.cpu_verdict(self.op, args, kwargs)
                if isinstance(verdict, BaseException):  # an out dtype CPU refuses, with CPU's words
                    raise_named(verdict, f"{self.name}({sig})")
        if self.checks_overlap:
            written = [args[0]] if self.kind == "inplace" else [kwargs.get(n) for n in self.out_names]
            _check_no_internal_overlap(written, f"{self.name}({sig})")
        if self.kind == "inplace":
            _check_inplace_cast(self.op, args, kwargs, sig)
            metas = list(to_meta(args[0])) if isinstance(args[0], (list, tuple)) else [to_meta(args[0])]
        avals = [None if m is None else (tuple(m.shape), m.dtype) for m in metas]  # None: undefined
        outs = [None if a is None else (a[0], _dtypes.to_jax(a[1])) for a in avals]
        lowering = self.lowering
        random = lowering.random
        name = self.name
        kw_names = [k for k, _ in kw_spec]

        exact: Any = not lowering.own_shapes and None not in avals
        # A result whose meta strides are not contiguous (an elementwise op on a channels_last or
        # permuted input, as CPU's TensorIterator lays it out) is stored in that physical order:
        # the program transposes it, and the tensor gets the meta strides over that storage. Also
        # where a backward's output_mask leaves some results undefined (a convolution's gradients).
        layouts = None
        if not lowering.own_shapes and self.kind == "functional":
            layouts = [None if m is None else _layout(m) for m in metas]
            if any(layouts):
                exact = layouts
            else:
                layouts = None
        perms = None if layouts is None else [None if lay is None else lay[2] for lay in layouts]
        if self.kind == "out":
            exact = self._resized_layouts(args, kwargs)

        if avals and not lowering.own_shapes and all(a is not None and 0 in a[0] for a in avals):
            # every result is empty (a zero batch): nothing to compute, and a lowering's window or
            # modulo arithmetic need not cope with zero sizes. The meta kernel made CPU's checks.
            empties = [(o[0] if lay is None else lay[1], o[1]) for o, lay in zip(outs, layouts or [None] * len(outs))]

            def program(*inputs):
                return tuple(jnp.zeros(*e) for e in empties)

            built = Program(f"{name}({sig})", program, multi=True,
                            avals=[jax.ShapeDtypeStruct(*e) for e in empties],
                            key=tuple(zip([a.name for a in self.op._schema.arguments if not a.kwarg_only], pos_spec))
                            + tuple(kw_spec))
            return Plan(built, avals, exact, self.value_checks)

        half_complex = {i for i, a in enumerate(avals) if a is not None and a[1] is torch.complex32}

        def program(*inputs):
            it = iter(inputs)
            key = _rng.key_from(next(it), next(it)) if random else None
            pargs = [_rebuild(s, it) for s in pos_spec]
            pkw = {k: _rebuild(s, it) for k, s in zip(kw_names, (s for _, s in kw_spec))}
            res = lowering.apply(key, pargs, pkw, outs, name)
            if half_complex:  # complex32 results, rounded as a complex32 holds them (dtypes)
                res = [_dtypes.round_complex32(r) if i in half_complex else r for i, r in enumerate(res)]
            if perms is not None:
                return tuple(r if p is None else jnp.transpose(r, p) for r, p in zip(res, perms) if r is not None)
            return tuple(r for r in res if r is not None)

        if lowering.own_shapes:
            out_avals = None
        elif layouts is not None:
            out_avals = [jax.ShapeDtypeStruct(o[0] if lay is None else lay[1], o[1])
                         for o, lay in zip(outs, layouts) if o is not None]
        else:
            out_avals = [jax.ShapeDtypeStruct(*o) for o in outs if o is not None]
        labels = [a.name for a in self.op._schema.arguments if not a.kwarg_only]
        labelled = tuple(zip(labels, pos_spec)) + tuple(kw_spec)
        built = Program(f"{name}({sig})", program, multi=True, avals=out_avals, key=labelled)
        built.host_follows = (self.kind == "functional" and not random and not lowering.own_shapes
                              and _host_placement.may_follow(args, kwargs, avals))
        return Plan(built, avals, exact, self.value_checks)

    def _resized_layouts(self, args: tuple, kwargs: dict) -> list:
        """Per out= tensor, the layout (``_layout``) CPU gives it when the op resizes it: the
        functional op's, where that is dense but not contiguous (an elementwise op of a permuted
        input: CPU's structured kernels restride a resized output as the functional result would
        be), else None (contiguous). torch's meta kernels keep a resized out contiguous."""
        functional = _functional_of(self.op)
        if functional is None:
            return []
        try:
            metas = meta_outputs(functional, args, {k: v for k, v in kwargs.items() if k not in self.out_names},
                                 self.lowering.meta)
        except Exception:  # noqa: BLE001 - the out= call's own meta run has the last word on errors
            return []
        return [None if m is None else _layout(m) for m in metas]

    def _runtime_int_key(self, args: tuple, kwargs: dict) -> tuple[list, Any]:
        """A call's runtime inputs and signature with the value arguments' Python ints as runtime
        inputs (torch_tpu/dispatch/runtime_ints.py)."""
        dyn: list = []
        pos = tuple([_spec(a, d, dyn, self.name) for a, d in zip(args, self.int_pos_dynamic)])
        return dyn, self._signature(pos, args, kwargs, dyn, self.int_dynamic)

    def _ints_at_run_time(self, args: tuple, kwargs: dict, dyn: list, key: Any) -> tuple[list, Any, Any]:
        """Makes the value arguments' Python ints runtime inputs at this call's line (see
        torch_tpu/dispatch/runtime_ints.py). The first such program is traced abstractly here, at the op: a
        lowering that needs the number itself keeps this kernel's ints static at every line.
        Returns this call's runtime inputs, signature and plan (None: still to be made)."""
        new_dyn, new_key = self._runtime_int_key(args, kwargs)
        entry = self.plans.get(new_key)
        if entry is None:
            try:
                entry = self._plan(new_key, args, kwargs)
                jax.eval_shape(entry.program.fn, *[jax.ShapeDtypeStruct(x.shape, x.dtype) if type(x) is fused.Lazy
                                                   else x for x in new_dyn])
            except Exception:  # noqa: BLE001 - the lowering needs its ints (or refuses the call: the static build says)
                self.ints = _runtime_ints.REFUSED
                self.int_values.clear()
                return dyn, key, None
            self.plans[new_key] = entry
        self.int_sites.add(fused.user_site())
        return new_dyn, new_key, entry

    def _shape_refusal_first(self, args: tuple, kwargs: dict) -> None:
        """A value check failed on host values (a target out of range). CPU checks shapes before
        it reads a value, so if the meta kernel refuses the call too, its error is the one raised
        (``multi_margin_loss`` of a (10, 0) input: "Expected non-empty vector or matrix")."""
        pos = tuple(_spec(a, d, [], self.name) for a, d in zip(args, self.pos_dynamic))
        try:
            self._metas(args, kwargs)
        except Exception as e:
            self._out_dtype_refused(e, args, kwargs, ", ".join(_describe(s) for s in pos))

    def _metas(self, args: tuple, kwargs: dict) -> list:
        """The meta kernel's results for a call (its checks already passed)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="An output with one or more elements was resized")
            return meta_outputs(self.op, args, kwargs, self.lowering.meta)

    def _out_dtype_refused(self, e: Exception, args: tuple, kwargs: dict, sig: str) -> list:
        """The meta kernel refused the call: re-raised, named (in CPU's words when it refused an
        out or in-place tensor's dtype and CPU refuses too), unless it refused an ``out``
        tensor's dtype that CPU accepts (``abs`` of complex into float16): then the results'
        metas are the functional op's, in the out tensors' dtypes (the program casts)."""
        where = f"{self.name}({sig})"
        if self.kind == "functional" or not _out_dtypes.is_meta_dtype_refusal(e):
            refusal = _out_dtypes.dtype_refusal(self.op, args, kwargs)  # CPU's type for a dtype it has no kernel for
            raise_named(_tidy(e) if refusal is None else refusal, where)
        verdict = _out_dtypes.cpu_verdict(self.op, args, kwargs)  # in place too: abs_ of complex
        functional = _functional_of(self.op) if verdict is None and self.kind == "out" else None
        if functional is None:
            raise_named(verdict if isinstance(verdict, BaseException) else _tidy(e), where)
        plain = {k: v for k, v in kwargs.items() if k not in self.out_names}
        try:
            metas = meta_outputs(functional, args, plain, None)
        except Exception as e2:
            raise_named(_tidy(e2), where)
        return [m if m is None else torch.empty_like(m, dtype=kwargs[n].dtype)
                for m, n in zip(metas, self.out_names)]

    def _signature(self, pos: tuple, args: tuple, kwargs: dict, dyn: list, dynamic: dict | None = None) -> tuple:
        """The cache key of a call: its positional arguments' signature ``pos``, then the keyword
        arguments' (their runtime inputs appended to ``dyn``), by ``dynamic`` (the kernel's own by
        default)."""
        if kwargs:
            name = self.name
            dynamic = self.dynamic if dynamic is None else dynamic
            kw = tuple([
                (k, _spec(v, dynamic.get(k, FLOATS), dyn, name))
                for k, v in kwargs.items()
                if k not in IGNORED_KWARGS and k not in self.out_names
            ])
            key = (pos, kw)
            if kwargs.get("memory_format") is not None:  # not the lowering's, but it sets the strides
                key = (pos, kw, kwargs["memory_format"])
        else:
            key = (pos, ())
        if self.kind == "out":
            # the out tensors' dtypes decide the meta kernel's checks and the program's casts: a
            # program built for a uint8 ``out`` must not serve an int64 one
            key = (*key, tuple([getattr(kwargs.get(n), "dtype", None) for n in self.out_names]))
        return key

    def _slow_path(self, args: tuple, kwargs: dict, key: Any) -> tuple[Plan | None, list, Any]:
        """A call whose signature has no plan yet: where it runs, then its plan (made once).
        Returns (plan, the call's runtime inputs, None), or (None, None, the results) where a
        placement heuristic ran the call itself (on the host, or over views read first)."""
        kind, lowering, name = self.kind, self.lowering, self.name
        plain = kind == "functional" and not lowering.random
        if plain and (_host_placement.inputs_on_host(args, kwargs) or _host_placement.churned_here(name, args, kwargs)):
            # host results in (nothing to compile or wait for), or a line whose shapes churn
            return None, None, _host_placement.run(self.op, args, kwargs, name)
        plan = None
        if self.int_sites and fused.user_site() in self.int_sites:
            dyn, key = self._runtime_int_key(args, kwargs)  # a line whose ints change every call
            plan = self.plans.get(key)
        else:
            # the key with _spec's types, which the plan's program and the churn pattern read
            dyn = []
            pos = tuple([_spec(a, d, dyn, name) for a, d in zip(args, self.pos_dynamic)])
            key = self._signature(pos, args, kwargs, dyn)
            if self.ints is _runtime_ints.WATCH and _runtime_ints.churns(self, key, args, kwargs):
                dyn, key, plan = self._ints_at_run_time(args, kwargs, dyn, key)
        if plan is None:
            if plain and _host_placement.on_host(name, key, args, kwargs):
                return None, None, _host_placement.run(self.op, args, kwargs, name)
            if kind != "out" and not executor.recording() and _view_reads.churns(name, key):
                if kind == "functional":
                    return None, None, _view_reads.run(self, args, kwargs, lambda: self._metas(args, kwargs), _layout)
                if type(args[0]) is not list:
                    return None, None, _view_reads.run_inplace(self, args, kwargs)
            plan = self.plans[key] = self._plan(key, args, kwargs)
        return plan, dyn, None

    # -- the kernel
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The fast path: value checks, the signature, its plan, the program run or recorded, the
        outputs wrapped. A signature met for the first time takes :meth:`_slow_path`."""
        _op_counts[self.name] += 1
        lowering = self.lowering
        mark = -1
        found = None  # strict mode: the op's checks, those the device must make run by its program
        if lowering.check is not None:  # reads values on the host: never recorded
            mark = checks.mark()
            try:
                if executor.recording():
                    with executor.eager_section():
                        lowering.check(*args, **kwargs)
                elif executor._mode is _STRICT:
                    previous = _value_checks.start_joining()
                    try:
                        lowering.check(*args, **kwargs)
                    finally:
                        found = _value_checks.stop_joining(previous) or None
                else:
                    lowering.check(*args, **kwargs)
            except Exception as e:
                if getattr(e, "tpu_value_check", False):
                    self._shape_refusal_first(args, kwargs)
                raise
        try:
            if self.overlap_at:
                out = args[0] if self.kind == "inplace" else kwargs.get(self.out_name)
                for i in self.overlap_at:
                    # a Python number stays one here (_is_alias_of would make it a tensor)
                    if i < len(args) and isinstance(args[i], torch.Tensor) and _is_alias_of(out, args[i]):
                        _refuse_partial(self, out, args[i])
            elif self.overlap is not None:
                try:
                    self.overlap(args, kwargs)
                except RuntimeError as e:
                    raise_named(e, self.name)
            dyn: list = []
            kind = self.kind
            pos = []
            for a, d in zip(args, self.pos_dynamic):
                k = _key_of(a, d, dyn)
                pos.append(_spec(a, d, dyn, self.name) if k is _SLOW else k)
            pos = tuple(pos)
            key = (pos, ()) if not kwargs and kind != "out" else self._signature(pos, args, kwargs, dyn)
            plan = self.plans.get(key)
            hit = plan is not None
            if not hit:
                plan, dyn, done = self._slow_path(args, kwargs, key)
                if plan is None:
                    if found:  # it ran elsewhere (on the host, a view's own path): its checks alone
                        _value_checks.run_alone(found)
                    return done
            program = plan.program
            if program.host_follows:
                fusing = executor._mode is _FUSED
                if ((_host_placement.arrays_on_host(dyn) and _host_placement.inputs_on_host(args, kwargs))
                        or _host_placement.churned_here(self.name, args, kwargs, key if fusing else None)):
                    # a host op's results in (nothing to wait for); or a line whose shapes churn,
                    # whose call found a program another line compiled: it runs where its line's
                    # calls run, so a decoding loop's second call takes its first call's paths (in
                    # fused mode: its first call's traces, see churned_here)
                    if found:
                        _value_checks.run_alone(found)
                    return _host_placement.run(self.op, args, kwargs, self.name)
                if fusing:
                    _host_placement.recorded(self.name, key)
                elif hit and key != self.follow_key:
                    # a new signature that found a program compiled before (by another line, or an
                    # earlier loop that stopped at some length) still steps its line's progression:
                    # else a loop whose first lengths were compiled elsewhere compiles every length
                    # past them until misses alone show the churn. A repeated signature costs a
                    # comparison; the slow path already counted a miss
                    self.follow_key = key
                    if _host_placement.on_host(self.name, key, args, kwargs):
                        if found:
                            _value_checks.run_alone(found)
                        return _host_placement.run(self.op, args, kwargs, self.name)
            if lowering.random:
                generator = kwargs.get("generator")
                if generator is None and self.generator_at is not None and self.generator_at < len(args):
                    generator = args[self.generator_at]
                dyn[:0] = _rng.next_inputs() if generator is None else _rng.inputs_from(generator)
            recording = executor._mode is _FUSED or executor.recording()
            if found is None:
                outs = fused.record(program, dyn) if recording else executor.run_now(program, dyn)
            elif recording:
                _value_checks.run_alone(found)
                outs = fused.record(program, dyn)
            else:  # one executable for the op and its checks
                outs = _value_checks.run_joined(program, dyn, found)
            avals, exact = plan.avals, plan.exact
            if kind == "functional":
                if exact is True:
                    if self.single:
                        shape, dtype = avals[0]
                        return new_tensor(shape, dtype, outs[0])
                    tensors = [new_tensor(shape, dtype, o) for o, (shape, dtype) in zip(outs, avals)]
                elif exact:  # some results laid out as their meta strides say (channels_last)
                    strided = _storage.new_strided
                    it = iter(outs)
                    tensors = [
                        None if a is None else new_tensor(a[0], a[1], next(it)) if lay is None
                        else strided(a[0], lay[0], lay[1], a[1], next(it))
                        for a, lay in zip(avals, exact)
                    ]
                else:  # results undefined by an output_mask (None), or of the lowering's own shapes
                    it = iter(outs)
                    tensors = [None if a is None else _own(next(it), a[1]) for a in avals]
                if self.single:
                    return tensors[0]
                return tensors if self.returns_list else tuple(tensors)
            if kind == "inplace":
                first = args[0]
                if type(first) is list:  # _foreach_*_: every tensor of the list, returning nothing
                    for t, v, k in zip(first, outs, key[0][0]):
                        _write_result(t, v, k, exact)
                    return None
                _write_result(first, outs[0], key[0][0], exact)
                return first
            name = self.name
            targets = [kwargs[n] for n in self.out_names]  # out=
            for i, (t, value, (shape, _)) in enumerate(zip(targets, outs, avals)):
                if not is_tpu(t):
                    raise device_mismatch(name, t.device)
                if tuple(t.shape) != shape:
                    if t.numel():
                        warnings.warn(_RESIZED.format(list(t.shape), list(shape)), UserWarning, stacklevel=2)
                    layout = exact[i] if i < len(exact) else None
                    if layout is None:
                        set_base(t, shape, t.dtype, None)
                    else:  # strided as CPU restrides a resized output (_resized_layouts)
                        set_base(t, layout[1], t.dtype, None)
                        _storage.set_geometry(t, t.untyped_storage(), 0, list(shape), list(layout[0]))
                write(t, value)
            return targets[0] if len(targets) == 1 else tuple(targets)
        except BaseException:
            if mark >= 0:  # the op failed after its value checks were queued: they go with it
                checks.drop_since(mark)
            raise


_is_alias_of = _overlap.alias_of


def _refuse_partial(kernel: _OpKernel, out: torch.Tensor, inp: torch.Tensor) -> None:
    try:
        _overlap.refuse_partial(out, inp)
    except RuntimeError as e:
        raise_named(e, kernel.name)


def _write_result(t: torch.Tensor, value: Any, k: Any, exact: Any) -> None:
    """An in-place op's result into its tensor ``t``, whose signature in the call was ``k``. A
    plain (shape, dtype) tuple is :func:`_key_of`'s for a whole contiguous storage of the tensor's
    own dtype, and ``exact`` says the result has that shape and dtype (the meta kernel's, which the
    program casts to): then the result simply replaces the storage's array, which is what
    :func:`write` would decide after checking all of that again."""
    if exact is True and type(k) is tuple and len(k) == 2:
        _storage._replace(t.untyped_storage(), value)
    else:
        write(t, value)


# CPU's words when an out= tensor with elements has the wrong shape (resize_output)
_RESIZED = ("An output with one or more elements was resized since it had shape {}, which does not match the "
            "required output shape {}. This behavior is deprecated, and in a future PyTorch release outputs will "
            "not be resized unless they have zero elements. You can explicitly reuse an out tensor t by resizing "
            "it, inplace, to zero elements with t.resize_(0).")


# Ops whose CPU kernels (TensorIterator's, mm and addmm, not bmm and baddbmm) refuse to write into a tensor with
# internal overlap although torch does not tag them pointwise. threshold_ is left out on purpose,
# as on CPU: writing it twice is harmless (it is idempotent).
_ALSO_OVERLAP_CHECKED = frozenset((
    "mish", "hardswish", "hardsigmoid", "hardtanh", "softplus", "softshrink", "hardshrink", "elu", "celu",
    "selu", "rrelu_with_noise", "leaky_relu", "gelu", "silu", "addmm", "mm", "addmv", "addr",
    "scatter", "scatter_add", "copy",
))


def _checks_overlap(op: torch._ops.OpOverload) -> bool:
    """Whether CPU refuses ``op``'s in-place or out= form on a written-to tensor with internal
    overlap (an ``expand``-ed tensor): its pointwise and random-fill kernels do, its reductions,
    masked and index fills do not."""
    tags = op.tags
    if torch.Tag.pointwise in tags or torch.Tag.nondeterministic_seeded in tags:
        return op._schema.name != "aten::threshold_"
    return op._schema.name.split("::")[1].rstrip("_") in _ALSO_OVERLAP_CHECKED


def _check_no_internal_overlap(written: list, where: str) -> None:
    """CPU's ``assert_no_internal_overlap``: a written tensor with a dimension of stride 0 and
    size > 1 (never dense) would have one element written several times. Once per signature (an
    expanded tensor's signature carries its strides)."""
    for t in written:
        if isinstance(t, torch.Tensor) and _overlap.internal(t):
            raise_named(RuntimeError(_overlap.INTERNAL), where)


def _check_inplace_cast(op: torch._ops.OpOverload, args: tuple, kwargs: dict, sig: str) -> None:
    """CPU refuses an in-place op whose result ``self`` cannot hold, which torch's meta kernels
    let through: a result dtype that does not cast safely to ``self``'s (``int_tensor *= 1.5`` as
    a 0-dim float tensor, ``int_tensor.fmod_(float_tensor)``) or a shape the other operands
    broadcast ``self`` to (``ones(2).pow_(ones(2, 1))``). Once per signature, when the program is
    built."""
    self = args[0] if args else None
    if not isinstance(self, torch.Tensor):
        return
    name = op._schema.name.split("::")[1]
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    args_sig = [(a.name, str(a.type)) for a in op._schema.arguments]
    overload = next((o for o in (getattr(packet, n) for n in packet.overloads())
                     if [(a.name, str(a.type)) for a in o._schema.arguments] == args_sig), None) if packet else None
    if overload is None:
        return
    try:
        res = meta_outputs(overload, args, kwargs, None)
    except Exception:  # the in-place meta kernel has the last word on anything else
        return
    if not res or not isinstance(res[0], torch.Tensor):
        return
    if not torch.can_cast(res[0].dtype, self.dtype):
        a, b = (_CPP_NAMES.get(str(d).split(".")[1], str(d)) for d in (res[0].dtype, self.dtype))
        raise_named(RuntimeError(f"result type {a} can't be cast to the desired output type {b}"), f"{op}({sig})")
    if tuple(res[0].shape) != tuple(self.shape):
        # the other operand broadcasts self to a bigger shape: an in-place op cannot resize self
        raise_named(RuntimeError(f"output with shape {list(self.shape)} doesn't match the broadcast shape "
                                 f"{list(res[0].shape)}"), f"{op}({sig})")


def _functional_of(out_op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The functional overload an ``out=`` overload writes the results of (same arguments, less
    the out tensors), or None."""
    outs = _out_args(out_op)
    names = [a.name for a in out_op._schema.arguments if a not in outs]
    packet = getattr(aten, out_op._schema.name.split("::")[1], None)
    for cand in dispatcher_overloads(packet) if packet is not None else ():
        if not is_mutating(cand) and [a.name for a in cand._schema.arguments] == names:
            return cand
    return None


# torch's dtype names as CPU's C++ kernels spell them in messages
_CPP_NAMES = {"float32": "Float", "float64": "Double", "float16": "Half", "bfloat16": "BFloat16", "int64": "Long",
              "int32": "Int", "int16": "Short", "int8": "Char", "uint8": "Byte", "bool": "Bool",
              "complex64": "ComplexFloat", "complex128": "ComplexDouble", "complex32": "ComplexHalf"}
_CAST = re.compile(r"result type torch\.(\w+) can't be cast to the desired output type torch\.(\w+)")


def _tidy(e: Exception) -> Exception:
    """Some of torch's Python meta kernels build messages from indented multi-line strings
    ("non-zero                       size"); CPU's C++ kernels say it with single spaces, which is
    what a user's (or a test's) pattern matches. The in-place cast refusal names dtypes as CPU
    does ("result type Float can't be cast to the desired output type Long")."""
    text = str(e)
    if len(e.args) != 1 or ("   " not in text and "result type torch." not in text):
        return e
    tidy = re.sub(r"(?<=\S) {3,}(?=\S)", " ", text)
    tidy = _CAST.sub(lambda m: f"result type {_CPP_NAMES.get(m[1], m[1])} can't be cast to the desired output "
                               f"type {_CPP_NAMES.get(m[2], m[2])}", tidy)
    try:
        new = type(e)(tidy)
    except Exception:
        return e
    if str(new) != tidy:
        return e
    new.__traceback__ = e.__traceback__
    return new


def _layout(m: torch.Tensor) -> tuple | None:
    """(stride, storage shape, permutation into it) for a meta result that is dense but not
    contiguous, else None (the result is made contiguous)."""
    shape, stride = tuple(m.shape), tuple(m.stride())
    if stride == _storage.contiguous_strides(shape):
        return None
    storage_shape = _storage.dense_layout(shape, stride)
    if storage_shape is None:
        return None
    perm = tuple(sorted(range(len(shape)), key=lambda d: -stride[d]))
    return stride, storage_shape, perm


def _own(value: Any, dtype: torch.dtype) -> torch.Tensor:
    return new_tensor(tuple(value.shape), dtype, value)


def _describe(s: Any) -> str:
    if type(s) is _Tensor or type(s) is _View or type(s) is _Empty:
        return f"{str(s[1]).removeprefix('torch.')}{list(s[0])}"
    if type(s) is _Scalar:
        return getattr(s[0], "__name__", str(s[0]))
    if type(s) is tuple:
        return "[" + ", ".join(_describe(x) for x in s) + "]"
    return repr(s)


# ------------------------------------------------------------------------------ registration
_libs: dict[str, torch.library.Library] = {}
REGISTERED: dict[str, str] = {}  # overload name -> how it is served
KERNELS: dict[str, Callable] = {}  # overload name -> its PrivateUse1 kernel (each counts its calls)


def _has_kernel(op: torch._ops.OpOverload, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
    except RuntimeError:
        return False


def _counting(name: str, fn: Callable) -> Callable:
    """``fn``, each call counted in ``metrics()["op_counts"]`` under the overload's name."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        metrics.op_counts[name] += 1
        return fn(*args, **kwargs)

    run.counts_itself = True
    return run


def _eager_section(op: torch._ops.OpOverload, fn: Callable) -> Callable:
    """``fn`` counted (unless it counts itself), and run as in strict mode when fused mode records
    (it may read the host). Under graph capture it is refused if it reads a tpu tensor."""
    count = 0 if getattr(fn, "counts_itself", False) else 1
    name = str(op)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        metrics.op_counts[name] += count
        if not executor.recording():
            return fn(*args, **kwargs)
        if _storage._capture is not None:  # graph capture: refused if it reads a tpu tensor
            _storage._capture.host_kernel(op, args, kwargs)
        with executor.eager_section():
            return fn(*args, **kwargs)

    run.counts_itself = True
    return run


def register_kernel(op: torch._ops.OpOverload, fn: Callable, how: str) -> None:
    """Registers ``fn`` as the PrivateUse1 kernel of ``op``: the one way an op gets served, so
    every served op is counted, whatever serves it."""
    if not getattr(fn, "counts_itself", False):
        fn = _counting(str(op), fn)
    fn = _math_bits.honouring(op, fn)
    namespace, name = op.name().split("::", 1)  # "aten", "add.Tensor"
    lib = _libs.get(namespace)
    if lib is None:
        lib = _libs[namespace] = torch.library.Library(namespace, "IMPL")
    lib.impl(name, fn, "PrivateUse1")
    REGISTERED[str(op)] = how
    KERNELS[str(op)] = fn


def _twins(op: torch._ops.OpOverload) -> list[tuple[torch._ops.OpOverload, str]]:
    """The in-place and out= overloads computed by ``op``'s lowering."""
    schema = op._schema
    base = schema.name.split("::")[1]
    found = []
    # same argument names *and types*: pow_.Scalar (Tensor self, Scalar exponent) is no twin of
    # pow.Scalar (Scalar self, Tensor exponent), though the overload names agree
    sig = [(a.name, str(a.type)) for a in schema.arguments]
    packet = getattr(aten, base + "_", None)
    for cand in (getattr(packet, n) for n in packet.overloads()) if packet is not None else ():
        if [(a.name, str(a.type)) for a in cand._schema.arguments] == sig:
            found.append((cand, "inplace"))
            break
    for cand in dispatcher_overloads(getattr(aten, base)):
        if cand is op or not is_mutating(cand):
            continue
        outs = [a for a in cand._schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in cand._schema.arguments if a not in outs]
        if outs and rest == sig:
            found.append((cand, "out"))
    return found


def _out_args(op: torch._ops.OpOverload) -> list:
    return [a for a in op._schema.arguments if a.kwarg_only and a.alias_info and a.alias_info.is_write]


def _out_from_functional(out_op: torch._ops.OpOverload, functional: torch._ops.OpOverload) -> Callable:
    """The ``out=`` kernel of an op served by a hand-written kernel: the functional op's results,
    copied into the ``out`` tensors (resized when their shape differs), as torch's out= ops do."""
    out_names = [a.name for a in _out_args(out_op)]
    name = str(out_op)

    def run(*args: Any, **kwargs: Any) -> Any:
        outs = [kwargs.pop(n) for n in out_names]
        result = functional(*args, **kwargs)
        results = [result] if isinstance(result, torch.Tensor) else list(result)
        for t, r in zip(outs, results):
            if not is_tpu(t):
                raise device_mismatch(name, t.device)
            if not torch.can_cast(r.dtype, t.dtype):
                raise RuntimeError(
                    f"{name}: result type {str(r.dtype).removeprefix('torch.')} can't be cast to the desired "
                    f"output type {str(t.dtype).removeprefix('torch.')}"
                )
            if tuple(t.shape) != tuple(r.shape):
                set_base(t, tuple(r.shape), t.dtype, None)
            t.copy_(r)
        return outs[0] if len(outs) == 1 else tuple(outs)

    run.counts_itself = True  # as the functional op it runs, which counts itself
    return run


def register_out_twins() -> int:
    """Registers the ``out=`` overloads whose functional op has a kernel of ours but no lowering
    twins (hand-written kernels, ``lower(by_name=True)`` entries): each runs the functional op,
    then copies."""
    n = 0
    served = [op for op, how in REGISTERED.items() if how != "fallback"]
    for op_name in served:
        base, _, overload = op_name.removeprefix("aten.").rpartition(".")
        packet = getattr(aten, base, None)
        functional = getattr(packet, overload, None) if packet is not None else None
        if functional is None or is_mutating(functional):
            continue
        names = [a.name for a in functional._schema.arguments]
        for cand in dispatcher_overloads(packet):
            outs = _out_args(cand)
            if not outs or str(cand) in REGISTERED or _has_kernel(cand, "CompositeImplicitAutograd"):
                continue
            if [a.name for a in cand._schema.arguments if a not in outs] == names:
                register_kernel(cand, _out_from_functional(cand, functional), "kernel (out= of the functional op)")
                n += 1
    return n


def register_table() -> int:
    """Registers every entry of the serving table with torch, once: the hand kernels, then the
    lowerings (and their in-place and out= twins) of every op without one, then the out= overloads
    of hand-kernel ops. Returns how many kernels were registered."""
    n = 0
    for op, hk in HAND_KERNELS.items():
        fn = hk.fn if hk.build is None else hk.build(lowering_kernel)
        register_kernel(op, fn if hk.fusable else _eager_section(op, fn), hk.how)
        n += 1
    for name in _extension.views_in_cpp():  # registered by the extension (csrc/views.cpp), counted there
        REGISTERED[name] = "view (C++)"
    metrics.count_source(_extension.take_view_counts)
    return n + register_lowerings() + register_out_twins()


def register_lowerings() -> int:
    """Registers kernels for every lowering in the table whose op has no hand kernel; returns how many."""
    n = 0
    for op, lowering in LOWERINGS.items():
        if lowering.graph_only:
            continue
        kind = "inplace" if is_mutating(op) else "functional"
        todo = [(op, kind)] + (_twins(op) if kind == "functional" and lowering.twins else [])
        for target, k in todo:
            if str(target) in REGISTERED or _has_kernel(target, "CompositeImplicitAutograd"):
                continue
            if target is not op and target in LOWERINGS:
                continue  # a twin with a lowering of its own
            fn = lowering_kernel(target, lowering, k)
            if lowering.random and _rng.SOURCE == "cpu":
                fn = cpu_stream_kernel(target, fn)
            if lowering.host_on_tpu:
                when = lowering.host_on_tpu if callable(lowering.host_on_tpu) else None
                fn = host_on_tpu_kernel(target, fn, when)
            register_kernel(target, fn, f"lowering ({k})")
            n += 1
    return n


def lowering_kernel(op: torch._ops.OpOverload, lowering: Lowering, kind: str = "functional") -> Callable:
    """The PrivateUse1 kernel serving ``op`` (its ``kind``: functional, inplace or out) with
    ``lowering``: the adapter every lowered op goes through, variants included."""
    if not lowering.variants:
        return _OpKernel(op, lowering, kind)
    by_variant = {
        name: _OpKernel(op, dataclasses.replace(lowering, fn=functools.partial(lowering.fn, **kw), variants=None), kind)
        for name, kw in lowering.variants.items()
    }
    choose = lowering.choose

    def run(*args: Any, **kwargs: Any) -> Any:
        return by_variant[choose(*args, **kwargs)](*args, **kwargs)

    run.counts_itself = True  # the variant's kernel counts the call
    return run
