"""Execution modes, metrics and the CPU fallback."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import torch_tpu
from torch_tpu import EagerMode

_lib = torch.library.Library("tpu_test", "DEF")
_lib.define("cpu_only(Tensor x) -> Tensor")
_lib.impl("cpu_only", lambda x: x * 2 + 1, "CPU")


def test_modes_switch_and_restore():
    start = torch_tpu.get_eager_mode()
    assert start.value == os.environ.get("TORCH_TPU_EAGER_MODE", "strict")  # strict unless the env says
    for mode in (EagerMode.DEBUG, EagerMode.STRICT, EagerMode.FUSED, "debug"):
        with torch_tpu.set_eager_mode(mode):
            assert torch_tpu.get_eager_mode() is EagerMode(mode)
            assert ((torch.ones(2, device="tpu") * 3).cpu() == 3).all()
        assert torch_tpu.get_eager_mode() is start
    with pytest.raises(ValueError):
        torch_tpu.set_eager_mode("lazy")


def test_metrics_count_ops():
    torch_tpu.reset_metrics()
    x = torch.ones(4, device="tpu")
    (x + x).neg()
    m = torch_tpu.metrics()
    assert m["op_counts"]["aten.add.Tensor"] == 1
    assert m["op_counts"]["aten.neg.default"] == 1
    assert "aten.add.Tensor" in torch_tpu.metrics_report()


def test_cpu_fallback_is_counted_and_warned_once():
    x = torch.tensor([0.0, 1.0, 2.0]).to("tpu")
    torch_tpu.reset_metrics()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = torch.ops.tpu_test.cpu_only(x)
        torch.ops.tpu_test.cpu_only(x)
    assert y.device.type == "tpu"
    assert torch.equal(y.cpu(), torch.tensor([1.0, 3.0, 5.0]))
    assert torch_tpu.metrics()["fallback_counts"] == {"tpu_test.cpu_only.default": 2}
    assert sum("tpu_test.cpu_only.default has no lowering" in str(x.message) for x in w) <= 1
    assert "CPU fallbacks: 2" in torch_tpu.metrics_report()


def test_strict_env_forbids_fallback(monkeypatch):
    x = torch.ones(2).to("tpu")
    monkeypatch.setenv("TORCH_TPU_STRICT", "1")
    with pytest.raises(NotImplementedError, match="tpu_test.cpu_only.default has no lowering"):
        torch.ops.tpu_test.cpu_only(x)


def test_debug_mode_surfaces_errors_at_the_op():
    with torch_tpu.set_eager_mode(EagerMode.DEBUG):
        with pytest.raises(RuntimeError):
            torch.ones(2, device="tpu") + torch.ones(3, device="tpu")


def test_env_selects_mode():
    import subprocess
    import sys

    code = "import torch_tpu; print(torch_tpu.get_eager_mode().value)"
    cases = [({"TORCH_TPU_EAGER_MODE": "debug"}, "debug"), ({"TORCH_TPU_EAGER_MODE": "fused"}, "fused"),
             ({"TORCH_TPU_LAUNCH_BLOCKING": "1"}, "debug")]
    for env, want in cases:
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env, "TORCH_TPU_PLATFORM": "cpu"},
                             capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_reset_metrics_clears_the_report_and_cache_counters():
    w = torch.randn(8, 4, device="tpu")
    with torch_tpu.set_eager_mode("fused"):
        for n in (16, 5, 7):  # a new input shape each time: recompilations at one site
            (torch.ones(n, 8).to("tpu") @ w).sum().item()
    assert torch_tpu.cache_stats()["misses"] >= 3
    assert "recompil" in torch_tpu.metrics_report()
    torch_tpu.reset_metrics()
    stats = torch_tpu.cache_stats()
    assert stats["requests"] == stats["misses"] == 0
    assert all(e["hits"] == 0 for e in stats["entries"])  # compiled entries stay
    assert stats["entries"]
    assert "recompil" not in torch_tpu.metrics_report()


def test_op_on_uninitialised_storage_after_same_signature():
    # An unset storage (torch.empty) is zeros made inside the op's program; its signature must not
    # match a set tensor's, or the cached program would wait for an input that never comes.
    x = torch.ones(3, device="tpu")
    torch.testing.assert_close((x * x).cpu(), torch.ones(3))
    e = torch.empty(3, device="tpu")
    assert (e * x).shape == (3,)
    torch.testing.assert_close(torch.empty(3, device="tpu").fill_(2.0).cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_clones_and_small_constants_share_arrays_but_not_values(mode):
    """A whole-tensor clone and a small torch.full (or scalar_tensor, ones) share one device array
    with their source or an equal constant, launching nothing; in-place writes to any of them,
    including a fused program that would donate a buffer it alone held, leave the others as on CPU."""
    results = {}
    for dev in ("cpu", "tpu"):
        with torch_tpu.set_eager_mode(mode if dev == "tpu" else "strict"):
            w = (torch.arange(6.0, device=dev) - 2.5).reshape(2, 3)
            c = w.clone()
            f1 = torch.full((2, 3), -float("inf"), device=dev)
            f2 = torch.full((2, 3), -float("inf"), device=dev)
            z = torch.full((2, 3), -0.0, device=dev)
            m = torch.full((4,), False, device=dev)
            s = torch.scalar_tensor(7, device=dev)
            o = torch.ones(2, 3, dtype=torch.bfloat16, device=dev)
            w.mul_(2)
            f1.clamp_(min=0)
            m[1] = True
            o.add_(o)
            s += 1
            got = [t.cpu() for t in (w, c, f1, f2, z, m, s, o, torch.full((2, 3), -float("inf"), device=dev))]
        results[dev] = got
    for cpu, tpu in zip(results["cpu"], results["tpu"]):
        assert cpu.dtype == tpu.dtype
        assert torch.equal(cpu, tpu)
        assert torch.equal(torch.signbit(cpu.float()), torch.signbit(tpu.float()))


def test_strict_mode_records_eager_ops_between_compiled_graphs():
    # torch.compile on the model only: the loss, the backward graph and an eager AdamW step join
    # the forward graph's pending program, so each training step is one cached program.
    import copy

    from torch import nn

    torch.manual_seed(0)
    mc = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    mt = copy.deepcopy(mc).to("tpu")
    compiled = torch.compile(mt, backend="tpu")
    oc, ot = torch.optim.AdamW(mc.parameters(), lr=0.1), torch.optim.AdamW(mt.parameters(), lr=0.1)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    xt, yt = x.to("tpu"), y.to("tpu")
    with torch_tpu.set_eager_mode("strict"):
        for i in range(6):
            loss = torch.nn.functional.mse_loss(compiled(xt), yt)
            ot.zero_grad()
            loss.backward()
            ot.step()
            lc = torch.nn.functional.mse_loss(mc(x), y)
            oc.zero_grad()
            lc.backward()
            oc.step()
            if i == 2:
                torch_tpu.sync()
                before = torch_tpu.cache_stats()
        torch_tpu.sync()
    after = torch_tpu.cache_stats()
    assert (after["hits"] - before["hits"], after["misses"] - before["misses"]) == (3, 0)
    for a, b in zip(mc.parameters(), mt.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
