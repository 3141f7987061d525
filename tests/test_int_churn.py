"""Python ints that change at every call of one op line become runtime inputs of its programs
(torch_tpu/dispatch/runtime_ints.py): against CPU, the same values and dtypes, a bounded number of compiles,
and the ints of other lines, and of dims and sizes, left as constants."""

from __future__ import annotations

import pytest
import torch

import torch_tpu
from torch_tpu import EagerMode
from torch_tpu.dispatch import runtime_ints as _runtime_ints

VALUES = list(range(40, 52))  # values no other test uses, so every program here is new


def _compiles() -> int:
    torch_tpu.sync()
    return torch_tpu.metrics()["compile_count"]


def _scaled(x: torch.Tensor, k: int) -> torch.Tensor:
    # each a value argument holding a Python int: a Tensor (wrapped number), a Scalar, alpha
    return ((x * k + (k - 45)).clamp(max=k) - torch.add(x, x, alpha=k)) % 7


@pytest.mark.parametrize("mode", [EagerMode.STRICT, EagerMode.FUSED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int8])
def test_a_changing_int_compiles_a_bounded_number_of_programs_and_matches_cpu(mode, dtype):
    x = torch.arange(-6, 6).to(dtype)  # int8 * 51 wraps around, as on CPU
    with torch_tpu.set_eager_mode(mode):
        t = x.to("tpu")
        counts = []
        for k in VALUES:
            got = _scaled(t, k)
            want = _scaled(x, k)
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want), (k, got.cpu(), want)
            counts.append(_compiles())
    assert counts[-1] == counts[_runtime_ints.CHURN_AFTER + 1], counts  # nothing compiles after the first few values


def test_other_lines_and_dims_keep_their_ints_as_constants():
    """The promotion is per line: a line with its own few ints still compiles per value (XLA folds
    constants), and an int that is a dim or a size (``roll``'s shifts) never becomes a runtime input."""
    x = torch.arange(8.0, device="tpu")
    for k in VALUES:
        (x * k).sum()  # this line churns
    before = _compiles()
    (x * 52).sum()  # another line, a new constant
    assert _compiles() == before + 1
    counts = []
    for k in range(1, 6):
        got = x.roll(k)  # an int[]: a shift, never traced
        assert torch.equal(got.cpu(), torch.arange(8.0).roll(k))
        counts.append(_compiles())
    assert counts[-1] - counts[0] == 4, counts


def test_the_promotion_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(_runtime_ints, "CHURN_AFTER", 0)
    x = torch.arange(8.0, device="tpu")
    before = _compiles()
    for k in range(60, 66):
        assert torch.equal((x - k).cpu(), torch.arange(8.0) - k)
    assert _compiles() - before == 6


def test_a_bool_and_an_int_mixed_at_one_line():
    """Python bools in the same value argument take the same runtime path and keep their type."""
    x = torch.arange(6, dtype=torch.int64, device="tpu")
    for k in [*VALUES[:4], True, False, *VALUES[4:6]]:
        got = x * k
        want = torch.arange(6) * k
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want), k
