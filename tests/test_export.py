"""torch_tpu.export: StableHLO text, and a saved artifact that JAX alone runs like eager CPU PyTorch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
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


class _Heads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 3)

    def forward(self, x, scale: float = 2.0, *, bias=None):
        y = self.body(x) * scale
        return {"y": y + bias if bias is not None else y, "norm": y.norm()}


def test_artifact_takes_the_models_arguments_and_returns_its_structure(tmp_path):
    m = _Heads().eval()
    x, b = torch.randn(5, 4), torch.randn(3)
    art = torch_tpu.export(m, (x, 3.0), {"bias": b})
    got, want = art(x.to("tpu"), 3.0, bias=b), m(x, 3.0, bias=b)
    assert set(got) == {"y", "norm"}
    for k in want:
        torch.testing.assert_close(got[k], want[k].detach(), rtol=1e-4, atol=1e-5)
    # the program is specialized on the example's shapes and numbers: a different one is refused
    with pytest.raises(ValueError, match=r"exported with \[3.0\] built in"):
        art(x, 4.0, bias=b)
    with pytest.raises(ValueError, match=r"input tensor 0 is float32\[2, 4\], but the program was exported for "
                                         r"float32\[5, 4\]"):
        art(torch.randn(2, 4), 3.0, bias=b)
    art.save(tmp_path)  # served by JAX alone: tensor inputs in, a flat tuple out
    y, norm = torch_tpu.load(tmp_path)(x.numpy(), b.numpy())
    np.testing.assert_allclose(np.asarray(y), want["y"].detach().numpy(), rtol=1e-4, atol=1e-5)


def test_bfloat16_artifact():
    torch.manual_seed(0)
    m = nn.Linear(4, 3).to(torch.bfloat16).eval()
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    got = torch_tpu.export(m, (x,))(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, m(x).detach(), rtol=2e-2, atol=2e-2)
