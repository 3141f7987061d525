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
                "projected_steps_per_s", "projected_mfu", "bound", "failed_programs", "steps", "peak_hbm_share",
                "chips", "x64_share"}
_TARGET_SCRIPT = """
import json, torch_tpu
from torch_tpu.bench.__main__ import train
for mode in ("strict", "graph", "estimator", "jax"):
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
    assert [r["mode"] for r in rows] == ["strict", "graph", "estimator", "jax"]
    for row in rows:
        t = row["target"]
        assert set(t) == _TARGET_KEYS, set(t) ^ _TARGET_KEYS
        assert t["chip"] == "v5e:2x2" and t["failed_programs"] == 0 and t["steps"] == 6
        # the row rounds its host ms to the microsecond; the target object keeps them unrounded
        assert t["host_ms_per_step"] == pytest.approx(row["host_ms_per_step"], abs=5.1e-4)
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


@pytest.mark.parametrize("workload", ["mlp", "gpt-tiny"])
def test_train_jax_mode_is_the_same_step_written_in_jax(workload):
    """``bench train --mode jax``, the ceiling: the same weights, batch and optimizer arithmetic
    (SGD, AdamW) as the torch workload, so its losses are CPU PyTorch's; timed as the other modes."""
    ours = train(workload, "jax", steps=2, warmup=2)
    reference = train(workload, "cpu", steps=2, warmup=2)
    assert ours["mode"] == "jax" and ours["steps_per_s"] > 0 and ours["host_ms_per_step"] > 0
    assert 0 < ours["compile_s"] <= ours["first_step_s"]
    assert ours["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-4, abs=1e-5)


def test_train_jax_mode_bf16_follows_autocast():
    ours = train("gpt-tiny", "jax", steps=1, warmup=1, bf16=True)
    reference = train("gpt-tiny", "cpu", steps=1, warmup=1, bf16=True)
    full = train("gpt-tiny", "jax", steps=1, warmup=1)
    assert ours["final_loss"] == pytest.approx(reference["final_loss"], rel=2e-2)
    assert ours["final_loss"] != full["final_loss"]  # bfloat16 did change the arithmetic


_DECODE_SCRIPT = """
import json, torch_tpu
from torch_tpu.bench import decode
for mode, loop in (("strict", "static"), ("export", "export"), ("jax", "static")):
    row = decode.measure(mode, loop, new=3, prompt_len=4, batch=2, layers=1, hidden=32, target="v5e")
    row.pop("tokens")
    row["target_after"] = repr(torch_tpu.runtime.target.current())
    print(json.dumps(row))
"""


@pytest.mark.skipif(not torch_tpu.runtime.target.available(), reason="a TPU target needs libtpu")
def test_decode_projects_tokens_per_second_on_a_target_chip(tmp_path):
    """``bench decode --target v5e``: each row's "target" object over the timed calls' token steps,
    the tpu modes' programs, the exported artifact's program (torch_tpu.export) and the JAX
    ceiling's step (its weights a dict of arrays) compiled for the chip; projected tokens/s =
    batch / max(host, device) per token step."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", _DECODE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["mode"], r["loop"]) for r in rows] == [("strict", "static"), ("export", "export"), ("jax", "static")]
    for row in rows:
        t = row["target"]
        assert set(t) == _TARGET_KEYS | {"projected_tokens_per_s"}, set(t) ^ _TARGET_KEYS
        assert t["chip"] == "v5e:2x2" and t["failed_programs"] == 0 and t["steps"] == 3 * decode_timed()
        assert t["device_ms_per_step"] > 0 and 0 < t["peak_hbm_bytes"] < t["hbm_bytes"]
        assert t["projected_tokens_per_s"] == pytest.approx(
            2 * 1e3 / max(t["host_ms_per_step"], t["device_ms_per_step"]), rel=1e-3)
        assert row["target_after"] == "None"


def decode_timed() -> int:
    from torch_tpu.bench import decode

    return decode.TIMED
