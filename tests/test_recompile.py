"""The recompilation explainer names the first real difference between two traces at one sync point,
and ``metrics()`` counts the same compiles as ``cache_stats()``."""

from __future__ import annotations

import re

import pytest
import torch

import torch_tpu
from torch_tpu import EagerMode
from torch_tpu.runtime import cache, fused
from torch_tpu.tensor.storage import base_array


@pytest.fixture
def fused_mode():
    with torch_tpu.set_eager_mode(EagerMode.FUSED):
        torch_tpu.reset_metrics()
        yield
    assert fused.pending_count() == 0


def _reasons(run, variants) -> list[str]:
    """Runs ``run(v)`` for each variant (its sync point on one line), returns the new reasons."""
    before = len(cache.recompiles)
    for v in variants:
        run(v)
    reasons = [r.reason for r in cache.recompiles[before:]]
    for r in reasons:  # never two equal signatures
        for old, new in re.findall(r"from (.+?) to (.+?)(?: \(|$)", r) + re.findall(r": (\S+) -> (\S+)$", r):
            assert old != new, r
    return reasons


def test_a_changing_python_int_is_named_with_its_values(fused_mode):
    x = torch.arange(4.0, device="tpu")
    torch_tpu.sync()

    def run(k):
        return (x * k).sum().item()

    reasons = _reasons(run, [2, 3])
    assert len(reasons) == 1
    assert "argument 'other' changed from the Python int 2 to the Python int 3" in reasons[0], reasons
    assert "compile-time constants" in reasons[0]


def test_a_constant_other_than_an_int(fused_mode):
    x = torch.ones(3, 4, device="tpu")
    torch_tpu.sync()

    def run(approximate):
        return torch.nn.functional.gelu(x, approximate=approximate).sum().item()

    (reason,) = _reasons(run, ["none", "tanh"])
    assert "argument 'approximate' changed from its default to 'tanh'" in reason, reason


def test_a_view_of_a_grown_storage_is_not_reported_as_an_identical_signature(fused_mode):
    """The issue's case: ``ids[:, -1:].clone()`` of a sequence that grows: the clone's own
    signature (int64[2, 1]) is the same; the storage behind the view is not."""
    ids = torch.zeros(2, 5, dtype=torch.int64, device="tpu")
    reasons = []
    before = len(cache.recompiles)
    for _ in range(2):
        ids = torch.cat([ids, torch.ones(2, 1, dtype=torch.int64, device="tpu")], dim=1)
        torch_tpu.sync()
        ids[:, -1:].clone().sum().item()
    reasons = [r.reason for r in cache.recompiles[before:] if "clone" in r.reason]
    assert reasons, [r.reason for r in cache.recompiles[before:]]
    assert "of a [2, 6] storage" in reasons[0] and "of a [2, 7] storage" in reasons[0], reasons
    assert "grows every step" in reasons[0]


def test_an_input_shape_that_grows_by_one_names_the_growth(fused_mode):
    def run(n):
        return torch.ones(2, n, device="tpu").exp().sum().item()

    for r in _reasons(run, [3, 4]):
        assert "float32[2, 3] to float32[2, 4]" in r or "[2, 4]" in r, r


def test_wiring(fused_mode):
    x = torch.randn(5, device="tpu")
    torch_tpu.sync()

    def run(swap):
        a, b = x + 1, x * 2
        return (b - a if swap else a - b).sum().item()

    (reason,) = _reasons(run, [False, True])
    assert "wired differently: output 0 of op #0 -> output 0 of op #1" in reason, reason


def test_an_inputs_identity_or_aliasing(fused_mode):
    for n, order in ((5, [False, True]), (7, [True, False])):
        x, y = torch.randn(n, device="tpu"), torch.randn(n, device="tpu")
        torch_tpu.sync()

        def run(same, x=x, y=y):
            return (x + (x if same else y)).sum().item()

        (reason,) = _reasons(run, order)[-1:]
        if order[1]:
            assert "is now the same array as input 0 of op #0" in reason, reason
        else:
            assert "was the same array as input 0 of op #0, now a different one" in reason, reason


def test_a_donated_buffer(fused_mode):
    """An in-place update whose old value nothing else holds donates its buffer; holding the old
    array elsewhere (here directly) makes the same trace one without donation."""
    t = torch.zeros(64, device="tpu")
    torch_tpu.sync()
    kept = []

    def run(hold):
        if hold:
            kept.append(base_array(t.untyped_storage()))
        t.add_(1.0)
        return t.sum().item()

    reasons = _reasons(run, [False, True])
    assert any("donated input buffers changed: arrays [0] -> []" in r for r in reasons), reasons
    assert t[0].item() == 2.0


def test_the_set_of_kept_outputs(fused_mode):
    x = torch.randn(6, device="tpu")
    torch_tpu.sync()
    held = []

    def run(keep):
        y = x.exp()
        if keep:
            held.append(y)
        total = (y * 2).sum()
        del y  # alive only when held
        return total.item()

    (reason,) = _reasons(run, [False, True])
    assert "other values are kept alive as outputs (now also kept: output 0 of op #0 aten.exp" in reason, reason
    torch.testing.assert_close(held[0].cpu(), x.cpu().exp())


def test_metrics_and_cache_stats_count_the_same_compiles(fused_mode):
    m0, s0 = torch_tpu.metrics(), torch_tpu.cache_stats()
    for n in (3, 4, 5, 4):
        torch.ones(n, device="tpu").add(1).sum().item()
    m1, s1 = torch_tpu.metrics(), torch_tpu.cache_stats()
    assert m1["fused_compile_count"] - m0["fused_compile_count"] == s1["misses"] - s0["misses"] == 3
    assert m1["compile_count"] - m0["compile_count"] >= 3  # per-op programs of eager sections count too
    assert m1["compile_seconds"] >= s1["compile_seconds"] - s0["compile_seconds"]


def test_strict_mode_explains_an_op_that_recompiles_at_one_line(monkeypatch):
    """In the default (strict) mode each op is its own program: the same op at the same line compiling
    again is a recompile too, with the first difference named, and warned about once it repeats."""
    from torch_tpu.dispatch import host_placement as _host_placement

    monkeypatch.setattr(_host_placement, "CHURN_AFTER", 0)  # a growing sequence compiles per length
    monkeypatch.setattr(cache, "RECOMPILE_WARN", 3)
    with torch_tpu.set_eager_mode(EagerMode.STRICT):
        x = torch.arange(4.0, device="tpu")

        def scaled(k):
            return (x * k).sum().item()

        reasons = _reasons(scaled, [5, 6])
        assert any("argument 'other' changed from the Python int 5 to the Python int 6" in r for r in reasons), reasons

        ids = torch.zeros(2, 3, dtype=torch.int64, device="tpu")
        one = torch.ones(2, 1, dtype=torch.int64, device="tpu")
        before = len(cache.recompiles)
        warned = r"the program of aten\.cat\.default at .*recompiled 3 times.*static cache"
        with pytest.warns(UserWarning, match=warned):
            for _ in range(4):
                ids = torch.cat([ids, one], dim=1)  # (2, 4), (2, 5), ...: a program per length
        grown = [r for r in cache.recompiles[before:] if "aten.cat" in r.site]
        assert len(grown) == 3 and all("dim 1 grew by one" in r.reason for r in grown), grown
        expected = torch.cat([torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64)], 1)
        assert torch.equal(ids.cpu(), expected)


def test_a_view_of_another_storage_is_not_called_growth():
    """Two storages of unrelated shapes viewed at one line: the reason names the storage's shape, and
    claims no growing sequence (which only a storage one longer along one dim is)."""
    with torch_tpu.set_eager_mode(EagerMode.STRICT):
        before = len(cache.recompiles)
        for cols in (6, 9):
            base = torch.arange(4.0 * cols, device="tpu").reshape(4, cols)
            (base[:, :2] * 2).sum().item()
        reasons = [r.reason for r in cache.recompiles[before:] if "aten.mul" in r.site]
    assert reasons and "the storage it views has another shape" in reasons[0], reasons
    assert not any("grows every step" in r for r in reasons), reasons
