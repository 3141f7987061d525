"""Fused eager mode: ops are recorded, then run as one XLA program at a sync point.

Each recorded op is a node holding its :class:`Program` and its inputs: concrete jax arrays,
Python numbers (runtime arguments, so a changing learning rate never recompiles), or references
to earlier nodes' outputs. A node's outputs are :class:`Lazy` placeholders; storages hold them
in place of arrays.

At a sync point (a host read, ``torch_tpu.sync()``, a mode switch, the length cap, or the first
op recorded after an optimizer step) the pending nodes become one function, jitted and cached
under their fingerprint (:mod:`torch_tpu.runtime.cache`). Its outputs are exactly the
placeholders still alive, ordered by position in the trace (donated inputs' replacements first),
so the program does not depend on when the garbage collector ran.

Nodes refer to earlier outputs by (node, index), never by the placeholder itself, so a
placeholder dies with the last tensor that used it and intermediates stay inside the program.
"""

from __future__ import annotations

import operator
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from torch_tpu.runtime import cache, residency, settle
from torch_tpu.runtime.errors import raise_named

_lock = threading.RLock()  # autograd records backward ops from its own thread
_pending: list[Node] = []
_created: list[Lazy] = []  # every placeholder of the pending trace; those still used elsewhere are its outputs
_graphs: set[int] = set()  # the compiled graphs (by id) recorded in the pending trace
_templates: dict[tuple, _Template] = {}  # op sequence (programs) -> the last trace that ran with it
residency.on_evict(_templates.clear)  # a template holds its compiled entry
MAX_OPS = int(os.environ.get("TORCH_TPU_FUSED_MAX_OPS", "5000"))
# The pending trace's length at which _long_trace looks at it next, and the loop period it found
# there (0: none yet); _after_cap: the trace before it ended at the length cap or a loop's period
_look_at = max(MAX_OPS // 5, 1)
_period = 0
_after_cap = False


class Node:
    __slots__ = ("program", "inputs", "site", "avals")

    def __init__(self, program: Any, inputs: list, site: tuple[str, int] | None, avals: list) -> None:
        self.program = program
        self.inputs = inputs
        self.site = site
        self.avals = avals


class _Ref(tuple):
    """An input that is output ``index`` of an earlier pending ``node``: the tuple ``(node, index)``.
    A trace makes one per pending input of every op it records (about 470 in a fused ``gpt-tiny``
    step, most of them the optimizer's foreach lists), so it is made by tuple's own constructor,
    ``_Ref((node, index))``, without a Python ``__init__``: 0.38 us instead of 0.61."""

    __slots__ = ()
    node = property(operator.itemgetter(0))
    index = property(operator.itemgetter(1))


class Lazy:
    """A value that a pending node will produce. ``value`` is set when the trace runs."""

    __slots__ = ("node", "index", "value", "error", "shape", "dtype", "replaces", "__weakref__")

    def __init__(self, node: Node, index: int, aval: Any) -> None:
        self.node: Node | None = node
        self.index = index
        self.value: Any = None
        self.error: Exception | None = None
        self.replaces: int | None = None  # id of the array this value replaces in its storage
        self.shape = tuple(aval.shape)
        self.dtype = aval.dtype

    def __repr__(self) -> str:
        return f"Lazy({self.dtype}{list(self.shape)}, {'ready' if self.value is not None else 'pending'})"


_TORCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__import__("torch").__file__)))
_OUR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = (os.path.join(_TORCH_DIR, "torch") + os.sep, _OUR_DIR + os.sep, "<frozen")  # "<string>" is user code


_skipped_file: dict[str, bool] = {}  # a frame's file name -> whether it is torch's or ours
# (id of a code object, instruction offset) -> ((file name, line), the code object): a frame's line
# number is worked out by walking its function's line table from the start, thousands of
# instructions in a long function (transformers' decoding loop), where the offset is at hand and its
# line never changes. Keyed by id, since hashing a code object costs as much as the walk; the entry
# holds its code object, so that id is not reused while the entry lives.
_sites: dict[tuple[int, int], tuple[tuple[str, int], Any]] = {}


def user_site() -> tuple[str, int] | None:
    """The innermost source line outside torch and torch_tpu: where the user asked for this.
    Whether a file is skipped is remembered by its name (a string caches its hash, so the lookup
    costs less than the prefix test it saves), and each line by its code object and offset."""
    try:
        f = sys._getframe(2)
    except ValueError:  # called from a kernel the autograd engine's thread runs: no Python caller
        return None
    skipped = _skipped_file
    while f is not None:
        code = f.f_code
        name = code.co_filename
        skip = skipped.get(name)
        if skip is None:
            skip = skipped[name] = name.startswith(_SKIP)
        if not skip:
            at = (id(code), f.f_lasti)
            known = _sites.get(at)
            if known is None:
                if len(_sites) >= 1 << 16:  # code objects come and go (exec, notebooks): a bounded memo
                    _sites.clear()
                known = _sites[at] = ((name, f.f_lineno), code)
            return known[0]
        f = f.f_back
    return None


def _spec(x: Any) -> Any:
    if type(x) is _Ref:
        aval = x.node.avals[x.index]
        return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_spec(y) for y in x)
    return x


def _signature(x: Any) -> Any:
    if type(x) is _Ref:
        aval = x.node.avals[x.index]
        return (tuple(aval.shape), aval.dtype)
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return (np.shape(x), x.dtype)
    return type(x)


def _avals_for(program: Any, inputs: list) -> list:
    """The outputs' shapes and dtypes for these inputs. Tracing the program abstractly once per
    input signature also raises a lowering's error here, at the op, as strict mode would."""
    fixed = program.fixed
    if fixed is not None and program.shapes:
        return fixed  # one signature per program (the dispatcher's), already checked
    key = () if fixed is not None else tuple(_signature(x) for x in inputs)
    avals = program.shapes.get(key)
    if avals is None:
        try:
            out = jax.eval_shape(program.fn, *[_spec(x) for x in inputs])
        except Exception as e:
            raise_named(e, program.name)
        if fixed is not None:
            avals = program.shapes[key] = fixed
        else:
            program.multi = isinstance(out, (tuple, list))  # what the function returns decides
            avals = program.shapes[key] = list(out) if program.multi else [out]
    return avals


def record(program: Any, inputs: tuple) -> Any:
    """Records one program; returns placeholders for its outputs."""
    with _lock:
        if _step_ended:
            finish_step()
        ins = [x if type(x) is not Lazy else x.value if x.value is not None else _Ref((x.node, x.index))
               for x in inputs]
        avals = program.fixed
        if avals is None or not program.shapes:
            avals = _avals_for(program, ins)
        node = Node(program, ins, user_site(), avals)
        _pending.append(node)
        if len(avals) == 1 and avals[0] is not None:
            out = Lazy(node, 0, avals[0])
            _created.append(out)
            outs: Any = (out,)
        else:
            outs = tuple([None if a is None else Lazy(node, i, a) for i, a in enumerate(avals)])  # None: undefined
            _created.extend(outs)
        n = len(_pending)
        if n >= _look_at or n >= MAX_OPS:
            _long_trace(n)
        return outs if program.multi else outs[0]


def _loop_period(nodes: list[Node], repeats: int, longest: int) -> int:
    """The shortest period of the trace's tail, in ops, over which its last ``repeats`` periods
    record the same programs in the same order (a loop that never reads the host: an evaluation
    loop summing its correct answers on the device), periods up to ``longest``; 0 if there is none."""
    if longest < 1:
        return 0
    ids = [id(n.program) for n in nodes[-repeats * longest:]]
    n = len(ids)
    for p in range(1, n // repeats + 1):
        if ids[n - (repeats - 1) * p:] == ids[n - repeats * p:n - p]:
            return p
    return 0


def _long_trace(n: int) -> None:
    """The trace holds ``n`` ops and no sync came. At MAX_OPS it runs ("length cap"). A loop
    found in it ends it at the next whole multiple of the loop's period ("loop period"): each later
    trace of the loop then starts at the same op of an iteration and records the same sequence, so
    it replays one program. Cut only at the cap, the traces would start at a different op each time
    (5,000 is rarely a multiple of an iteration's length) and compile a program of 5,000 ops per
    phase, seconds each. A loop is three repeats after such a cut, but fifty before one: a model's
    identical layers repeat too, and a training step is kept whole up to the cap."""
    global _look_at, _period
    if n >= MAX_OPS:
        flush(reason="length cap")
    elif _period == 0:
        _period = _loop_period(_pending, 3, n // 3) if _after_cap else _loop_period(_pending, 50, MAX_OPS // 250)
        _look_at = n + max(MAX_OPS // 5, 1) if _period == 0 else -(-n // _period) * _period
        if _look_at == n:
            flush(reason="loop period")
    else:
        flush(reason="loop period")
    if _pending and len(_pending) >= _look_at:  # a graph capture keeps its trace whole: look again later
        _look_at, _period = len(_pending) + max(MAX_OPS // 5, 1), 0


def concrete(x: Any) -> Any:
    """The array behind a placeholder, running the pending trace if needed."""
    if type(x) is not Lazy:
        return x
    if x.value is None and x.error is None:
        flush()
    if x.value is None:
        raise_named(x.error, "this tensor was never computed: the fused program producing it failed")
    return x.value


def _not_recording() -> bool:
    return False


# Whether programs are recorded now: the executor owns the mode and installs its own ``recording``
# here when it is imported (the trace sits below the executor and never imports it).
is_recording: Callable[[], bool] = _not_recording

_step_ended: list = []  # holds the optimizer step's user site once a step ended, until the trace runs


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The end of an optimizer step ends a training step, so every step is the same program
    whatever the loop reads on the host. The trace runs (asynchronously) at the next recorded op,
    so the device runs this step while Python records the next; by then ``zero_grad`` has
    dropped the gradients, which are then no longer outputs of the program."""
    if is_recording() and _pending and not _step_ended:
        _step_ended.append(user_site())


def finish_step() -> None:
    """Runs the trace of a training step that ended, if one waits for the next op."""
    with _lock:
        if _step_ended:
            flush(reason="optimizer step", site=_step_ended.pop())


def _settle(pending: bool) -> None:
    """What finishing means for the counters (:mod:`.settle`): the ended step, then with
    ``pending`` the rest of the trace."""
    finish_step()
    if pending and _pending:
        flush(reason="metrics()")


settle.register(_settle)


_hook: list[Any] = []  # the handle of the registered optimizer post-hook, while fused mode is on


def step_boundary(on: bool) -> None:
    """Registers the optimizer post-hook that ends a fused step, only while fused mode is on: inside
    a compiled optimizer step (another mode) a call into torch_tpu would break Dynamo's graph."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if on and not _hook:
        _hook.append(register_optimizer_step_post_hook(_after_optimizer_step))
    elif not on and _hook:
        _hook.pop().remove()


def begin_graph(graph: int, inputs: list) -> None:
    """Called before a compiled graph records, with its inputs. The pending trace runs first when
    the graph is already in it (the forward of step n+1 after step n's optimizer), so each step is
    the same program and the device runs it while Python starts the next; and when the graph reads
    nothing pending, so that unrelated calls (inference on varying shapes) never share a program."""
    with _lock:
        if _step_ended:
            finish_step()
        if _pending:
            if graph in _graphs:
                flush(reason="compiled graph repeats")
            elif not any(type(x) is Lazy and x.value is None for x in inputs):
                flush(reason="independent compiled graph")
        _graphs.add(graph)


def graphs_pending() -> bool:
    """Whether the pending trace holds a compiled graph (strict mode then records too)."""
    return bool(_graphs)


def pending_count() -> int:
    return len(_pending)


_one_device: list[bool] = []  # whether the process has a single device (then every layout is None)


def _layout(x: Any) -> Any:
    """An input's sharding when it spans several devices: part of the trace's fingerprint, since a
    compiled program accepts only the shardings it was compiled for. None on one device."""
    if not _one_device:
        _one_device.append(jax.device_count() == 1)
    if _one_device[0]:
        return None
    sharding = getattr(x, "sharding", None)
    if sharding is None or type(sharding) is _SingleDevice:
        return None
    return sharding if len(sharding.device_set) > 1 else None


_SingleDevice = jax.sharding.SingleDeviceSharding


def _donatable(args: list, uses: dict[int, int], out_avals: list) -> tuple[int, ...]:
    """Inputs that nothing outside this trace still holds (a parameter whose storage now points at
    the updated value): XLA may write the outputs into their buffers. Only inputs with an output of
    the same shape and dtype are offered, so no donation goes unused. ``uses``: how many recorded
    inputs name each array argument."""
    free: dict[tuple, int] = {}
    for a in out_avals:
        k = (tuple(a.shape), a.dtype)
        free[k] = free.get(k, 0) + 1
    donate = []
    for p, count in uses.items():
        # references: the args list, one per use in the recorded nodes, and getrefcount's own
        if isinstance(args[p], jax.Array) and sys.getrefcount(args[p]) <= count + 2:
            k = (tuple(args[p].shape), args[p].dtype)
            if free.get(k):
                free[k] -= 1
                donate.append(p)
    return tuple(sorted(donate))


def _paired(want: list, live: list, position: dict, args: list, donate: tuple) -> list:
    """The outputs in program order: first, in the order of the donated inputs, the value that
    replaces each donated array in its storage, then the rest by trace position. JAX aliases a
    donated input with the first unclaimed output of its shape and dtype, so this makes a
    parameter's update write over the parameter itself rather than, say, over its gradient, which
    would make XLA copy the parameter to keep it for the update."""
    by_replaced: dict[int, tuple[int, int]] = {}
    for r in live:
        if r.node is not None and r.replaces is not None:
            by_replaced[r.replaces] = (position[id(r.node)], r.index)
    first: list = []
    taken: set = set()
    for p in donate:
        o = by_replaced.get(id(args[p]))
        if o is not None and o not in taken:
            first.append(o)
            taken.add(o)
    return first + [o for o in want if o not in taken]


def _alive() -> list[Lazy]:
    """The pending trace's placeholders that something besides this module still holds, and
    empties the list. Counting references replaces a weak set: adding a placeholder to one made a
    weak reference with a callback, about 1 µs for each of a step's hundreds of outputs."""
    created = list(_created)
    _created.clear()
    # references to each r: the `created` list, the loop variable, getrefcount's argument
    return [r for r in created if r is not None and r.value is None and sys.getrefcount(r) > 3]


def flush(reason: str = "sync", site: tuple[str, int] | None = None) -> None:
    """Compiles (or finds in the cache) and runs the pending trace. ``site``: the user's line that
    ended it, when not the caller's."""
    global _look_at, _period, _after_cap
    with _lock:
        _step_ended.clear()
        if capture_hook is not None and capture_hook(reason):
            return  # a graph capture keeps its trace whole (step ends, length cap), or refuses the sync
        # a host read ends a loop's run of cuts even with nothing pending: the next trace starts afresh
        _look_at, _period = max(MAX_OPS // 5, 1), 0
        _after_cap = reason in ("length cap", "loop period")
        if not _pending:
            return
        nodes = list(_pending)
        _pending.clear()
        _graphs.clear()
        live = _alive()
        position = {id(n): i for i, n in enumerate(nodes)}
        programs = tuple([n.program for n in nodes])  # a generator costs a resumption per node
        template = _templates.get(programs)
        if template is not None and template.replay(nodes, live, position, site, reason):
            return
        args: list = []
        floats: list = []  # the runtime Python floats, passed as one vector (see _FLOATS)
        descs: dict[int, tuple] = {}  # per array input: ("a", position, shape, dtype, layout), shared by its uses
        arg_pos: dict[int, int] = {}
        uses: dict[int, int] = {}  # per array argument, how many recorded inputs name it
        wiring_all = []
        for n in nodes:
            wiring = []
            for x in n.inputs:
                t = type(x)
                if t is _Ref:
                    wiring.append(("n", position[id(x.node)], x.index))
                elif t is float:
                    floats.append(x)
                    wiring.append(("f", len(floats) - 1))
                elif t is int or t is bool or t is complex:
                    args.append(x)
                    wiring.append(("s", len(args) - 1, t))
                else:
                    k = id(x)
                    p = arg_pos.get(k)
                    if p is None:
                        p = arg_pos[k] = len(args)
                        args.append(x)
                        shape = getattr(x, "shape", None)  # an attribute read: np.shape costs 4 times more
                        shape = tuple(shape) if shape is not None else tuple(np.shape(x))
                        descs[p] = ("a", p, shape, x.dtype, _layout(x))
                        uses[p] = 1
                    else:
                        uses[p] += 1
                    wiring.append(descs[p])
            wiring_all.append((n.program, tuple(wiring)))
        if floats:
            args.append(np.array(floats, _FLOATS))
        want = sorted({(position[id(r.node)], r.index) for r in live if r.node is not None})
        sites = [n.site for n in nodes]
        x = n = None  # drop the loop's references before counting them
        donate = _donatable(args, uses, [nodes[i].avals[j] for i, j in want])
        want = _paired(want, live, position, args, donate)
        key = tuple(wiring_all)
        try:
            values, entry = cache.run_trace(key, donate, want, args, sites, site or user_site(), reason)
        except Exception as e:  # the trace is dropped; its tensors say why when read
            for r in live:
                r.error, r.node = e, None
            raise
        _bind(live, position, values, entry.slots)
        if not _one_device:  # set by _layout, which a trace without array inputs never calls
            _one_device.append(jax.device_count() == 1)
        if _one_device[0] and len(_templates) < _MAX_TEMPLATES:
            _templates[programs] = _Template(nodes, key, args, uses, donate, want, entry)


def _bind(live: list[Lazy], position: dict, values: list, slots: dict) -> None:
    for r in live:
        if r.node is None:
            continue
        r.value = values[slots[(position[id(r.node)], r.index)]]
        r.node = None


_SCALARS = (int, bool, complex)
# A trace's runtime floats (learning rates, Adam's bias corrections: one per parameter) travel as
# one float64 vector, its last argument, rather than as an argument each: jax turns each Python
# number into a device buffer at every call, which cost a 77-float AdamW step 0.18 ms of host time.
_FLOATS = np.float64
_MAX_TEMPLATES = 4096


class _Template:
    """The last trace that ran with a given op sequence, kept so that the next one like it (the
    next training step) runs its executable at once: one walk over the recorded inputs checks that
    the trace is the same (wiring, array shapes and dtypes, which arrays alias), that the same
    placeholders are alive and the same inputs may be donated, and collects the arguments. This
    skips building the trace's fingerprint, hashing it, and choosing donations and output order,
    which cost a training step more host time than the executable call itself. Anything that
    differs takes the full path, which compiles or finds the program as before."""

    __slots__ = ("spec", "key", "n_args", "want", "free", "candidates", "donate", "paired", "entry")

    def __init__(self, nodes: list, key: tuple, args: list, uses: dict, donate: tuple, paired: list,
                 entry: Any) -> None:
        # per node, its inputs: ("n", node position, output index), ("s", Python type) for a number,
        # or (argument position, type, shape, dtype) for an array
        spec = []
        for n, (_, wiring) in zip(nodes, key):
            per = []
            for x, w in zip(n.inputs, wiring):
                if w[0] == "n":
                    per.append(w)
                elif w[0] == "s":
                    per.append(("s", w[2]))
                elif w[0] == "f":
                    per.append(("f",))
                else:
                    per.append((w[1], type(x), w[2], w[3]))
            # a program with one input signature (the dispatcher's, a compiled graph's) is only
            # recorded with arrays of that signature: its inputs' shapes need no check
            spec.append((tuple(per), n.program.fixed is None))
        self.spec = spec
        self.key = key
        self.n_args = len(args)
        self.want = set(paired)
        # what _donatable decides from: the outputs' (shape, dtype) counts, and per jax array input
        # (in order) the reference count at which nothing outside the trace holds it
        free: dict[tuple, int] = {}
        for i, j in paired:
            a = nodes[i].avals[j]
            k = (tuple(a.shape), a.dtype)
            free[k] = free.get(k, 0) + 1
        self.free = free
        self.candidates = tuple((p, c + 2, (tuple(args[p].shape), args[p].dtype))
                                for p, c in uses.items() if isinstance(args[p], jax.Array))
        self.donate = donate
        self.paired = paired
        self.entry = entry

    def replay(self, nodes: list, live: list, position: dict, site: Any, reason: str) -> bool:
        """Runs the trace if it matches; False (nothing done) if it does not."""
        args: list = []
        floats: list = []
        seen: set[int] = set()
        scalars = _SCALARS
        for n, (per, check) in zip(nodes, self.spec):
            ins = n.inputs
            if len(ins) != len(per):
                return False
            for x, s in zip(ins, per):
                t = type(x)
                if t is _Ref:
                    if s[0] != "n" or x.node is not nodes[s[1]] or x.index != s[2]:
                        return False
                elif t is float:
                    if s[0] != "f":
                        return False
                    floats.append(x)
                elif t in scalars:
                    if s[0] != "s" or s[1] is not t:
                        return False
                    args.append(x)
                else:
                    p = s[0]
                    if p == len(args):  # its first use: a new array, of the same type, shape and dtype
                        if t is not s[1] or id(x) in seen or (check and (x.shape != s[2] or x.dtype != s[3])):
                            return False
                        seen.add(id(x))
                        args.append(x)
                    elif type(p) is not int or p > len(args) or args[p] is not x:
                        return False
        x = n = None  # drop the loop's references before counting them
        if floats:
            args.append(np.array(floats, _FLOATS))
        if len(args) != self.n_args:
            return False
        if {(position[id(r.node)], r.index) for r in live if r.node is not None} != self.want:
            return False
        free = dict(self.free)
        donate = []
        for p, limit, k in self.candidates:  # _donatable's choice, for the same trace
            if sys.getrefcount(args[p]) <= limit and free.get(k):
                free[k] -= 1
                donate.append(p)
        if tuple(donate) != self.donate:
            return False
        entry = self.entry
        try:
            values = cache.run_entry(entry, self.key, self.donate, self.paired, args, site or user_site(), reason)
        except Exception as e:  # the trace is dropped; its tensors say why when read
            for r in live:
                r.error, r.node = e, None
            raise
        _bind(live, position, values, entry.slots)
        return True


# Set by torch_tpu.device.graphs while a graph is captured: called with the reason of each flush;
# True keeps the trace pending (the capture compiles it whole at its end), or it raises (a host read).
capture_hook: Any = None


def take_pending() -> tuple[list[Node], list[Lazy]]:
    """Removes the pending trace without running it: its nodes, and its placeholders that are still
    alive (held by storages or others). Graph capture compiles and binds them itself."""
    global _look_at, _period
    with _lock:
        _step_ended.clear()
        nodes = list(_pending)
        _pending.clear()
        _look_at, _period = max(MAX_OPS // 5, 1), 0
        _graphs.clear()
        return nodes, _alive()
