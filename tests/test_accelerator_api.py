"""``torch.accelerator`` with tpu the current accelerator: what transformers, accelerate and
Lightning call either works or raises a clear error (docs/porting.md lists it)."""

from __future__ import annotations

import pytest
import torch

import torch_tpu

A = torch.accelerator


def test_device_selection():
    assert A.current_accelerator() == torch.device("tpu")
    assert A.current_accelerator(check_available=True) == torch.device("tpu")
    assert A.is_available()
    assert A.device_count() == torch.tpu.device_count() >= 1
    assert A.current_device_index() == 0
    A.set_device_index(0)
    with A.device_index(0):
        assert A.current_device_index() == 0


def test_synchronize_waits_for_queued_work():
    x = torch.randn(64, 64, device="tpu")
    y = x @ x
    A.synchronize()
    A.synchronize(0)
    A.synchronize("tpu:0")
    torch.testing.assert_close(y.cpu(), x.cpu() @ x.cpu(), rtol=1e-4, atol=1e-4)


def test_streams_and_events():
    """``torch.accelerator``'s stream is tpu's one ordered queue. PyTorch's generic ``torch.Event``
    cannot wait on a Python backend and says so; ``torch.tpu.Event`` does."""
    s = A.current_stream()
    assert s.device == torch.device("tpu", 0)
    A.set_stream(s)
    assert s.query()
    e = torch.Event(device="tpu")
    e.record(s)
    with pytest.raises(RuntimeError, match="synchronizing events"):
        e.synchronize()
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record()
    torch.randn(32, 32, device="tpu").sum().item()
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0


def test_memory_functions_answer_from_xla_or_raise():
    A.empty_cache()
    stats = torch_tpu.device.tpu_module._memory_stats_or_none(torch.tpu.jax_device(0))
    if not stats:  # XLA:CPU keeps no statistics: an error naming it, never a made-up 0
        for f in (A.memory_stats, A.memory_allocated, A.max_memory_allocated, A.memory_reserved,
                  A.get_memory_info):
            with pytest.raises(RuntimeError, match="reports no memory statistics"):
                f()
    else:
        assert A.memory_allocated() == torch.tpu.memory_allocated()
        assert A.memory_stats()["allocated_bytes.all.current"] == stats["bytes_in_use"]
        free, total = A.get_memory_info()
        assert 0 <= free <= total
    with pytest.raises(NotImplementedError, match="reset_peak_memory_stats"):
        A.reset_peak_memory_stats()


def test_device_capability_raises_clearly():
    with pytest.raises(RuntimeError, match="device capabilities"):
        A.get_device_capability()
