"""CPU's order among equal elements in ``topk``: libstdc++'s selection and sort, replayed on XLA.

CPU's ``topk`` (ATen's ``TopKImpl.h``) pairs each element with its index and runs
``std::nth_element`` to the k-th place, then ``std::sort`` over the k-1 before it; when
``k * 64 <= n`` it runs ``std::partial_sort`` instead. None of those is stable, so which of several
equal elements comes first, and which one is picked at the k-th place, is what their pivots and
heaps leave. That order is deterministic, and code sees it: ``topk([5, 5, 0, -1], 2)`` gives
indices ``[1, 0]`` on CPU. A stable sort gives ``[0, 1]``.

So the lowering takes a stable sort's answer for every row where that answer is the only one (no
two of the first k+1 sorted elements compare equal), and replays libstdc++'s algorithms, step by
step, on the rows where equal elements make the order a choice. The replay is sequential (XLA
while loops over one row at a time); it runs only when some row has such ties, inside a
``lax.cond``, so a call without ties costs one comparison of neighbours. Its cost is in
compiling (on XLA:CPU a topk program takes 0.6-1.3 s to compile instead of about 0.1 s: each
data-dependent read and write in the loops is a kernel of its own there; a single loop running
the algorithms as a state machine compiled no faster, and is harder to check against libstdc++)
and in rows with ties (a bfloat16 top-50 of a 50,257 vocabulary: about 50 ms a row here).

Elements are compared by rank: equal ranks are equal elements (``-0.0`` equals ``0.0``, every NaN
equals every NaN), and a smaller rank sorts first, which folds CPU's two comparators (``largest``,
NaN first; smallest, NaN last) into one "less than".
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

_I32 = np.dtype(np.int32)
_I64 = np.dtype(np.int64)
# libstdc++'s _S_threshold: std::sort leaves ranges of up to 16 elements to its final insertion sort.
_SORT_THRESHOLD = 16
# Introsort's pending ranges: each split pushes two and pops one, at most 2*lg(n) deep.
_STACK = 2 * 64 + 8


def _lg(n: int) -> int:
    """std::__lg: floor(log2(n)), for n >= 1."""
    return n.bit_length() - 1


def _get(a, i):
    return lax.dynamic_index_in_dim(a, i, keepdims=False)


def _set(a, i, v):
    return lax.dynamic_update_index_in_dim(a, v, i, 0)


def _rank(a, i):
    """The rank of the element at ``i``: elements are packed as ``rank << 32 | position``, one
    int64 each, so a move is one update."""
    return _get(a, i) >> 32


def _swap(a, i, j):
    ai, aj = _get(a, i), _get(a, j)
    return _set(_set(a, i, aj), j, ai)


def _move(a, dst, src):
    return _set(a, dst, _get(a, src))


def _stable_sort_range(a, first, last):
    """``__insertion_sort(first, last)``: insertion sort is stable, so a stable sort of the range
    by rank leaves the same arrangement; elements outside the range keep their places."""
    i = lax.iota(_I64, a.shape[0])
    band = jnp.where(i < first, -1, jnp.where(i >= last, 1, 0)).astype(_I64)
    key = jnp.where(band == 0, a >> 32, 0)
    _, _, _, a = lax.sort((band, key, i, a), num_keys=3, is_stable=True)
    return a


def _median_to_first(a, result, x, y, z, active=True):
    """``__move_median_to_first``: swaps the median of x, y, z into ``result``."""
    rx, ry, rz = _rank(a, x), _rank(a, y), _rank(a, z)
    pick = jnp.where(
        rx < ry,
        jnp.where(ry < rz, y, jnp.where(rx < rz, z, x)),
        jnp.where(rx < rz, x, jnp.where(ry < rz, z, y)),
    )
    return _swap(a, result, jnp.where(active, pick, result))


def _unguarded_partition(a, first, last, pivot, active=True):
    """``__unguarded_partition``: Hoare's scheme around the element at ``pivot``; returns the cut."""
    rp = _rank(a, pivot)  # the pivot sits before the range and does not move

    def body(c):
        a, lo, hi, _ = c
        lo = lax.while_loop(lambda i: _rank(a, i) < rp, lambda i: i + 1, lo)
        hi = lax.while_loop(lambda j: rp < _rank(a, j), lambda j: j - 1, hi - 1)
        done = lo >= hi
        a = _swap(a, lo, jnp.where(done, lo, hi))  # a swap with itself when done
        return a, jnp.where(done, lo, lo + 1), hi, done

    a, cut, _, _ = lax.while_loop(lambda c: ~c[3], body, (a, first, last, ~jnp.asarray(active)))
    return a, cut


def _partition_pivot(a, first, last, active=True):
    """``__unguarded_partition_pivot``: median of three to the front, then partition. With
    ``active`` false, nothing moves (the median swaps with itself and the scan does not start)."""
    mid = first + (last - first) // 2
    a = _median_to_first(a, first, first + 1, mid, last - 1, active)
    return _unguarded_partition(a, first + 1, last, first, active)


def _adjust_heap(a, first, hole, length, value):
    """``__adjust_heap``: moves the hole at ``hole`` down to a leaf, then sifts ``value`` up from
    there (``__push_heap``) no higher than ``hole``."""
    top = hole

    def down(c):
        a, h, second = c
        second = 2 * (second + 1)
        second = jnp.where(_rank(a, first + second) < _rank(a, first + second - 1), second - 1, second)
        return _move(a, first + h, first + second), second, second

    a, h, second = lax.while_loop(lambda c: c[2] < (length - 1) // 2, down, (a, hole, hole))
    odd_child = ((length & 1) == 0) & (second == (length - 2) // 2)
    last_child = 2 * (second + 1) - 1
    a = _move(a, first + h, jnp.where(odd_child, first + last_child, first + h))
    h = jnp.where(odd_child, last_child, h)

    vr = value >> 32

    def parent(h):
        return jnp.maximum(h - 1, 0) // 2

    def up(c):
        a, h = c
        return _move(a, first + h, first + parent(h)), parent(h)

    a, h = lax.while_loop(lambda c: (c[1] > top) & (_rank(c[0], first + parent(c[1])) < vr), up, (a, h))
    return _set(a, first + h, value)


def _heap_steps(a, first, middle, last, sort: bool, active=True):
    """``__heap_select(first, middle, last)``, then ``__sort_heap(first, middle)`` when ``sort``.
    With ``active`` false, nothing runs.

    Building the heap (``__make_heap``) and popping it down are one loop of ``__adjust_heap``
    steps, run twice. Between them, each later element is offered, and popped into the heap when
    it comes before the top; the loop over offers jumps to the next element that does (one
    vector search a pop), since a pop moves only the heap and the popped place. No step selects
    between whole arrays, which would cost O(n) a step."""
    length = middle - first
    m0 = jnp.where(length < 2, 0, (length - 2) // 2 + 1)

    def adjust_steps(a, start, stop):  # steps s < m0 build the heap; s >= m0 pop it down
        def body(s, a):
            make = s < m0
            end = middle - 1 - (s - m0)  # __sort_heap's new last
            hole = jnp.where(make, m0 - 1 - s, 0)
            src = jnp.where(make, first + hole, end)
            value = _get(a, src)
            a = _move(a, src, jnp.where(make, src, first))  # __pop_heap: the top to src
            return _adjust_heap(a, first, hole, jnp.where(make, length, end - first), value)

        return lax.fori_loop(start, stop, body, a)

    a = adjust_steps(a, 0, jnp.where(active, m0, 0))
    positions = lax.iota(_I64, a.shape[0])

    def next_offer(a, i):  # the first place >= i, before last, whose element comes before the top
        wanted = (positions >= i) & (positions < last) & ((a >> 32) < _rank(a, first))
        return jnp.where(jnp.any(wanted), jnp.argmax(wanted), last)

    def offer(c):
        a, i = c
        value = _get(a, i)
        a = _move(a, i, first)
        a = _adjust_heap(a, first, 0, length, value)
        return a, next_offer(a, i + 1)

    a, _ = lax.while_loop(lambda c: c[1] < last, offer, (a, jnp.where(active, next_offer(a, middle), last)))
    return adjust_steps(a, m0, jnp.where(active & sort, m0 + jnp.maximum(length - 1, 0), m0))


def _nth_element(a, nth: int):
    """``std::nth_element(begin, begin + nth, end)``: libstdc++'s introselect."""
    n = a.shape[0]

    def body(c):
        a, first, last, depth = c
        a, cut = _partition_pivot(a, first, last)
        below = cut <= nth
        return a, jnp.where(below, cut, first), jnp.where(below, last, cut), depth - 1

    start = (a, jnp.int64(0), jnp.int64(n), jnp.int64(2 * _lg(n)))
    a, first, last, _ = lax.while_loop(lambda c: (c[2] - c[1] > 3) & (c[3] > 0), body, start)

    def heap_fallback():
        return _swap(_heap_steps(a, first, nth + 1, last, sort=False), first, nth)

    return lax.cond(last - first > 3, heap_fallback, lambda: _stable_sort_range(a, first, last))


def _sort(a, last: int):
    """``std::sort(begin, begin + last)``: libstdc++'s introsort, whose ranges are kept on a stack
    (they are disjoint, so the order they are done in does not matter), then its final insertion
    sort, which is a stable sort of what introsort leaves."""
    if last < 2:
        return a
    stack = jnp.zeros((_STACK, 3), _I64).at[0].set(jnp.array([0, last, 2 * _lg(last)], _I64))

    def body(c):  # one range off the stack: leave it (16 or fewer), heapsort it, or split it
        a, stack, top = c
        first, end, depth = stack[top - 1, 0], stack[top - 1, 1], stack[top - 1, 2]
        top = top - 1
        big = end - first > _SORT_THRESHOLD
        split = big & (depth > 0)
        # both run every time, one of them (or neither) active: a switch between them would copy
        # the row at every range
        a = _heap_steps(a, first, end, end, sort=True, active=big & (depth == 0))  # __partial_sort
        a, cut = _partition_pivot(a, first, end, split)
        both = jnp.stack([jnp.stack([cut, end, depth - 1]), jnp.stack([first, cut, depth - 1])])
        stack = jnp.where(split, lax.dynamic_update_slice(stack, both, (top, 0)), stack)
        return a, stack, jnp.where(split, top + 2, top)

    a, _, _ = lax.while_loop(lambda c: c[2] > 0, body, (a, stack, jnp.int64(1)))
    return _stable_sort_range(a, 0, last)


def cpu_topk_row(rank, k: int):
    """The positions CPU's ``topk`` picks, in its order, for one row of ranks (smaller first)."""
    n = rank.shape[0]
    a = (rank.astype(_I64) << 32) | lax.iota(_I64, n)
    if k * 64 <= n:
        a = _heap_steps(a, 0, k, n, sort=True)
    else:
        a = _sort(_nth_element(a, k - 1), k - 1)
    return a[:k] & 0xFFFFFFFF


def _same(a, b):
    """torch's equality of two sorted keys: NaN equals NaN."""
    eq = a == b
    if jnp.issubdtype(a.dtype, jnp.floating):
        eq = eq | (jnp.isnan(a) & jnp.isnan(b))
    return eq


def _ranks(sorted_values, order):
    """Dense ranks of each row's elements (equal elements share one), in original positions, from
    the row's keys in sorted order and the positions they came from."""
    new = ~_same(sorted_values[..., 1:], sorted_values[..., :-1])
    step = jnp.concatenate([jnp.zeros(new.shape[:-1] + (1,), _I32), new.astype(_I32)], axis=-1)
    dense = jnp.cumsum(step, axis=-1)
    rows = lax.broadcasted_iota(_I32, order.shape, 0)
    return jnp.zeros(order.shape, _I32).at[rows, order].set(dense)


def topk_indices(sorted_values, order, k: int):
    """CPU's ``topk`` indices for rows ``(R, n)``, given each row's stable sort in ``topk``'s
    output order (descending for ``largest``, NaN counted largest): ``sorted_values`` and
    ``order``, the positions they came from. A rank is then a place in that order, so "comes
    first" is one comparison whichever way ``largest`` is. Rows whose first k+1 values are all
    distinct keep ``order[:, :k]``."""
    n = sorted_values.shape[-1]
    fast = order[:, :k].astype(_I64)
    if k == 0 or n < 2:
        return fast
    span = min(k + 1, n)
    tied = jnp.any(_same(sorted_values[:, 1:span], sorted_values[:, : span - 1]), axis=-1)

    def replay(fast):
        rank = _ranks(sorted_values, order.astype(_I32))

        def row(i, out):
            ranks = _get(rank, i)  # read outside the cond, which would otherwise take all rows

            def replayed(out, ranks):
                return lax.dynamic_update_index_in_dim(out, cpu_topk_row(ranks, k), i, 0)

            return lax.cond(_get(tied, i), replayed, lambda out, ranks: out, out, ranks)

        return lax.fori_loop(0, sorted_values.shape[0], row, fast)

    return lax.cond(jnp.any(tied), replay, lambda f: f, fast)
