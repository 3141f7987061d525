"""How many compiled programs stay loaded in memory: bounded by the OS limit on memory mappings.

Every XLA:CPU executable holds memory mappings for its code and data (about four each, measured),
and a process keeps every program it compiled, so that the next call with the same signature
costs nothing. Linux refuses new mappings past ``vm.max_map_count`` (65,530 by default), and XLA
then crashes with a segfault inside the next compile or cache load, not with an error. A training
or decoding loop uses a handful of programs; a process that compiles thousands of distinct shapes
(a test suite, a sweep over shapes, an evaluation over ragged batches) reaches the limit after a
few thousand programs.

So before a compile, every :data:`CHECK_EVERY` compiles, the process's mappings are counted. Past
the threshold (``TORCH_TPU_MAP_LIMIT``, by default half of ``vm.max_map_count``; ``0`` turns the
bound off) every compiled program held in memory is dropped: the per-op programs, the fused
traces and JAX's own caches of compiled functions, each through the hook its layer registered
(:func:`on_evict`). They compile again when next used, from the persistent compilation cache
when it is on (a load, not a compile). Graphs a user captured (``torch.tpu.graph``) keep their
executables: they are the user's, and dropping them would lose the capture. Each eviction is
counted (``metrics()["program_evictions"]``) and the first one in a process is warned about.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

CHECK_EVERY = 32  # compiles between two counts (a count reads /proc/self/maps: ~1 ms per 5,000 lines)

_droppers: list[Callable[[], None]] = []
_since_check = [0]
evictions = [0]
_warned = [False]


def _system_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):  # not Linux: no such limit to watch
        return 0


def _threshold() -> int:
    env = os.environ.get("TORCH_TPU_MAP_LIMIT")
    if env is not None:
        return int(env)
    return _system_limit() // 2


THRESHOLD = _threshold()


def mappings() -> int:
    """The memory mappings this process holds now (0 where ``/proc`` has no such file)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def on_evict(drop: Callable[[], None]) -> None:
    """Registers ``drop``, which forgets the compiled programs its layer holds, to run at an eviction."""
    _droppers.append(drop)


def before_compile() -> None:
    """Called before each XLA compile or cache load: every :data:`CHECK_EVERY` calls, counts the
    mappings and evicts when they are past the threshold. Before, not after, so the program about
    to be compiled is not dropped at once."""
    if THRESHOLD <= 0:
        return
    _since_check[0] += 1
    if _since_check[0] < CHECK_EVERY:
        return
    _since_check[0] = 0
    held = mappings()
    if held > THRESHOLD:
        evict(held)


def drop_programs() -> None:
    """Drops every compiled program the droppers hold, which then compile again when next used: for
    a change in how programs are compiled (a TPU target set, ``runtime.target``), not for memory."""
    for drop in _droppers:
        drop()


def evict(held: int | None = None) -> None:
    """Drops every compiled program held in memory (see the module docstring)."""
    import jax

    drop_programs()
    jax.clear_caches()
    evictions[0] += 1
    if not _warned[0]:
        _warned[0] = True
        count = f"{held:,} memory mappings" if held is not None else "its memory mappings"
        warnings.warn(
            f"tpu: this process's compiled programs hold {count}, past the bound of {THRESHOLD:,} "
            f"(TORCH_TPU_MAP_LIMIT; the OS allows {_system_limit():,}, vm.max_map_count): every compiled "
            "program was dropped from memory and compiles again when next used (from the compilation cache "
            "when it is on). Counted in torch_tpu.metrics()['program_evictions'].",
            UserWarning,
            stacklevel=2,
        )
