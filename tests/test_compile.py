"""torch.compile(backend="tpu"): the same lowering table on Dynamo/AOTAutograd graphs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import torch_tpu

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_inference_matches_cpu():
    mc = mlp()
    mt = torch.compile(copy.deepcopy(mc).to("tpu"), backend="tpu")
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(mt(x.to("tpu")).cpu(), mc(x), rtol=RTOL, atol=ATOL)


def test_training_with_backward_matches_cpu():
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    cm = torch.compile(mt, backend="tpu")
    oc = torch.optim.SGD(mc.parameters(), lr=0.1)
    ot = torch.optim.SGD(mt.parameters(), lr=0.1)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    for _ in range(3):
        for m, o, dev in ((mc, oc, "cpu"), (cm, ot, "tpu")):
            o.zero_grad()
            nn.functional.mse_loss(m(x.to(dev)), y.to(dev)).backward()
            o.step()
    for a, b in zip(mc.parameters(), mt.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=RTOL, atol=ATOL)


def test_graph_breaks_each_subgraph_compiled():
    def f(x):
        y = x.sin() * 2
        print("graph break")  # noqa: T201  (a side effect Dynamo cannot trace)
        return (y + 1).cos()

    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(f, backend="tpu")(x.to("tpu")).cpu(), f(x), rtol=RTOL, atol=ATOL)


def test_batchnorm_buffers_update_like_cpu():
    torch.manual_seed(0)
    mc = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    mt = torch.compile(copy.deepcopy(mc).to("tpu"), backend="tpu")
    x = torch.randn(2, 3, 6, 6)
    for _ in range(2):
        yc, yt = mc(x), mt(x.to("tpu"))
    torch.testing.assert_close(yt.detach().cpu(), yc.detach(), rtol=1e-3, atol=1e-4)
    bc, bt = mc[1], mt._orig_mod[1]
    torch.testing.assert_close(bt.running_mean.cpu(), bc.running_mean, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(bt.running_var.cpu(), bc.running_var, rtol=RTOL, atol=ATOL)
    assert bt.num_batches_tracked.item() == 2


def test_input_mutation():
    def f(x):
        x.add_(1)
        return x * 2

    c = torch.randn(3)
    t = c.clone().to("tpu")
    out = torch.compile(f, backend="tpu")(t)
    want = f(c)
    torch.testing.assert_close(out.cpu(), want)
    torch.testing.assert_close(t.cpu(), c)


def test_dropout_rng_in_graph():
    f = torch.compile(lambda x: nn.functional.dropout(x, 0.5, training=True), backend="tpu")
    x = torch.ones(1000, device="tpu")
    torch.manual_seed(0)
    a = f(x).cpu()
    torch.manual_seed(0)
    b = f(x).cpu()
    assert torch.equal(a, b)  # seeded
    assert set(a.unique().tolist()) <= {0.0, 2.0} and 0.35 < (a == 0).float().mean() < 0.65
    assert not torch.equal(f(x).cpu(), a)  # a fresh draw each call


@pytest.mark.parametrize("capturable", [False, True])
def test_compiled_whole_training_step(capturable):
    # capturable=False keeps AdamW's step counters on the host: the graph updates them on the CPU
    # (no device-to-host read per step) while the device reads a copy taken before the update.
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    oc = torch.optim.AdamW(mc.parameters(), lr=1e-2)
    ot = torch.optim.AdamW(mt.parameters(), lr=1e-2, capturable=capturable)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    xt, yt = x.to("tpu"), y.to("tpu")

    def step(m, o, x, y):
        o.zero_grad()
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return loss

    cstep = torch.compile(step, backend="tpu")
    for _ in range(6):
        lc = step(mc, oc, x, y)
        lt = cstep(mt, ot, xt, yt)
        torch.testing.assert_close(lt.detach().cpu(), lc.detach(), rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=RTOL, atol=ATOL)
        step_count = ot.state[b]["step"]
        assert step_count.device.type == ("tpu" if capturable else "cpu")
        assert float(step_count.cpu()) == float(oc.state[a]["step"]) == 6.0


def test_compiled_adamw_step_counters_replaced_between_steps():
    """AdamW's host step counters are written in place through views of their memory (the first
    three steps); counters replaced between steps (a resumed run's state, which Dynamo moves to the
    parameters' device when it traces the optimizer again) are the ones updated from then on, and
    the bias corrections read them: CPU's weights and counts."""
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    oc = torch.optim.AdamW(mc.parameters(), lr=1e-2)
    ot = torch.optim.AdamW(mt.parameters(), lr=1e-2)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    xt, yt = x.to("tpu"), y.to("tpu")

    def step(m, o, x, y):
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.step()

    cstep = torch.compile(step, backend="tpu")
    for i in range(7):
        if i == 3:
            for o in (oc, ot):
                for state in o.state.values():
                    state["step"] = torch.tensor(100.0)
        step(mc, oc, x, y)
        cstep(mt, ot, xt, yt)
    for a, b in zip(mc.parameters(), mt.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=RTOL, atol=ATOL)
        assert float(ot.state[b]["step"].cpu()) == float(oc.state[a]["step"]) == 104.0


def test_compiled_step_runs_as_one_program_per_step():
    # The forward, backward and optimizer graphs of a step are deferred and run together when the
    # next step's forward starts (or a host read needs them): one cached program per step.
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    oc = torch.optim.SGD(mc.parameters(), lr=0.1)
    ot = torch.optim.SGD(mt.parameters(), lr=0.1)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    xt, yt = x.to("tpu"), y.to("tpu")

    def step(m, o, x, y):
        o.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
        return loss

    cstep = torch.compile(step, backend="tpu")

    def rounds():  # 4 steps keeping their losses, then one read; the outputs kept alive are the same each round
        losses = []
        for _ in range(4):
            losses.append(cstep(mt, ot, xt, yt))
            lc = step(mc, oc, x, y)
        torch.testing.assert_close(losses[-1].detach().cpu(), lc.detach(), rtol=RTOL, atol=ATOL)

    for _ in range(2):  # warm-up: the first compile, then once more for the outputs a read keeps
        rounds()
    before = torch_tpu.cache_stats()
    rounds()
    after = torch_tpu.cache_stats()
    assert after["misses"] == before["misses"]
    assert after["hits"] - before["hits"] == 4
    for a, b in zip(mc.parameters(), mt.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=RTOL, atol=ATOL)


def test_reading_between_compiled_graphs():
    # A host read or an eager op on a deferred output runs the pending graphs first.
    mc = mlp()
    mt = torch.compile(copy.deepcopy(mc).to("tpu"), backend="tpu")
    x = torch.randn(5, 8)
    out_t = mt(x.to("tpu"))
    doubled = out_t * 2  # eager, on a value a compiled graph has not produced yet
    assert abs(out_t.sum().item() - mc(x).sum().item()) < 1e-4
    out_t.sum().backward()
    mc(x).sum().backward()
    torch.testing.assert_close(doubled.detach().cpu(), 2 * mc(x).detach(), rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=RTOL, atol=ATOL)


def test_dynamic_shapes_compile_once_per_size():
    f = torch.compile(lambda x: (x * 2).sum(0), backend="tpu", dynamic=False)
    def compiles():  # per-op programs and fused traces alike
        return torch_tpu.metrics()["compile_count"]

    before = compiles()
    for n in (4, 4, 6, 6, 4):
        x = torch.randn(n, 3)
        torch.testing.assert_close(f(x.to("tpu")).cpu(), (x * 2).sum(0))
    assert compiles() - before >= 2


def test_mark_dynamic():
    f = torch.compile(lambda x: (x.relu() + 1).sum(0), backend="tpu")
    for n in (5, 7, 9):
        x = torch.randn(n, 3)
        xt = x.to("tpu")
        torch._dynamo.mark_dynamic(xt, 0)
        torch.testing.assert_close(f(xt).cpu(), (x.relu() + 1).sum(0))


def test_training_with_dynamic_shapes_matches_cpu():
    """A smaller batch makes Dynamo retrace with a symbolic batch size (automatic dynamic shapes);
    AOTAutograd then saves that size for the backward, as a number the forward returns."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    mt = copy.deepcopy(m).to("tpu")
    f = torch.compile(mt, backend="tpu")
    for n in (8, 8, 12, 5):
        x = torch.randn(n, 8)
        lt = f(x.to("tpu")).pow(2).mean()
        lt.backward()
        loss = m(x).pow(2).mean()
        loss.backward()
        torch.testing.assert_close(lt.detach().cpu(), loss.detach(), rtol=RTOL, atol=ATOL)
        for a, b in zip(m.parameters(), mt.parameters()):
            torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=RTOL, atol=ATOL)


def test_compiled_step_moves_its_cpu_batch():
    """``x.to("tpu")`` inside the compiled function: the CPU batch is a graph input."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    mt = copy.deepcopy(m).to("tpu")
    opts = [torch.optim.SGD(net.parameters(), lr=0.1) for net in (m, mt)]
    x = torch.randn(5, 8)

    def step(net, opt, dev):
        opt.zero_grad()
        loss = net(x.to(dev)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        return loss

    compiled = torch.compile(step, backend="tpu")
    for _ in range(3):
        lt, loss = compiled(mt, opts[1], "tpu"), step(m, opts[0], "cpu")
        torch.testing.assert_close(lt.detach().cpu(), loss.detach(), rtol=RTOL, atol=ATOL)
    for a, b in zip(m.parameters(), mt.parameters()):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=RTOL, atol=ATOL)
    # used on tpu without the move, a CPU tensor is refused, as eagerly (torch 2.11's fake tensors
    # word it "Unhandled FakeTensor Device Propagation")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device|Device Propagation"):
        torch.compile(lambda a, b: a + b, backend="tpu")(torch.ones(3), torch.ones(3, device="tpu"))


def test_compile_modes_and_options():
    """torch.compile hands ``mode`` and ``options`` to the backend: every mode compiles the same
    program; inductor's options mean nothing here and raise rather than be ignored."""
    x = torch.randn(4, 3)
    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        f = torch.compile(lambda t: (t.sin() * 2).sum(0), backend="tpu", mode=mode)
        torch.testing.assert_close(f(x.to("tpu")).cpu(), (x.sin() * 2).sum(0), rtol=RTOL, atol=ATOL)
    with pytest.raises(RuntimeError, match="unrecognized mode='fastest'"):
        torch.compile(lambda t: t * 3, backend="tpu", mode="fastest")(x.to("tpu"))
    with pytest.raises(RuntimeError, match=r"takes no options \(got \['triton.cudagraphs'\]"):
        torch.compile(lambda t: t * 4, backend="tpu", options={"triton.cudagraphs": True})(x.to("tpu"))


def test_torch_cond_trains_and_takes_each_branch():
    """``torch.cond`` is one ``lax.cond``: the device picks the branch, in the forward and backward."""
    torch.manual_seed(0)
    m = nn.Linear(4, 4)
    mt = copy.deepcopy(m).to("tpu")

    def f(net, x):
        h = net(x)
        return torch.cond(h.sum() > 0, lambda h: (h.sin() * 2).sum(), lambda h: (h.cos() - 1).sum(), (h,))

    compiled = torch.compile(f, backend="tpu")
    for sign in (1.0, -1.0, 1.0):
        x = torch.randn(3, 4) * sign
        lt, loss = compiled(mt, x.to("tpu")), f(m, x)
        lt.backward()
        loss.backward()
        torch.testing.assert_close(lt.detach().cpu(), loss.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(mt.weight.grad.cpu(), m.weight.grad, rtol=RTOL, atol=ATOL)


def test_with_effects_linalg_in_graph():
    # linalg.inv/cholesky check their info with a side-effecting op: AOTAutograd wraps it in
    # with_effects(token, op, ...). The graph returns info, checked like a device-side assert.
    a = torch.randn(4, 4)
    a = a @ a.T + 4 * torch.eye(4)
    f = torch.compile(lambda x: torch.linalg.inv(x) + torch.linalg.cholesky(x), backend="tpu")
    want = torch.linalg.inv(a) + torch.linalg.cholesky(a)
    torch.testing.assert_close(f(a.to("tpu")).cpu(), want, rtol=1e-3, atol=1e-4)


def test_failed_factorization_in_graph_raises_cpus_error():
    f = torch.compile(lambda x: torch.linalg.inv(x), backend="tpu")
    with pytest.raises(torch.linalg.LinAlgError) as cpu_error:
        torch.linalg.inv(torch.zeros(3, 3))
    with pytest.raises(torch.linalg.LinAlgError) as tpu_error:
        f(torch.zeros(3, 3, device="tpu")).cpu()  # surfaces at the host read, as a device-side check
    assert str(cpu_error.value) in str(tpu_error.value)
    torch_tpu.sync()
    f(torch.eye(3, device="tpu")).cpu()  # the failure does not stick


def test_graph_only_lowerings_of_eager_kernels():
    # grid_sampler_2d (all three modes), bilinear's _trilinear, unfold and histc-like kernels are hand
    # kernels or decompositions in eager mode; a graph needs them as lowerings.
    torch.manual_seed(0)
    x, grid = torch.randn(2, 3, 5, 6), torch.rand(2, 4, 3, 2) * 2.4 - 1.2
    lin = nn.Bilinear(3, 4, 2)

    def f(x, grid, a, b):
        outs = [nn.functional.grid_sample(x, grid, mode=m, padding_mode=p, align_corners=c)
                for m in ("bilinear", "nearest", "bicubic") for p in ("zeros", "border", "reflection")
                for c in (False, True)]
        return (*outs, lin(a, b), x.unfold(3, 2, 2), torch.histogram(a, 4)[0], torch.linalg.pinv(x))

    a, b = torch.randn(5, 3), torch.randn(5, 4)
    want = f(x, grid, a, b)
    lin.to("tpu")
    got = torch.compile(f, backend="tpu")(x.to("tpu"), grid.to("tpu"), a.to("tpu"), b.to("tpu"))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.detach().cpu(), w.detach(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("per_element", [False, True])
def test_boolean_mask_put_in_graph(per_element):
    def f(x, mask, v):
        x = x.clone()
        x[mask] = v
        return x

    x, mask = torch.randn(5, 3), torch.tensor([True, False, True, True, False])
    v = torch.randn(3, 3) if per_element else torch.randn(3)
    got = torch.compile(f, backend="tpu")(x.to("tpu"), mask.to("tpu"), v.to("tpu"))
    torch.testing.assert_close(got.cpu(), f(x, mask, v))


def test_boolean_mask_put_in_graph_checks_the_row_count():
    # One row of values per true element: the graph cannot see the count, so it is checked like a
    # device-side assert and CPU's error surfaces at the next host read.
    def f(x, mask, v):
        x = x.clone()
        x[mask] = v
        return x

    x, v = torch.randn(5, 3), torch.randn(3, 3)
    mask = torch.tensor([True, False, True, False, False])  # 2 true elements, 3 rows
    with pytest.raises(RuntimeError) as cpu_error:
        f(x, mask, v)
    g = torch.compile(f, backend="tpu")
    with pytest.raises(RuntimeError) as tpu_error:
        g(x.to("tpu"), mask.to("tpu"), v.to("tpu")).cpu()
    assert str(cpu_error.value) in str(tpu_error.value)
    torch_tpu.sync()
    ok = torch.tensor([True, True, False, True, False])
    torch.testing.assert_close(g(x.to("tpu"), ok.to("tpu"), v.to("tpu")).cpu(), f(x, ok, v))


def test_compiles_with_debug_logging_on(caplog):
    # With debug logging (pytest's default capture, or TORCH_LOGS) AOTAutograd prints its fake
    # example inputs: a fake tpu tensor's repr must be torch's, not a read of device data.
    import logging

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.ones(3, device="tpu"))
    assert repr(fake).startswith("FakeTensor(")
    mc = mlp()
    mt = torch.compile(copy.deepcopy(mc).to("tpu"), backend="tpu")
    x = torch.randn(5, 8)
    torch_tpu.reset_metrics()
    with caplog.at_level(logging.DEBUG), torch.no_grad():
        torch.testing.assert_close(mt(x.to("tpu")).cpu(), mc(x), rtol=RTOL, atol=ATOL)
    assert "aten.addmm.default" not in torch_tpu.metrics()["op_counts"]  # the graph ran, not eager ops


_OPTIMIZER_STEP_SCRIPT = """
import sys
import torch
import torch_tpu
model = torch.nn.Linear(4, 2).to("tpu")
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
x = torch.randn(3, 4).to("tpu")

@torch.compile(backend="tpu")
def step():
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()

step()
step()
print(model.weight.sum().item(), "torch._inductor.cudagraph_trees" in sys.modules)
"""


def test_compiled_optimizer_step_does_not_import_inductor():
    """Dynamo's optimizer guards import Inductor's CUDA-graph trees (0.7 s of a first step) even for
    tensors that are not on CUDA; for tpu tensors the answer is given without it."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_CACHE_DIR": "off", "TORCH_TPU_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", _OPTIMIZER_STEP_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    value, imported = out.stdout.split()
    assert imported == "False", out.stdout
    float(value)


_GUARD_PROFILE_SCRIPT = """
import logging
import torch
import torch_tpu
from torch._dynamo import guards

calls = []
original = guards.profile_guard_manager
def counting(*args):
    calls.append(1)
    return original(*args)
guards.profile_guard_manager = counting

x = torch.ones(4, device="tpu")
quiet = torch.compile(lambda t: t * 2 + 1, backend="tpu")(x)
after_quiet = len(calls)
guards.guards_log.setLevel(logging.DEBUG)
logged = torch.compile(lambda t: t * 3 - 1, backend="tpu")(x)
print(after_quiet, len(calls), quiet.cpu().tolist() == [3.0] * 4, logged.cpu().tolist() == [2.0] * 4)
"""


def test_guard_latency_is_profiled_only_when_logged():
    """Dynamo times each new frame's guards after flushing the CPU caches, only for a debug log line
    and a compile metric: 15 ms per frame. With the tpu backend it runs when the guard log asks."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_CACHE_DIR": "off", "TORCH_TPU_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", _GUARD_PROFILE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "True", "True"], out.stdout


_EXPLAIN_SCRIPT = """
import torch
import torch_tpu

def run(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 8).to(device)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    explained = torch._dynamo.explain(step)()
    return explained.graph_count, explained.graph_break_count, [p.detach().cpu() for p in model.parameters()]

cpu, tpu = run("cpu"), run("tpu")
print(cpu[:2] == tpu[:2], all(torch.allclose(a, b, atol=1e-5) for a, b in zip(cpu[2], tpu[2])))
"""


def test_dynamo_explain_of_a_training_step_as_on_cpu():
    """``torch._dynamo.explain`` (and any backend other than ours) runs the eager code between
    graph breaks under Dynamo's frame hook, which tried to compile the jax functions our kernels call
    (a zeros program for the optimizer's state) and failed inside jax. Our frames are skipped as soon
    as Dynamo loads, whichever backend loads it: the same graphs and breaks as CPU, CPU's weights.
    A fresh process, so that Dynamo is loaded after torch_tpu, as in a user's script."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_CACHE_DIR": "off", "TORCH_TPU_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", _EXPLAIN_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "True"], out.stdout


def _adamw_steps(mode: str | None, steps: int = 6) -> tuple[list, list, list, list]:
    """A compiled AdamW training step on tpu beside the same step on CPU, with a new batch each step
    copied into one static input (as CUDA-graph code does) and the losses of every step kept."""
    from torch_tpu.runtime import cache

    cache.reset_stats()  # each call builds new graphs at the same lines: no recompile count across calls
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    mt = copy.deepcopy(m).to("tpu")
    opts = [torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1) for net in (m, mt)]
    static_x = torch.zeros(5, 8, device="tpu")

    def step(net, opt, x):
        opt.zero_grad(set_to_none=True)
        out = net(x)
        loss = out.pow(2).mean()
        loss.backward()
        opt.step()
        return loss, out

    compiled = torch.compile(step, backend="tpu", mode=mode)
    kept_tpu, kept_cpu = [], []
    for _ in range(steps):
        x = torch.randn(5, 8)
        static_x.copy_(x)
        kept_tpu.append(compiled(mt, opts[1], static_x))
        kept_cpu.append(step(m, opts[0], x))
    return kept_tpu, kept_cpu, list(mt.parameters()), list(m.parameters())


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
def test_reduce_overhead_training_matches_cpu_and_keeps_outputs(mode):
    """``mode="reduce-overhead"`` (torch hands it to the backend) replays the step's program: an
    AdamW step over refreshed inputs gives CPU's losses, outputs and weights at every step, and
    outputs kept from earlier steps still hold their own step's values after later steps ran,
    which CUDA graphs' overwritten static outputs would not."""
    from torch_tpu.runtime import cache

    kept_tpu, kept_cpu, pt, pc = _adamw_steps(mode)
    for (lt, ot), (lc, oc) in zip(kept_tpu, kept_cpu):  # read after all steps ran
        torch.testing.assert_close(lt.detach().cpu(), lc.detach(), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(ot.detach().cpu(), oc.detach(), rtol=RTOL, atol=ATOL)
    for b, a in zip(pt, pc):
        torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=RTOL, atol=ATOL)
    assert len({float(lt.detach()) for lt, _ in kept_tpu}) == len(kept_tpu)  # every step its own loss
    if torch_tpu.get_eager_mode() is not torch_tpu.EagerMode.DEBUG:  # debug mode runs each graph at once
        assert cache.cache_stats()["hits"] >= 3  # the repeated steps ran a compiled program again


def test_a_compiled_decoding_step_writes_its_cache_in_place():
    """In strict mode a no_grad graph that writes a buffer (a static KV cache's ``index_copy_``)
    runs its executable at once and donates the buffer: the new values are written over the old
    ones, in the same device memory, not into a copy of the cache per token; the results match
    CPU. A buffer something else still holds is not donated: the holder keeps its values."""

    def step(cache, pos, x):
        cache.index_copy_(0, pos, x)
        return (cache * 2).sum(0)

    compiled = torch.compile(step, backend="tpu")
    cache_cpu = torch.zeros(6, 4)
    cache = cache_cpu.to("tpu")
    with torch_tpu.set_eager_mode("strict"), torch.no_grad():
        for i in range(4):
            x, pos = torch.randn(1, 4), torch.tensor([i])
            before = cache.untyped_storage()._jx.unsafe_buffer_pointer()
            out = compiled(cache, pos.to("tpu") + 0, x.to("tpu"))  # a position the device computed
            # the upload's array may alias its host copy on XLA:CPU, memory XLA does not own: the
            # first step writes a new buffer, which the later steps then reuse
            assert i == 0 or cache.untyped_storage()._jx.unsafe_buffer_pointer() == before
            torch.testing.assert_close(out.cpu(), step(cache_cpu, pos, x))
            torch.testing.assert_close(cache.cpu(), cache_cpu)
        held = cache.untyped_storage()._jx
        kept = np.asarray(held).copy()
        compiled(cache, torch.tensor([5], device="tpu"), torch.ones(1, 4, device="tpu"))
        assert np.array_equal(np.asarray(held), kept)
        assert cache.untyped_storage()._jx.unsafe_buffer_pointer() != held.unsafe_buffer_pointer()
        torch.testing.assert_close(cache.cpu()[5], torch.ones(4))


def test_reduce_overhead_equals_default_mode():
    """The two modes run the same programs: identical losses and weights, bit for bit."""
    ro, _, pro, _ = _adamw_steps("reduce-overhead", steps=4)
    torch._dynamo.reset()
    de, _, pde, _ = _adamw_steps(None, steps=4)
    for (a, _), (b, _) in zip(ro, de):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())
    for a, b in zip(pro, pde):
        assert torch.equal(a.detach().cpu(), b.detach().cpu())


def test_a_trusted_graphs_inputs_are_read_in_cpp_and_a_view_falls_back(monkeypatch):
    """Once Dynamo's guards stand for a graph's inputs, a call reads its tpu inputs' arrays with the
    extension's key_of_tensors (one C++ call, not a Python loop over ~100 tensors of an optimizer
    step); 0-d CPU inputs still travel as host values. An input that is a view of a larger storage
    (same shape, dtype and strides, so the guards pass) keys differently there and is read by the
    Python loop. Every call gives CPU's result."""
    from torch_tpu.core import extension

    real = extension.key_of_tensors()
    if real is None:
        pytest.skip("the C++ extension is not loaded")
    calls = []

    def counted(xs, recording):
        found = real(xs, recording)
        calls.append(found is not None and all(len(k) == 2 for k in found[0]))
        return found

    monkeypatch.setattr(extension, "key_of_tensors", lambda: counted)

    def f(x, y, scale):
        return (x * y).sum(0) * scale, x + 1

    g = torch.compile(f, backend="tpu")
    big = torch.randn(9, 4)
    cases = [(torch.randn(8, 4), torch.randn(8, 4)) for _ in range(3)] + [(big, torch.randn(8, 4))]
    with torch_tpu.set_eager_mode("strict"):
        for i, (x, y) in enumerate(cases):
            scale = torch.tensor(0.5 + i)  # a 0-d CPU tensor: a host value of the program
            xt = x.to("tpu")
            if x is big:  # a view on tpu: rows 1-8 of a 9-row storage
                xt, x = xt[1:], x[1:]
            got = g(xt, y.to("tpu"), scale)
            for a, b in zip(got, f(x, y, scale)):
                torch.testing.assert_close(a.cpu(), b)
    # the first call learns the inputs; the next two are read in C++; the view's call is asked in C++
    # (its key names the view) and read by the Python loop
    assert calls == [True, True, False], calls
