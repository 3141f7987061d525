"""The benchmark command's training measure: the same workload on tpu and on CPU PyTorch."""

from __future__ import annotations

import pytest

import torch_tpu
from torch_tpu.bench.__main__ import train


@pytest.mark.parametrize("mode", ["fused", "compile", "graph", "estimator"])
def test_train_reports_speed_cpu_time_and_the_cpu_loss(mode):
    before = torch_tpu.get_eager_mode()
    ours = train("mlp", mode, steps=2, warmup=2)
    reference = train("mlp", "cpu", steps=2, warmup=2)
    assert torch_tpu.get_eager_mode() is before  # the mode in force is given back
    assert ours["steps_per_s"] > 0 and ours["first_step_s"] > 0 and ours["cpu_ms_per_step"] > 0
    assert 0 < ours["host_ms_per_step"] and 0 < reference["host_ms_per_step"]
    # the first step built the step's program: its compile seconds are part of its time
    assert 0 < ours["compile_s"] < ours["first_step_s"]
    # the same steps from the same weights: the final losses agree with CPU PyTorch's
    assert ours["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-4, abs=1e-5)
    if mode == "estimator":  # TPUEstimator().fit: its steps replayed after the warm-up one
        assert ours["execution"] == "replay" and ours["replayed_steps"] == 8


_TARGET_KEYS = {"chip", "device_ms_per_step", "device_ms_source", "peak_hbm_bytes", "hbm_bytes", "host_ms_per_step",
                "projected_steps_per_s", "projected_mfu", "bound", "failed_programs", "steps", "peak_hbm_share"}
_TARGET_SCRIPT = """
import json, torch_tpu
from torch_tpu.bench.__main__ import train
for mode in ("strict", "graph", "estimator"):
    row = train("mlp", mode, steps=2, warmup=2, target="v5e")
    row["target_after"] = repr(torch_tpu.runtime.target.current())
    print(json.dumps(row))
"""


@pytest.mark.skipif(not torch_tpu.runtime.target.available(), reason="a TPU target needs libtpu")
def test_train_projects_the_step_on_a_target_chip(tmp_path):
    """``bench train --target v5e``: the row's "target" object, from the timed steps' programs as
    XLA:TPU compiled them, and the host time the row measured. In a process of its own: libtpu's
    compile-only client stays loaded, and JAX's profiler cannot run beside it (runtime.profiler)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", _TARGET_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["mode"] for r in rows] == ["strict", "graph", "estimator"]
    for row in rows:
        t = row["target"]
        assert set(t) == _TARGET_KEYS, set(t) ^ _TARGET_KEYS
        assert t["chip"] == "v5e:2x2" and t["failed_programs"] == 0 and t["steps"] == 6
        assert t["host_ms_per_step"] == pytest.approx(row["host_ms_per_step"], rel=1e-3)
        assert t["device_ms_per_step"] > 0 and 0 < t["peak_hbm_bytes"] < t["hbm_bytes"]
        assert t["projected_steps_per_s"] == pytest.approx(
            1e3 / max(t["host_ms_per_step"], t["device_ms_per_step"]), rel=1e-3)
        assert row["target_after"] == "None"  # the target is given back


@pytest.mark.parametrize("mode", ["strict", "estimator"])
def test_train_bf16_runs_the_forward_in_bfloat16_like_cpu(mode):
    """``bench train --bf16``: autocast to bfloat16 (the estimator's precision="bf16"), CPU's loss."""
    ours = train("gpt-tiny", mode, steps=1, warmup=1, bf16=True)
    reference = train("gpt-tiny", "cpu", steps=1, warmup=1, bf16=True)
    full = train("gpt-tiny", "cpu", steps=1, warmup=1)
    assert ours["bf16"] and reference["bf16"] and not full["bf16"]
    assert ours["final_loss"] == pytest.approx(reference["final_loss"], rel=2e-2)
    assert reference["final_loss"] != full["final_loss"]  # bfloat16 did change the arithmetic
