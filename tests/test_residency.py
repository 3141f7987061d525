"""The bound on compiled programs held in memory (torch_tpu/runtime/residency.py): past it every
compiled program is dropped and compiles again when used, values unchanged, and a captured graph
keeps its executable."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_tpu
from torch_tpu.runtime import residency


@pytest.fixture
def low_bound(monkeypatch):
    """A bound just above what the process holds now, checked at every compile."""
    monkeypatch.setattr(residency, "THRESHOLD", residency.mappings() + 200)
    monkeypatch.setattr(residency, "CHECK_EVERY", 1)
    monkeypatch.setattr(residency, "_warned", [False])


def _values(n: int) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.float32, device="tpu")
    return (x * 2 + 1).cumsum(0).cpu()


def test_programs_past_the_bound_are_dropped_and_still_give_cpu_values(low_bound):
    if residency.mappings() == 0:
        pytest.skip("no /proc/self/maps on this system: there is no mapping count to bound")
    before = torch_tpu.metrics()["program_evictions"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(3, 40):  # a program per length: more than the bound holds
            x = torch.arange(n, dtype=torch.float32)
            torch.testing.assert_close(_values(n), (x * 2 + 1).cumsum(0))
    evicted = torch_tpu.metrics()["program_evictions"] - before
    assert evicted >= 1
    assert residency.mappings() < residency.THRESHOLD + 1000  # bounded, not growing with the lengths
    assert sum("vm.max_map_count" in str(w.message) for w in caught) == 1  # warned once
    torch.testing.assert_close(_values(5), (torch.arange(5.0) * 2 + 1).cumsum(0))  # a dropped one compiles again


def test_a_captured_graph_survives_an_eviction():
    static = torch.ones(4, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = static * 3 + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        residency.evict()
    static.copy_(torch.arange(4.0).to("tpu"))
    g.replay()
    torch.testing.assert_close(out.cpu(), torch.arange(4.0) * 3 + 1)
