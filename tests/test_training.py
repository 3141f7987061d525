"""Autograd and torch.optim on tpu, unchanged user code, compared step by step with CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import assert_same
from torch import nn

import torch_tpu

RTOL, ATOL = 1e-4, 1e-5


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def data(n=12):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def test_autograd_grad_second_order():
    c = torch.randn(5, dtype=torch.float64, requires_grad=True)
    t = c.detach().to("tpu").requires_grad_()
    outs = []
    for x in (c, t):
        y = (x.sin() * x ** 3).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x)
        outs.append((g.detach(), gg))
    assert_same(outs[1][0], outs[0][0])
    assert_same(outs[1][1], outs[0][1])


def test_no_grad_detach_and_accumulation():
    c = torch.randn(4, requires_grad=True)
    t = c.detach().to("tpu").requires_grad_()
    for x in (c, t):
        with torch.no_grad():
            y = x * 2
        assert not y.requires_grad
        assert not x.detach().requires_grad
        for _ in range(3):  # gradients accumulate across backward calls
            (x * x).sum().backward()
    assert_same(t.grad, c.grad)


def test_clip_grad_norm():
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    x, y = data()
    norms = []
    for m, dev in ((mc, "cpu"), (mt, "tpu")):
        nn.functional.mse_loss(m(x.to(dev)), y.to(dev)).mul(100).backward()
        norms.append(nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    assert_same(norms[1], norms[0], rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.grad, a.grad, rtol=RTOL, atol=ATOL)


OPTIMIZERS = {
    "SGD": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam": dict(lr=0.01, amsgrad=True),
    "AdamW": dict(lr=0.01, weight_decay=0.1),
    "Adagrad": dict(lr=0.1),
    "Adadelta": dict(lr=1.0),
    "Adamax": dict(lr=0.01),
    "ASGD": dict(lr=0.01),
    "NAdam": dict(lr=0.01),
    "RAdam": dict(lr=0.01),
    "RMSprop": dict(lr=0.01, momentum=0.5, centered=True),
    "Rprop": dict(lr=0.01),
    "Adafactor": dict(lr=0.01),
}


def run_steps(model, opt, dev, steps=3, closure=False):
    x, y = data()
    x, y = x.to(dev), y.to(dev)
    losses = []
    for _ in range(steps):
        def step_closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss
        if closure:
            loss = opt.step(step_closure)
        else:
            loss = step_closure()
            opt.step()
        losses.append(loss.detach().to("cpu"))
    return torch.stack(losses)


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_match_cpu(name, foreach):
    cls = getattr(torch.optim, name)
    kw = dict(OPTIMIZERS[name])
    if "foreach" in cls.__init__.__code__.co_varnames:
        kw["foreach"] = foreach
    elif foreach:
        pytest.skip(f"{name} has no foreach path")
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    lc = run_steps(mc, cls(mc.parameters(), **kw), "cpu")
    lt = run_steps(mt, cls(mt.parameters(), **kw), "tpu")
    torch.testing.assert_close(lt, lc, rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)


FUSED = {
    "Adam": dict(lr=0.01, amsgrad=True, weight_decay=0.05),
    "Adam-maximize": dict(lr=0.01, maximize=True),
    "AdamW": dict(lr=0.01, weight_decay=0.1),
    "AdamW-tensor-lr": dict(lr=torch.tensor(0.01), weight_decay=0.1),
    "SGD": dict(lr=0.1),
    "SGD-nesterov": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "SGD-dampening": dict(lr=0.1, momentum=0.9, dampening=0.1, maximize=True),
}


@pytest.mark.parametrize("case", sorted(FUSED))
def test_fused_optimizers_match_cpu(case):
    """``fused=True`` (PyTorch's single-kernel optimizers, which update lists of tensors in place)
    runs as one program on the device, with CPU's fused arithmetic."""
    cls = getattr(torch.optim, case.split("-")[0])
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    lc = run_steps(mc, cls(mc.parameters(), fused=True, **FUSED[case]), "cpu")
    lt = run_steps(mt, cls(mt.parameters(), fused=True, **FUSED[case]), "tpu")
    torch.testing.assert_close(lt, lc, rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)
    assert not any("_fused_" in op for op in torch_tpu.metrics()["fallback_counts"])


def test_cpu_fallback_writes_back_lists():
    """An op without a lowering that updates lists of tensors in place and returns nothing
    (``_fused_adagrad_``, from ``Adagrad(fused=True)``) runs on CPU, counted, and every list comes
    back: the parameters used to stay unchanged."""
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    before = torch_tpu.metrics()["fallback_counts"].get("aten._fused_adagrad_.default", 0)
    lc = run_steps(mc, torch.optim.Adagrad(mc.parameters(), lr=0.1, fused=True), "cpu")
    lt = run_steps(mt, torch.optim.Adagrad(mt.parameters(), lr=0.1, fused=True), "tpu")
    torch.testing.assert_close(lt, lc, rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)
    assert torch_tpu.metrics()["fallback_counts"]["aten._fused_adagrad_.default"] > before


def scaled_steps(model, opt, dev, inf_steps):
    """Steps with a ``GradScaler`` (the loss made inf where ``inf_steps`` says); the scale after each."""
    x, y = data()
    scaler = torch.amp.GradScaler(dev, init_scale=1024.0, growth_interval=2)
    scales = []
    for bad in inf_steps:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(dev)), y.to(dev)) * (float("inf") if bad else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize("name", ["AdamW", "SGD"])
def test_grad_scaler_with_a_fused_optimizer_matches_cpu(name):
    """A fused optimizer takes the scaler's ``grad_scale`` and ``found_inf``: it unscales the
    gradients itself and skips the step after an inf."""
    cls = getattr(torch.optim, name)
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    kw = {"momentum": 0.9} if name == "SGD" else {}
    runs = [scaled_steps(m, cls(m.parameters(), lr=0.01, fused=True, **kw), dev, (False, True, False, False))
            for m, dev in ((mc, "cpu"), (mt, "tpu"))]
    assert runs[0] == runs[1] == [1024.0, 512.0, 512.0, 1024.0]
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)
        assert_same(b.grad, a.grad, rtol=RTOL, atol=ATOL)  # unscaled by the optimizer


def test_grad_scaler_ops_match_cpu():
    """The two in-place ops of ``torch.amp.GradScaler``, eagerly and in a compiled graph."""
    grads = [torch.randn(3), torch.tensor([1.0, float("inf")]), torch.randn(2, 2).half(), torch.randn(4).bfloat16()]

    def unscale(gs, found, inv):
        torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)
        return gs, found

    def update(scale, tracker, found):
        return torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2), tracker

    for run in (lambda f: f, lambda f: torch.compile(f, backend="tpu")):
        for subset in (grads, grads[:1] + grads[2:]):  # with and without an inf
            want = unscale([g.clone() for g in subset], torch.zeros(()), torch.tensor(0.25))
            got = run(unscale)([g.to("tpu") for g in subset], torch.zeros((), device="tpu"),
                               torch.tensor(0.25, device="tpu"))
            for a, b in zip(want[0] + [want[1]], got[0] + [got[1]]):
                assert_same(b, a, rtol=0, atol=0)
        scale, tracker = torch.tensor(1024.0), torch.tensor(0, dtype=torch.int32)
        scale_t, tracker_t = scale.to("tpu"), tracker.to("tpu")
        for found in (0.0, 0.0, 1.0, 0.0, 0.0, 0.0):  # grows every 2 good steps, backs off on inf
            update(scale, tracker, torch.tensor(found))
            run(update)(scale_t, tracker_t, torch.tensor(found, device="tpu"))
            assert (scale_t.item(), tracker_t.item()) == (scale.item(), tracker.item())
    with pytest.raises(RuntimeError, match="found_inf must be a float tensor"):
        torch._amp_foreach_non_finite_check_and_unscale_([torch.ones(2, device="tpu")],
                                                         torch.zeros((), device="tpu", dtype=torch.float64),
                                                         torch.ones((), device="tpu"))


def test_grad_scaler_training_matches_cpu():
    """A loop with ``GradScaler``: scaled backward, a step skipped after an inf, the scale's updates."""
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    runs = [scaled_steps(m, torch.optim.SGD(m.parameters(), lr=0.05), dev, (False, False, True, False, False))
            for m, dev in ((mc, "cpu"), (mt, "tpu"))]
    assert runs[0] == runs[1] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)


def test_lbfgs_with_closure():
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    lc = run_steps(mc, torch.optim.LBFGS(mc.parameters(), lr=0.5, max_iter=4), "cpu", closure=True)
    lt = run_steps(mt, torch.optim.LBFGS(mt.parameters(), lr=0.5, max_iter=4), "tpu", closure=True)
    torch.testing.assert_close(lt, lc, rtol=1e-3, atol=1e-4)


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.5),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_lr_schedulers(name):
    results = []
    for dev in ("cpu", "tpu"):
        m = mlp().to(dev)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        sched = SCHEDULERS[name](opt)
        x, y = (v.to(dev) for v in data())
        lrs = []
        for _ in range(4):
            opt.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            opt.step()
            sched.step(loss) if name == "ReduceLROnPlateau" else sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        results.append((lrs, [p.detach().cpu() for p in m.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def test_autocast_bf16_matches_cpu_autocast():
    mc = mlp()
    mt = copy.deepcopy(mc).to("tpu")
    x, _ = data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yc = mc(x)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        yt = mt(x.to("tpu"))
    assert yt.dtype == yc.dtype == torch.bfloat16
    torch.testing.assert_close(yt.float().cpu(), yc.float(), rtol=2e-2, atol=2e-2)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        assert mt(x.to("tpu")).float().softmax(-1).dtype == torch.float32


def test_module_to_keeps_parameter_identity_and_ties():
    m = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    m[1].weight = m[0].weight  # tied, as language models tie input and output embeddings
    p = m[0].weight
    opt = torch.optim.SGD(m.parameters(), lr=0.1)  # made before the move, as users do
    m.to("tpu")
    assert m[0].weight is p and m[1].weight is p and p.device.type == "tpu"
    ref = copy.deepcopy(m).to("cpu")
    ids = torch.tensor([1, 2, 3])
    m(ids.to("tpu")).square().sum().backward()
    opt.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(ids).square().sum().backward()
    ref_opt.step()
    assert_same(p.detach(), ref[0].weight.detach(), rtol=RTOL, atol=ATOL)


def test_foreach_ops_are_one_program_per_list():
    # The optimizers' multi-tensor path: each _foreach_* call is one program over the whole list
    # (not one op per tensor), with CPU's results for every overload kind.
    torch.manual_seed(0)
    cpu = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2)]
    other = [torch.rand(t.shape) + 0.5 for t in cpu]
    dev = [t.to("tpu") for t in cpu]
    dev_other = [t.to("tpu") for t in other]
    cases = [
        lambda xs, ys: torch._foreach_mul_(xs, 0.5),
        lambda xs, ys: torch._foreach_add_(xs, ys, alpha=2.0),
        lambda xs, ys: torch._foreach_div_(xs, [1.5, 2.5, 3.5]),
        lambda xs, ys: torch._foreach_addcdiv_(xs, ys, ys, value=-0.1),
        lambda xs, ys: torch._foreach_addcmul_(xs, ys, ys, [0.1, 0.2, 0.3]),
        lambda xs, ys: torch._foreach_lerp_(xs, ys, 0.25),
        lambda xs, ys: torch._foreach_sqrt_(ys),
        lambda xs, ys: torch._foreach_maximum_(xs, ys),
    ]
    for i, case in enumerate(cases):
        torch_tpu.reset_metrics()
        case(dev, dev_other)
        case(cpu, other)
        counts = torch_tpu.metrics()["op_counts"]
        assert sum(counts.values()) == 1, (i, dict(counts))
        for c, t in zip(cpu + other, dev + dev_other):
            torch.testing.assert_close(t.cpu(), c, rtol=1e-5, atol=1e-6, msg=f"case {i}")
    outs = torch._foreach_exp(dev)
    for c, t in zip(torch._foreach_exp(cpu), outs):
        torch.testing.assert_close(t.cpu(), c, rtol=1e-5, atol=1e-6)
    assert torch._foreach_norm(dev)[1].item() == pytest.approx(torch._foreach_norm(cpu)[1].item(), rel=1e-5)


def test_a_foreach_list_is_keyed_in_cpp_as_in_python(monkeypatch):
    """The C++ extension keys a foreach op's list of tpu tensors (csrc/keys.cpp, op_kernel._key_of's
    list case): the same key and arrays as the Python loop for the lists it takes (views included),
    and the Python loop's answer for those it leaves to it (a CPU tensor, a dtype view, a value
    still pending outside a recording)."""
    from torch_tpu.dispatch import op_kernel
    from torch_tpu.runtime import fused

    if op_kernel._KEY_OF_TENSORS is None:
        pytest.skip("the C++ extension is not loaded")
    cpp = op_kernel._KEY_OF_TENSORS

    def keys(xs, with_cpp):
        monkeypatch.setattr(op_kernel, "_KEY_OF_TENSORS", cpp if with_cpp else None)
        dyn: list = []
        key = op_kernel._key_of(xs, 0, dyn)
        return key, dyn

    def same(xs, taken):
        assert (cpp(xs, True) is not None) == taken
        (k1, d1), (k2, d2) = keys(xs, True), keys(xs, False)
        assert k1 == k2 and hash(k1) == hash(k2)
        assert len(d1) == len(d2) and all(a is b for a, b in zip(d1, d2))

    base = [torch.randn(3, 4), torch.randn(5), torch.randn(())]
    dev = [t.to("tpu") for t in base]
    param = nn.Parameter(torch.randn(2, 3).to("tpu"))
    same(dev + [param], True)
    same(dev + [dev[0][1:]], True)  # a view at an offset
    same(dev + [dev[0].t()], True)  # not contiguous
    same(dev + [dev[0].view(12)], True)  # another shape over the whole storage
    same(dev + [base[0]], False)  # a CPU tensor
    same(dev + [dev[0].view(torch.int32)], False)  # not its storage's dtype
    mode = torch_tpu.get_eager_mode()
    torch_tpu.set_eager_mode(torch_tpu.EagerMode.FUSED)
    try:
        pending = [t * 2 for t in dev]  # recorded: their storages hold placeholders
        assert all(type(t.untyped_storage()._jx) is fused.Lazy for t in pending)
        same(pending + dev, True)
        assert cpp(pending, False) is None  # pending, and nothing records: the Python path runs it
        torch_tpu.sync()  # computed: the C++ key drops each placeholder for its array, as Python does
    finally:
        torch_tpu.set_eager_mode(mode)
    key, dyn = keys(pending, True)
    assert all(type(t.untyped_storage()._jx) is not fused.Lazy for t in pending)
    assert all(type(a) is not fused.Lazy for a in dyn)
    assert key == tuple((tuple(t.shape), t.dtype) for t in pending)


def test_module_to_while_a_cpu_graph_holds_the_weights():
    """A CPU forward whose backward has not run saves the weights in its graph; moving the module
    to tpu then raised "Couldn't swap Conv2d.weight" (a move to CUDA works). The same Parameters
    move, the new forward and backward give CPU's gradients, and a backward through the old graph
    raises instead of accumulating into a tensor the module no longer holds."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4 * 4 * 4, 2))
    ref = copy.deepcopy(m)
    x = torch.randn(2, 3, 6, 6)
    stale = m(x)  # kept alive: its graph holds the conv and norm weights
    params = list(m.parameters())
    m.to("tpu")
    assert all(p is q and p.device.type == "tpu" for p, q in zip(m.parameters(), params))
    m(x.to("tpu")).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert_same(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    # torch's own words for a weight only its gradient node held (the Linear), ours for the rest
    with pytest.raises(RuntimeError, match="poisoned by swap_tensors|while an autograd graph built before the move"):
        stale.sum().backward()
    stale = nn.Conv2d(3, 4, 3)
    out = stale(x)
    stale.to("tpu")
    with pytest.raises(RuntimeError, match="while an autograd graph built before the move still held it"):
        out.sum().backward()
