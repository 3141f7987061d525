"""Fused eager mode: the same semantics as strict mode, one XLA program per sync point, and a
compilation cache that explains itself."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import torch_tpu
from torch_tpu import EagerMode
from torch_tpu.runtime import cache, fused


@pytest.fixture
def fused_mode():
    with torch_tpu.set_eager_mode(EagerMode.FUSED):
        cache.reset_stats()
        yield
    assert fused.pending_count() == 0


def test_ops_are_deferred_until_a_sync_point(fused_mode):
    x = torch.ones(3, device="tpu")
    y = (x * 2 + 1).neg()
    assert fused.pending_count() > 0
    assert y.tolist() == [-3.0, -3.0, -3.0]  # a host read runs the trace
    assert fused.pending_count() == 0
    z = y * y
    torch_tpu.sync()
    assert fused.pending_count() == 0
    assert z.sum().item() == 27.0


def test_views_and_inplace_match_cpu(fused_mode):
    c = torch.randn(4, 6)
    t = c.clone().to("tpu")
    for x in (c, t):
        x.t()[1:3, 2].add_(5)
        x[:, 1].mul_(2)
        v = x.view(2, 12)
        v[1, ::3] = 7.0
        x.diagonal().zero_()
    torch.testing.assert_close(t.cpu(), c)


def _train(model, dev, steps, lrs=None):
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8).to(dev)
    y = torch.randn(16, 1).to(dev)
    losses = []
    for i in range(steps):
        if lrs:
            opt.param_groups[0]["lr"] = lrs[i]
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def test_training_matches_cpu_and_reaches_steady_state(fused_mode):
    cpu = mlp()
    tpu = copy.deepcopy(cpu).to("tpu")
    lrs = [1e-2 * 0.9**i for i in range(6)]  # a changing learning rate must not recompile
    want = _train(cpu, "cpu", 6, lrs)
    misses = []
    opt_losses = []
    torch.manual_seed(0)
    opt = torch.optim.AdamW(tpu.parameters(), lr=1e-2)
    x = torch.randn(16, 8).to("tpu")
    y = torch.randn(16, 1).to("tpu")
    for i in range(6):
        before = torch_tpu.cache_stats()["misses"]
        opt.param_groups[0]["lr"] = lrs[i]
        opt.zero_grad()
        loss = nn.functional.mse_loss(tpu(x), y)
        loss.backward()
        opt.step()
        opt_losses.append(loss.item())
        misses.append(torch_tpu.cache_stats()["misses"] - before)
    torch.testing.assert_close(torch.tensor(opt_losses), torch.tensor(want), rtol=1e-4, atol=1e-5)
    for a, b in zip(cpu.parameters(), tpu.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=1e-4, atol=1e-5)
    assert misses[2:] == [0, 0, 0, 0], misses  # zero misses per step after two warm-up steps
    stats = torch_tpu.cache_stats()
    assert stats["hits"] > 0 and stats["entries"] and stats["compile_seconds"] > 0
    assert all({"fingerprint", "hits", "compile_seconds", "last_use"} <= set(e) for e in stats["entries"])


def _sgd_steps(model, steps, read_loss):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 16).to("tpu")
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if read_loss:
            loss.item()
    return loss


def test_step_program_leaves_out_dropped_gradients(fused_mode):
    """The optimizer step's trace runs once zero_grad has dropped the gradients, so the step's
    program writes out only the parameters and the loss; a loop that reads the loss after the
    step (gradients still alive) gets its own program and does not widen the other one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("tpu")
    n_params = len(list(model.parameters()))
    loss = _sgd_steps(model, 4, read_loss=False)
    loss.item()  # the last step runs here, its gradients alive: a program with them as outputs
    cache.reset_stats()
    _sgd_steps(model, 3, read_loss=False)
    model.zero_grad(set_to_none=True)
    torch_tpu.sync()
    outputs = sorted(e["outputs"] for e in torch_tpu.cache_stats()["entries"] if e["hits"])
    assert outputs == [n_params + 1], torch_tpu.cache_stats()["entries"]  # parameters and loss only
    assert {e["outputs"] for e in torch_tpu.cache_stats()["entries"]} >= {n_params + 1, 2 * n_params + 1}


def test_parameters_updated_in_place_keep_their_buffers(fused_mode):
    """A donated parameter must be paired with its own update, not with another output of its shape
    (its gradient): XLA then writes the new value over the old one instead of copying it."""
    from torch_tpu.tensor import storage as _storage

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(8, 16).to("tpu")

    def buffers():
        return [_storage.base_array(p.untyped_storage()).unsafe_buffer_pointer() for p in model.parameters()]

    kept = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()  # the gradients stay alive through the step: outputs of the same shapes
        before = buffers()
        opt.step()
        loss.item()
        kept.append(sum(a == b for a, b in zip(before, buffers())))
    assert kept[1:] == [4, 4, 4], kept  # the first step also creates the optimizer's state


def test_recompile_explainer_names_the_changed_shape(fused_mode, monkeypatch):
    monkeypatch.setattr(cache, "RECOMPILE_WARN", 2)
    w = torch.randn(8, 4, device="tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (16, 16, 16, 5, 16, 7, 16, 3):  # a loop whose last batches are smaller
            x = torch.ones(batch, 8).to("tpu")
            (x @ w).relu().sum().item()
    reasons = [r.reason for r in cache.recompiles]
    assert reasons, "a shape change must be recorded as a recompilation"
    assert any("[5, 8]" in r or "[16, 8]" in r for r in reasons), reasons
    assert "recompilations" in torch_tpu.metrics_report()
    found = [c for c in caught if "recompiled" in str(c.message)]
    assert len(found) == 1 and "drop_last=True" in str(found[0].message)
    assert found[0].filename == __file__  # the warning points at the user's line, not into torch_tpu


def _broken(self):
    raise ValueError("broken lowering")


def test_lowering_error_surfaces_at_the_op_as_in_strict_mode(fused_mode):
    from torch_tpu.dispatch import op_kernel as _op_kernel
    from torch_tpu.ops import _registry

    bad_kernel = _op_kernel._OpKernel(torch.ops.aten.neg.default, _registry.Lowering(_broken), "functional")
    with pytest.raises(ValueError, match=r"aten\.neg\.default\(float32\[2\]\): broken lowering"):
        bad_kernel(torch.ones(2, device="tpu"))  # traced abstractly when recorded


def test_error_at_sync_names_op_and_line(fused_mode):
    x = torch.ones(2, device="tpu")
    y = x.neg()  # recorded
    node = fused._pending[-1]
    node.program = copy.copy(node.program)  # a program that fails only when the trace is compiled
    node.program.fn = _broken
    with pytest.raises(ValueError, match=r"aten\.neg\.default.*recorded at .*test_fused\.py:\d+.*broken lowering"):
        y.cpu()


def test_length_cap_flushes(fused_mode, monkeypatch):
    monkeypatch.setattr(fused, "MAX_OPS", 10)
    x = torch.zeros(2, device="tpu")
    for _ in range(25):
        x = x + 1
    assert fused.pending_count() < 10
    assert x.tolist() == [25.0, 25.0]


def test_a_loop_that_never_reads_replays_one_program(fused_mode, monkeypatch):
    """A loop of ops that never reads the host (an evaluation loop summing on the device) is cut at
    a whole number of iterations once it first passes the length cap, so its later traces repeat
    one program: cut at the cap alone, each trace started at another op of the iteration (7 ops,
    a cap of 100) and compiled anew, seven programs for this loop."""
    monkeypatch.setattr(fused, "MAX_OPS", 100)
    w = torch.randn(4, 4)
    xs = [torch.randn(3, 4) for _ in range(300)]

    def run(device, xs):
        total = torch.zeros((), device=device)
        for x in xs:
            total += ((x @ w.to(device)).relu() * 2 - 1).abs().sum()  # 7 ops
        return total

    on_tpu = [x.to("tpu") for x in xs]
    torch_tpu.sync()  # a host read: the loop starts a fresh run of traces
    before = torch_tpu.metrics()["compile_count"]
    torch.testing.assert_close(run("tpu", on_tpu[:200]).cpu(), run("cpu", xs[:200]))
    assert torch_tpu.metrics()["compile_count"] - before <= 3  # the capped trace, the loop's, the last
    before = torch_tpu.metrics()["compile_count"]
    torch.testing.assert_close(run("tpu", on_tpu).cpu(), run("cpu", xs))
    assert torch_tpu.metrics()["compile_count"] - before <= 1  # only the last, shorter trace


def test_backward_runs_in_fused_mode(fused_mode):
    c = torch.randn(5, requires_grad=True)
    t = c.detach().to("tpu").requires_grad_()
    for x in (c, t):
        (x.sin() * x).sum().backward()
    torch.testing.assert_close(t.grad.cpu(), c.grad)


@pytest.mark.skipif(torch_tpu.runtime.target.client_loaded(),
                    reason="libtpu's compile-only client is loaded (a TPU target): JAX's profiler cannot trace")
def test_profile_writes_a_trace_and_summarises(tmp_path, fused_mode):
    x = torch.randn(32, 32).to("tpu")
    with torch_tpu.profile(tmp_path / "trace") as prof:
        for _ in range(3):
            y = (x @ x).relu().sum()
            y.item()
    text = prof.summary()
    assert "fused program" in text and "host->device" in text and "recompilations" in text
    assert "device->host: " in text
    assert any(p.suffix in (".pb", ".gz") or p.name.endswith(".xplane.pb") for p in (tmp_path / "trace").rglob("*"))


_PERSIST_SCRIPT = """
import torch, torch_tpu
torch_tpu.set_eager_mode("fused")
x = torch.arange(64.0).reshape(8, 8).to("tpu")
for _ in range(5):
    x = torch.tanh(x @ x * 0.01 + 1)
print(round(x.sum().item(), 4))
"""


def test_persistent_cache_survives_corrupt_entries(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_CACHE_DIR": str(tmp_path), "TORCH_TPU_CACHE_MIN_COMPILE_SECONDS": "0",
           "TORCH_TPU_PLATFORM": "cpu"}

    def run():
        return subprocess.run([sys.executable, "-c", _PERSIST_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=300)

    first = run()
    assert first.returncode == 0, first.stderr
    entries = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert entries, "the fused program must be written to the persistent cache"
    for p in entries:
        p.write_bytes(b"not an executable")
    second = run()
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout
    assert "Error reading persistent compilation cache entry" in second.stderr


def test_an_unusable_cache_directory_warns_and_runs_on(tmp_path):
    """A read-only home or a path through a file must not stop ``import torch_tpu``."""
    import os
    import subprocess
    import sys

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    env = {**os.environ, "TORCH_TPU_CACHE_DIR": str(blocker / "cache"), "TORCH_TPU_PLATFORM": "cpu"}
    r = subprocess.run([sys.executable, "-c", _PERSIST_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "cannot be created" in r.stderr and "will not persist across processes" in r.stderr
    assert float(r.stdout) > 0


def test_a_repeated_trace_replays_only_when_everything_matches(fused_mode):
    """A trace that repeats the last one of its op sequence runs its executable at once; one whose
    inputs now alias differently, have another shape, or keep other results alive takes the full
    path and is still right."""
    a, b = torch.randn(3, device="tpu"), torch.randn(3, device="tpu")
    c = torch.randn(4, device="tpu")
    replays = []
    original = fused._Template.replay

    def counting(self, *args):
        replays.append(original(self, *args))
        return replays[-1]

    fused._Template.replay = counting
    try:
        for x, y, keep in [(a, b, False), (a, b, False), (a, a, False), (b, b, False), (a, b, True),
                           (a, b, False), (c, c, False), (b, a, False)]:
            cx, cy = x.cpu(), y.cpu()
            doubled = x * 2
            out = doubled + y
            if not keep:
                del doubled  # an intermediate: not an output of the trace
            torch.testing.assert_close(out.cpu(), cx * 2 + cy)
            if keep:
                torch.testing.assert_close(doubled.cpu(), cx * 2)
    finally:
        fused._Template.replay = original
    assert True in replays and False in replays  # some traces replayed, some differed and did not
