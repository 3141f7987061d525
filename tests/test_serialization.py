"""torch.save / torch.load, pickling and deepcopy of tpu tensors, modules and optimizer state."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from conftest import assert_same
from torch import nn


def roundtrip(obj, **load_kw):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kw)


def test_tensor_save_load_keeps_device_and_values():
    c = torch.randn(3, 4)
    t = c.to("tpu")
    back = roundtrip({"t": t, "v": t[:, 1:], "i": t.long(), "b": t.bfloat16()})
    assert_same(back["t"], c)
    assert_same(back["v"], c[:, 1:])
    assert back["i"].dtype == torch.int64 and back["b"].dtype == torch.bfloat16
    on_cpu = roundtrip({"t": t}, map_location="cpu")
    assert on_cpu["t"].device.type == "cpu"
    torch.testing.assert_close(on_cpu["t"], c)


def test_cpu_checkpoint_onto_tpu():
    c = {"w": torch.randn(4, 5), "view": torch.arange(10.0)[2:8:2], "h": torch.ones(3, dtype=torch.float16)}
    back = roundtrip(c, map_location="tpu")
    for k, v in c.items():
        assert_same(back[k], v)


def test_module_and_optimizer_state():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4, device="tpu")).sum().backward()
    opt.step()
    state = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to("tpu")
    fresh.load_state_dict(state["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(state["opt"])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())
    exp_avg = fresh_opt.state_dict()["state"][0]["exp_avg"]
    assert exp_avg.device.type == "tpu"
    assert torch.equal(exp_avg.cpu(), opt.state_dict()["state"][0]["exp_avg"].cpu())


def test_deepcopy_and_pickle():
    model = nn.Linear(3, 2).to("tpu")
    clone = copy.deepcopy(model)
    assert type(clone.weight) is nn.Parameter and clone.weight.device.type == "tpu"
    with torch.no_grad():
        clone.weight.add_(1)
    assert not torch.equal(clone.weight.cpu(), model.weight.cpu())
    t = torch.randn(2, 2, device="tpu").requires_grad_()
    p = pickle.loads(pickle.dumps(t))
    assert p.requires_grad and torch.equal(p.detach().cpu(), t.detach().cpu())
