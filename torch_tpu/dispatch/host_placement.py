"""Small ops whose shapes change at every call run on the host instead of compiling each shape.

XLA compiles one program per set of shapes. Most ops see a handful of shapes in a process, but the
bookkeeping around a decoding loop does not: ``generate()`` extends the token ids and the attention
mask by one column per token (``torch.cat``) and reads the last column of each (a view whose base
grows), so each of those ops has a new shape, or a view at a new offset, at every token. Compiling
them costs tenths of a second per token, while the tensors hold a few dozen integers.

So the dispatcher asks here when an op misses its program cache, and in strict mode when a
program that may follow the host is hit with another signature than its last hit (a program
compiled before, elsewhere, for a length the loop reaches: it still steps the loop's progression);
never for a repeated signature.
Only integer and boolean tensors qualify (ids, masks, positions: a model's activations never take
this path), each of at most ``MAX_ELEMENTS`` elements, views counted by the storage they read. An
op *pattern* is the op at one source line of the caller with its arguments' ranks and dtypes (the
sizes, offsets and Python ints left out). It churns when ``TORCH_TPU_HOST_CHURN`` (default 3)
successive signatures of it step by the same amount: the numbers of each (sizes, strides, offsets,
ints) minus those of the one before are the same non-zero vector, as when a sequence grows by a
token per call. A layer that runs one line at a few shapes, or a training loop whose batches have
random lengths, does not churn and stays compiled. From then on each new signature of a churning
pattern runs on the host CPU: torch's own CPU kernel on host copies of its inputs, its results
uploaded (a transfer, not a compile). Inputs uploaded from the host keep their host copy, so a
chain of such ops (the ids extended every token) reads no device memory; an input computed on the
device is read, a sync like the one ``generate()`` makes per token anyway.

A host op's results stay on the host as well as being uploaded, and a compiled op whose tensor
inputs are all such results runs on the host too (:func:`inputs_on_host`): ``position_ids[..., -1:]
+ 1`` between two host ``cat``s would otherwise be a one-op program that the second ``cat`` waits
for, and on one device queue that wait is behind the whole forward just dispatched. The rule
follows the data, not the op or the line, so the rest of a step (inputs a loader uploaded,
anything computed on the device) is unchanged.

Results are CPU's, bit for bit. Each such run is counted in ``metrics()["host_op_counts"]``.
In-place and ``out=`` forms, random ops, graph capture and big tensors always compile.
``TORCH_TPU_HOST_CHURN=0`` turns the host path off.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from torch_tpu.core import dtypes as _dtypes
from torch_tpu.dispatch.fallback import _from_cpu
from torch_tpu.runtime import checks, fused, host_reads, metrics
from torch_tpu.tensor import storage as _storage
from torch_tpu.tensor.transfer import numpy_to_device

CHURN_AFTER = int(os.environ.get("TORCH_TPU_HOST_CHURN", "3"))
MAX_ELEMENTS = 4096

# pattern -> (the numbers of its last signature, the step from the one before, how many steps in a row)
_progress: dict[tuple, tuple[tuple, tuple | None, int]] = {}
_churning: set[tuple] = set()
_churning_sites: set[tuple] = set()  # (op name, user line) of each pattern in _churning
# (op name, user line, signature) of the bookkeeping calls fused mode recorded on the device
_recorded_at: set[tuple] = set()


def _pattern(spec: Any) -> Any:
    """A signature with every shape reduced to its rank and every Python int to ``int``."""
    if isinstance(spec, tuple):
        kind = type(spec).__name__
        if kind == "_Tensor":
            return ("T", len(spec[0]), spec[1])
        if kind == "_View":
            return ("V", len(spec[0]), spec[1], len(spec[2]))
        if spec and spec[0] == "V" and len(spec) == 5:  # signature() of a hand kernel's tensor
            return ("V", len(spec[1]), spec[2], len(spec[3]))
        if kind == "_Empty":
            return ("E", len(spec[0]), spec[1])
        return tuple(_pattern(s) for s in spec)
    if type(spec) is int:
        return int
    return spec


def _numbers(spec: Any, out: list) -> list:
    """Every int of a signature, in order: sizes, strides, offsets, Python ints."""
    if isinstance(spec, tuple):
        for s in spec:
            _numbers(s, out)
    elif type(spec) is int:
        out.append(spec)
    return out


def signature(t: torch.Tensor) -> tuple:
    """A hand kernel's stand-in for the dispatcher's signature of tensor ``t``: its shape and dtype,
    and for a view its base's shape and offset (``_View``-like, so :func:`_pattern` reduces it)."""
    st = t.untyped_storage()
    return ("V", tuple(t.shape), t.dtype, st._shape, t.storage_offset())


def _values(args: tuple, kwargs: dict) -> list:
    """An ATen call's argument values, each list argument (``TensorList``, ``int[]``) opened: the
    whole nesting an op schema allows, walked directly (torch's pytree costs ~10 us a call)."""
    flat = []
    for a in (*args, *kwargs.values()):
        if type(a) is list or type(a) is tuple:
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def _small_integers(args: tuple, kwargs: dict) -> bool:
    found = False
    for a in _values(args, kwargs):
        if isinstance(a, torch.Tensor) and _storage.is_tpu(a):
            if a.dtype.is_floating_point or a.dtype.is_complex or a.requires_grad:
                return False
            if a.numel() > MAX_ELEMENTS or math.prod(a.untyped_storage()._shape) > MAX_ELEMENTS:
                return False
            found = True
    return found


def on_host(name: str, key: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this cache miss of op ``name`` (signature ``key``) runs on the host (see the module
    docstring). A signature that compiles is remembered towards its pattern's progression."""
    if CHURN_AFTER <= 0 or _storage._capture is not None or not _small_integers(args, kwargs):
        return False
    pattern = (name, fused.user_site(), _pattern(key))
    if pattern not in _churning:
        numbers = tuple(_numbers(key, []))
        last = _progress.get(pattern)
        if last is None or len(last[0]) != len(numbers):
            _progress[pattern] = (numbers, None, 0)
            return False
        step = tuple(b - a for a, b in zip(last[0], numbers))
        run = last[2] + 1 if step == last[1] and any(step) else 1
        _progress[pattern] = (numbers, step, run)
        if run < CHURN_AFTER - 1:
            return False
        _churning.add(pattern)
        _churning_sites.add(pattern[:2])
        del _progress[pattern]
    return True


def churned_here(name: str, args: tuple, kwargs: dict, key: Any = None) -> bool:
    """Whether a cache miss of op ``name`` runs on the host at once: at a line where the op has
    churned before, with small integer inputs. A decoding loop's ``cat`` then skips working out its
    new signature's pattern at every token; a call with other ranks or dtypes at that line counts as
    the same churn (which decides only where the op runs: its results are CPU's either way).

    Except, given the call's signature ``key``, where fused mode recorded that same signature at that
    line on the device before (:func:`recorded`): the call is recorded again, so a decoding loop's
    second call records its first call's traces, which are compiled, instead of traces that a host
    op cuts elsewhere (the prefill's, and the first tokens' before the line was found to churn)."""
    if not _churning_sites or CHURN_AFTER <= 0 or _storage._capture is not None:
        return False
    site = fused.user_site()
    if (name, site) not in _churning_sites:
        return False
    if key is not None and (name, site, key) in _recorded_at:
        return False
    return _small_integers(args, kwargs)


def recorded(name: str, key: Any) -> None:
    """Notes that fused mode recorded a call of bookkeeping op ``name`` with signature ``key`` on
    the device at the caller's line (see :func:`churned_here`)."""
    if CHURN_AFTER > 0 and len(_recorded_at) < 1 << 16:  # bounded: a line meets a few signatures
        _recorded_at.add((name, fused.user_site(), key))


def may_follow(args: tuple, kwargs: dict, avals: list) -> bool:
    """Whether a functional op's program with these (example) inputs and results ``avals`` is small
    integer bookkeeping that may run on the host when its inputs are there (:func:`inputs_on_host`):
    decided once, when the program is built."""
    if CHURN_AFTER <= 0 or not _small_integers(args, kwargs) or not avals:
        return False
    return all(a is not None and not (a[1].is_floating_point or a[1].is_complex) and math.prod(a[0]) <= MAX_ELEMENTS
               for a in avals)


def inputs_on_host(args: tuple, kwargs: dict) -> bool:
    """Whether every tpu tensor among a call's arguments holds a host op's result (see the module
    docstring), so the op reads nothing from the device if it runs on the host."""
    if _storage._capture is not None:
        return False
    found = False
    for a in _values(args, kwargs):
        if isinstance(a, torch.Tensor) and a.device.type == "tpu":
            if not _storage.is_host_result(a):
                return False
            found = True
    return found


def arrays_on_host(dyn: list) -> bool:
    """A quick necessary condition for :func:`inputs_on_host`, from a call's runtime inputs: every
    array among them is a host op's result. Most calls of a program that may follow the host have
    an input the device computed, and this refuses them with a dict lookup per input instead of a
    walk over the arguments' tensors and storages."""
    copies = _storage._HOST_COPIES
    for v in dyn:
        t = type(v)
        if t is int or t is float or t is bool or t is np.ndarray:  # numbers and wrapped CPU scalars
            continue
        kept = copies.get(id(v))
        if kept is None or not kept[4]:
            return False
    return True


def _host_value(t: torch.Tensor) -> torch.Tensor:
    """The values of tpu tensor ``t`` as a CPU tensor, compiling nothing: a read-only view of its
    host copy when it was uploaded (the host ops only read their inputs), else a copy of its whole
    storage read to the host (a sync) and viewed there."""
    cpu = _storage.host_tensor(t)
    if cpu is not None:
        return cpu
    data = _storage.host_copy(t)
    if data is None:
        st = t.untyped_storage()
        if t.dtype != st._dtype:  # another element type over the storage: an ordinary read
            return _storage.to_cpu(t)
        if host_reads.mode:
            host_reads.synchronizing(f"{host_reads.what_read()} run on the host, reading an input the device computed "
                                     f"({t.dtype} {list(t.shape)})")
        base = np.asarray(fused.concrete(_storage.base_array(st)))
        metrics.transfer_bytes["device_to_host"] += base.nbytes
        checks.raise_pending()
        flat = base.reshape(-1)
        strides = tuple(s * flat.itemsize for s in t.stride())
        data = np.lib.stride_tricks.as_strided(flat[t.storage_offset():], tuple(t.shape), strides, writeable=False)
    return _dtypes.numpy_to_cpu(np.array(data), t.dtype).reshape(t.shape)


def _to_host(a: Any) -> Any:
    if isinstance(a, torch.Tensor) and _storage.is_tpu(a):
        return _host_value(a)
    if isinstance(a, torch.device) and a.type == "tpu":
        return torch.device("cpu")
    return a


# The element types of a host op's results that upload as they are: no conjugate or negative bit,
# no bfloat16 reinterpretation, and a host copy kept (``storage.remember_host_copy``)
_PLAIN = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))


def host_result(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor uploaded as if a host op had computed it (a private copy, its host copy kept):
    ops whose inputs are all such results run on the host. ``TPUEstimator.generate`` uploads the
    prompts this way, so ``generate()``'s bookkeeping on them starts on the host."""
    return _upload(t.detach().clone().contiguous())


def _upload(x: Any) -> Any:
    """A result of the host op as a tpu tensor. Its CPU tensor is fresh and dropped here, and every
    input it could alias is a private copy (``_host_value``), so its memory becomes the upload's
    host copy as it is: no second copy (``fallback._from_cpu`` copies, for results it keeps)."""
    if type(x) is torch.Tensor and x.is_cpu:
        if x.dtype in _PLAIN and x.is_contiguous() and not x.storage_offset() and not x.requires_grad:
            # the host copy is x's memory, and x itself is what host_tensor hands out (views of it
            # are made with as_strided, whose offset counts from the start of x's storage)
            array = numpy_to_device(x.numpy(), x, True)
            return _storage.new_tensor(tuple(x.shape), x.dtype, array)
        if not x._is_zerotensor():
            array = numpy_to_device(_dtypes.cpu_to_numpy(x), None, True)
            return _storage.new_tensor(tuple(x.shape), x.dtype, array)
    if type(x) is list or type(x) is tuple:
        return type(x)(_upload(y) for y in x)

    return _from_cpu(x)


def run(op: torch._ops.OpOverload, args: tuple, kwargs: dict, name: str | None = None) -> Any:
    """``op`` computed by torch on the CPU, its results uploaded as tpu tensors. ``name``: the op's
    name, where the caller has it (``str(op)`` formats it anew)."""
    metrics.host_op_counts[name or str(op)] += 1
    cargs = [[_to_host(x) for x in a] if type(a) is list or type(a) is tuple else _to_host(a) for a in args]
    if kwargs:
        ckwargs = {k: _to_host(v) for k, v in kwargs.items()}
        if isinstance(ckwargs.get("device"), str) and ckwargs["device"].startswith("tpu"):
            ckwargs["device"] = torch.device("cpu")
        return _upload(op._op(*cargs, **ckwargs))
    return _upload(op._op(*cargs))
