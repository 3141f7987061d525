"""Ops that meet many view geometries of one shape (torch_tpu.dispatch.view_reads), against CPU: the same
values and strides, and the ops' own programs no longer compiled once per layout."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from torch_tpu.runtime import executor, metrics


def _layouts(x: torch.Tensor):
    """Every dense permuted layout of ``x`` (its values kept), with its first row cut."""
    for perm in itertools.permutations(range(x.dim())):
        inverse = tuple(perm.index(d) for d in range(x.dim()))
        yield x.permute(perm).contiguous().permute(inverse)[1:]


def _ops(v: torch.Tensor) -> list[torch.Tensor]:
    y = v * 2.0 + 1.0  # functional ops on a view (and on their permuted results)
    z = torch.empty_like(y).copy_(y)
    z.mul_(3.0)  # an in-place op on a permuted tensor
    return [y, z, F.dropout(v, 1e-12, training=True)]


def _op_compiles() -> int:
    """Programs compiled for ops (a layout's own ``clone`` aside: its shapes differ per layout)."""
    return sum(n for name, n in metrics.compile_counts.items()
               if name.startswith("aten.") and not name.startswith("aten.clone"))


FUSED = executor.get_eager_mode() is executor.EagerMode.FUSED


def test_many_layouts_of_one_shape_match_cpu_and_stop_compiling_the_ops(monkeypatch):
    from torch_tpu.dispatch import view_reads as _view_reads

    monkeypatch.setattr(_view_reads, "CHURN_AFTER", 2)  # from the third geometry of a pattern on
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5) / 40  # a shape no other test uses
    compiles = []
    for cpu_view, tpu_view in zip(_layouts(base), _layouts(base.to("tpu"))):
        for want, got in zip(_ops(cpu_view), _ops(tpu_view)):
            assert got.stride() == want.stride(), (got.stride(), want.stride())
            torch.testing.assert_close(got.cpu(), want)
        compiles.append(_op_compiles())
    if not FUSED:  # fused mode compiles whole steps and never takes this path
        # the last layouts of each shape reuse the ops' contiguous programs: only their reads,
        # writes and transposes are new
        assert compiles[-1] - compiles[-4] == 0, compiles


@pytest.mark.skipif(FUSED, reason="fused mode compiles whole steps")
def test_a_few_layouts_keep_their_fused_reads():
    """A training step's handful of geometries reads its views inside the ops' own programs."""
    x = torch.randn(2, 7, 3, device="tpu")
    before = _op_compiles()
    for v in (x.transpose(1, 2), x[:, 1:], x[1:]):
        (v * 2.5).sum().item()
    assert _op_compiles() - before == 6  # a mul and a sum per geometry, the reads inside them


def test_reading_and_writing_each_element_shares_one_program():
    """gradcheck perturbs each element in turn (``x[i].copy_(...)``, ``x[i].clone()``): a
    contiguous run's offset is a runtime argument of its read and write, not a new program."""
    want, got = torch.zeros(3, 7, dtype=torch.float64), torch.zeros(3, 7, dtype=torch.float64, device="tpu")
    names = []
    for i in range(3):
        for j in range(7):
            for t in (want, got):
                t[i, j].copy_(t[i, j] + i * 7 + j)
                t[i, 2:4] += 0.5
            before = dict(metrics.compile_counts)
            got[i, j].clone()
            names += [k for k, n in metrics.compile_counts.items() if n != before.get(k, 0)]
    torch.testing.assert_close(got.cpu(), want)
    if not FUSED:
        # one shared read program at most, the first time an element is read on its own (which op
        # reads one first depends on what else the line runs through): never one per element
        assert len([n for n in names if n.startswith("read")]) <= 1, names
