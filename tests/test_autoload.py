"""PyTorch's backend autoload: ``import torch`` alone registers tpu (the light hook in
``_torch_tpu_autoload``); JAX and the package load at the first tpu op. Each case runs in a fresh
process, since what is checked is the state of a process after ``import torch``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch


def run(script: str, **env: str) -> dict:
    """Runs ``script`` in a fresh interpreter; it prints one JSON object as its last line."""
    full_env = {**os.environ, "TORCH_TPU_CACHE_DIR": "off", **env}
    out = subprocess.run([sys.executable, "-c", script], env=full_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_installed():
    """``pip install`` (``make``) registers the hook in the group ``import torch`` reads."""
    eps = {ep.name: ep.value for ep in entry_points(group="torch.backends")}
    assert eps.get("tpu") == "_torch_tpu_autoload:autoload", (
        f"torch.backends entry points: {eps}; reinstall the package (pip install -e .)")


_PLAIN_TORCH = r"""
import json, sys
import torch
state = {"device": str(torch.device("tpu", 0)), "jax_after_import": "jax" in sys.modules,
         "package_after_import": "torch_tpu" in sys.modules,
         "accelerator": str(torch.accelerator.current_accelerator(check_available=True)),
         "available": torch.tpu.is_available()}
state["jax_after_probe"] = "jax" in sys.modules
# a CPU backward first: the autograd engine sizes its device queues now (the old import-order trap)
w = torch.ones(3, requires_grad=True)
(w * 2).sum().backward()
x = torch.arange(4.0, device="tpu").requires_grad_()
state["jax_after_first_op"] = "jax" in sys.modules
(x * x).sum().backward()
state["grad"] = x.grad.cpu().tolist()
state["grad_device"] = str(x.grad.device)
import torch_tpu  # explicit import after autoload: the same, already loaded package
state["platform"] = torch_tpu.platform()
state["sync"] = torch.tpu.synchronize() is None
print(json.dumps(state))
"""


def test_import_torch_alone_registers_tpu_and_loads_jax_at_first_use():
    s = run(_PLAIN_TORCH)
    assert s["device"] == "tpu:0"
    assert not s["jax_after_import"] and not s["package_after_import"], s
    assert s["accelerator"] == "tpu" and s["available"]
    assert not s["jax_after_probe"], "the availability probe imported jax"
    assert s["jax_after_first_op"]
    x = torch.arange(4.0, requires_grad=True)
    (x * x).sum().backward()
    assert s["grad"] == x.grad.tolist() and s["grad_device"] == "tpu:0"
    assert s["platform"] in ("cpu", "gpu", "tpu") and s["sync"]


def test_autoload_off_leaves_torch_untouched():
    """``TORCH_DEVICE_BACKEND_AUTOLOAD=0``: the hook does not run; ``import torch_tpu`` still registers."""
    s = run(r"""
import json, sys
import torch
state = {"hook": "_torch_tpu_autoload" in sys.modules, "name": torch._C._get_privateuse1_backend_name()}
try:
    torch.device("tpu")
    state["device"] = "parsed"
except RuntimeError as e:
    state["device"] = type(e).__name__
import torch_tpu
state["after"] = str(torch.ones(2, device="tpu").device)
print(json.dumps(state))
""", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert s == {"hook": False, "name": "privateuseone", "device": "RuntimeError", "after": "tpu:0"}


def test_module_move_and_training_with_autoload_only():
    """``model.to("tpu")`` as the first tpu op keeps parameter objects (the package loads inside it)."""
    s = run(r"""
import json
import torch
torch.manual_seed(0)
m = torch.nn.Linear(3, 2)
w = m.weight
m.to("tpu")
opt = torch.optim.SGD(m.parameters(), lr=0.1)
x = torch.randn(4, 3)
for _ in range(2):
    loss = m(x.to("tpu")).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
print(json.dumps({"same": m.weight is w, "device": str(m.weight.device), "w": m.weight.detach().cpu().tolist()}))
""")
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for _ in range(2):
        loss = m(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert s["same"] and s["device"] == "tpu:0"
    torch.testing.assert_close(torch.tensor(s["w"]), m.weight.detach())


_PROBE = r"""
import json, sys
import torch
import torch_tpu
import jax._src.xla_bridge as xb
acc = torch.accelerator.current_accelerator(check_available=True)
state = {"accelerator": str(acc), "available": torch.tpu.is_available(),
         "started_by_probe": xb.backends_are_initialized()}
try:  # the truth, found by starting JAX on the requested platform
    import jax
    state["real"] = len(jax.devices()) > 0
except Exception:  # RuntimeError, or an AssertionError for a platform with no plugin at all
    state["real"] = False
print(json.dumps(state))
"""


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
def test_availability_probe_does_not_start_jax(platform):
    """torch >= 2.14's ``init_process_group()`` calls ``current_accelerator(check_available=True)``
    before the XLA collectives path starts JAX's multi-controller runtime; starting a PJRT client
    there would make that impossible. The probe answers from the installed plugins, and its answer
    is the one starting JAX gives (a TPU exists only where libtpu is installed, a GPU only where
    JAX's CUDA plugin is)."""
    s = run(_PROBE, TORCH_TPU_PLATFORM=platform)
    assert not s["started_by_probe"], s
    assert s["available"] == s["real"], s
    assert s["accelerator"] == ("tpu" if s["real"] else "None")


def test_post_import_hooks_keep_the_module_loader():
    """A hooked module (here inductor's compile_fx) keeps its own loader's services: its source."""
    import torch._inductor.compile_fx as compile_fx

    assert "def compile_fx" in compile_fx.__loader__.get_source(compile_fx.__name__)
    assert compile_fx.__spec__.origin.endswith("compile_fx.py")
