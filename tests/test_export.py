"""torch_tpu.export: StableHLO text, and a saved artifact that JAX alone runs like eager CPU PyTorch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch
from torch import nn

import torch_tpu


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()


def test_stablehlo_and_saved_artifact_match_cpu(tmp_path):
    m = model()
    x = torch.randn(2, 3, 8, 8)
    want = m(x).detach()
    art = torch_tpu.export(m.to("tpu"), (x.to("tpu"),))
    text = art.stablehlo_text()
    assert "stablehlo" in text and "func.func public @main" in text
    torch.testing.assert_close(art(x), want, rtol=1e-4, atol=1e-5)
    art.save(tmp_path)
    run = torch_tpu.load(tmp_path)
    torch.testing.assert_close(torch.from_numpy(np.asarray(run(x.numpy()))), want, rtol=1e-4, atol=1e-5)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "want.npy", want.numpy())


def test_artifact_runs_without_torch(tmp_path):
    m = model()
    x = torch.randn(2, 3, 8, 8)
    torch_tpu.export(m, (x,)).save(tmp_path)
    np.save(tmp_path / "x.npy", x.numpy())
    np.save(tmp_path / "want.npy", m(x).detach().numpy())
    code = f"""
import sys
sys.modules["torch"] = None  # any import of torch now fails
sys.path.insert(0, {str(tmp_path)!r})
import numpy as np
from serve import load
run = load({str(tmp_path)!r})
out = np.asarray(run(np.load({str(tmp_path / 'x.npy')!r})))
np.testing.assert_allclose(out, np.load({str(tmp_path / 'want.npy')!r}), rtol=1e-4, atol=1e-5)
print("ok", "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok False"
