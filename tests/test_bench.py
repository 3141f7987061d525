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
