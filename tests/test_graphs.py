"""Graph capture and replay (``torch.tpu.graph``, ``TPUGraph``, ``make_graphed_callables``),
against CPU eager: the same losses, weights and optimizer state step for step, RNG that advances
per replay, and the refusals CUDA makes (host reads, data-dependent shapes, capturable=False)."""

from __future__ import annotations

import copy
import re

import jax
import pytest
import torch
from torch import nn

import torch_tpu
from tests.conftest import assert_same

RTOL, ATOL = 1e-5, 1e-6


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def make_step(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


OPTIMIZERS = {
    "SGD": lambda p, dev: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "AdamW": lambda p, dev: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, capturable=dev == "tpu"),
    "Adam": lambda p, dev: torch.optim.Adam(p, lr=0.01, amsgrad=True, capturable=dev == "tpu"),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_replayed_training_matches_cpu(name):
    """Two eager warm-up steps, one captured step, then 20 replays on fresh batches copied into the
    static inputs: every loss, and at the end the weights and the optimizer state, equal CPU's."""
    data = batches(22)
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    oc, ot = OPTIMIZERS[name](mc.parameters(), "cpu"), OPTIMIZERS[name](mt.parameters(), "tpu")
    xc, yc = data[0][0].clone(), data[0][1].clone()
    xt, yt = xc.to("tpu"), yc.to("tpu")
    step_c, step_t = make_step(mc, oc, xc, yc), make_step(mt, ot, xt, yt)
    for x, y in data[:2]:  # warm-up (optimizer state made eagerly, as with CUDA graphs)
        for xs, ys, s in ((xc, yc, step_c), (xt, yt, step_t)):
            xs.copy_(x)
            ys.copy_(y)
            s()
    before = [p.detach().cpu() for p in mt.parameters()]
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = step_t()
    assert not torch.tpu.is_current_stream_capturing()
    for b, p in zip(before, mt.parameters()):  # the capture ran nothing
        assert_same(p.detach(), b, rtol=0, atol=0)
    losses_c, losses_t = [], []
    for x, y in data[2:]:
        xc.copy_(x)
        yc.copy_(y)
        losses_c.append(step_c().item())
        xt.copy_(x)
        yt.copy_(y)
        g.replay()
        losses_t.append(static_loss.item())
    torch.testing.assert_close(losses_t, losses_c, rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)
        assert_same(b.grad, a.grad, rtol=RTOL, atol=ATOL)  # the static gradients of the last replay
    for pc, pt in zip(mc.parameters(), mt.parameters()):
        for k, v in oc.state[pc].items():
            assert_same(ot.state[pt][k].reshape(v.shape), v, rtol=RTOL, atol=ATOL)


def test_dropout_advances_per_replay_and_repeats_under_a_seed():
    """Each replay draws new numbers, exactly those an eager call would draw at that point of the
    generator, so ``torch.manual_seed`` makes replays repeat."""
    x = torch.ones(64, 64, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = nn.functional.dropout(x, 0.5) * 3.0
    torch.manual_seed(7)
    masks = []
    for _ in range(3):
        g.replay()
        masks.append(out.cpu())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    for m in masks:
        assert set(m.unique().tolist()) == {0.0, 6.0}  # kept values scaled by 1 / (1 - p)
        assert abs((m == 0).float().mean().item() - 0.5) < 0.05
    torch.manual_seed(7)
    eager = [(nn.functional.dropout(x, 0.5) * 3.0).cpu() for _ in range(3)]
    for a, b in zip(masks, eager):
        assert torch.equal(a, b)


def test_dropout_training_repeats_under_a_seed():
    """A captured training step with dropout: replays from the same seed and weights give the same
    losses, and different seeds different ones."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 32), nn.Dropout(0.3), nn.Linear(32, 3)).to("tpu")
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, capturable=True)
    x, y = (t.to("tpu") for t in batches(1)[0])
    step = make_step(m, opt, x, y)
    step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        loss = step()
    # the graph is bound to these very tensors (load_state_dict would make new optimizer state)
    state = list(m.parameters()) + [t for s in opt.state.values() for t in s.values()]
    start = [t.detach().clone() for t in state]

    def run(seed: int) -> list[float]:
        with torch.no_grad():
            for t, v in zip(state, start):
                t.copy_(v)
        torch.manual_seed(seed)
        out = []
        for _ in range(4):
            g.replay()
            out.append(loss.item())
        return out

    a, b, c = run(3), run(3), run(4)
    assert a == b
    assert a != c


def scaled_run(m: nn.Module, dev: str, capture: bool) -> list[float]:
    """A GradScaler step with a fused AdamW (which takes the scale and found_inf on the device), an
    eager warm-up step, then five steps (replays when ``capture``), the third with an inf loss."""
    opt = torch.optim.AdamW(m.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler(dev, init_scale=1024.0, growth_interval=2)
    x, y = (t.to(dev) for t in batches(1)[0])
    factor = torch.ones((), device=dev)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(m(x), y) * factor
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    step()
    if capture:
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            step()
        step = g.replay
    scales = []
    for bad in (False, False, True, False, False):
        factor.fill_(float("inf") if bad else 1.0)
        step()
        scales.append(scaler.get_scale())
    return scales


def test_grad_scaler_step_matches_cpu():
    """The scale's growth and back-off, and the weights (the inf step skipped), equal CPU's."""
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    want = scaled_run(mc, "cpu", capture=False)
    assert want == [2048.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert scaled_run(mt, "tpu", capture=True) == want
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)


def _refusal(body, match: str, exc: type = RuntimeError) -> None:
    """``body`` raises inside a capture, naming what and where; the tensors are as before, and
    capturing works again afterwards."""
    x = torch.arange(6.0, device="tpu")
    g = torch.tpu.TPUGraph()
    with pytest.raises(exc, match=match):
        with torch.tpu.graph(g):
            x.mul_(2)
            body(x)
    assert not torch.tpu.is_current_stream_capturing()
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    with torch.tpu.graph(g):
        y = x * 2
    g.replay()
    assert y.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


HERE = re.escape(__file__.rsplit("/", 1)[-1])


def test_host_reads_are_refused():
    _refusal(lambda x: x.sum().item(), rf"aten\._local_scalar_dense.*at .*{HERE}:\d+.*cannot be captured")
    _refusal(lambda x: x.cpu(), rf"_to_copy to the host.*{HERE}:\d+")
    _refusal(lambda x: print(x), rf"(print|_to_copy).*{HERE}:\d+")
    _refusal(lambda x: torch.tpu.synchronize(), "synchronisation")


def test_data_dependent_shapes_are_refused():
    _refusal(lambda x: torch.nonzero(x), r"aten\.nonzero.*shape depends on the tensor's values")
    _refusal(lambda x: x[x > 2], r"shape depends on the tensor's values|cannot be captured")


def test_an_optimizer_without_capturable_is_refused():
    m = nn.Linear(3, 2).to("tpu")
    opt = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 3, device="tpu")).sum().backward()
    opt.step()
    g = torch.tpu.TPUGraph()
    with pytest.raises(RuntimeError, match=rf"Adam\.step\(\) with capturable=False, at .*{HERE}:\d+.*capturable=True"):
        with torch.tpu.graph(g):
            opt.step()


def test_an_explicit_generator_is_refused():
    gen = torch.Generator().manual_seed(0)
    x = torch.ones(4, device="tpu")
    with pytest.raises(NotImplementedError, match="explicit torch.Generator"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            torch.bernoulli(x * 0.5, generator=gen)


def test_static_inputs_and_outputs():
    """A static input is read at each replay (refreshed with copy_); a static output is the same
    tensor every replay, overwritten; tensors made before the capture and only read stay as they are."""
    w = torch.tensor([1.0, 2.0, 3.0], device="tpu")
    x = torch.zeros(3, device="tpu")
    acc = torch.zeros(3, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = x * w
        acc.add_(out)
    assert out.tolist() == [0.0, 0.0, 0.0]  # created in the region: zeros until the first replay
    for k in (1.0, 2.0):
        x.copy_(torch.full((3,), k))
        g.replay()
        assert out.tolist() == [k, 2 * k, 3 * k]
    assert acc.tolist() == [3.0, 6.0, 9.0]
    assert w.tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(RuntimeError, match="already holds a graph"):
        g.capture_begin()
    g.reset()
    with pytest.raises(RuntimeError, match="before a capture ended"):
        g.replay()


def test_an_empty_static_input_is_read_at_replay():
    """A tensor made with torch.empty before the capture and filled only afterwards."""
    buf = torch.empty(3, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = buf + 1
    buf.copy_(torch.tensor([1.0, 2.0, 3.0]))
    g.replay()
    assert out.tolist() == [2.0, 3.0, 4.0]


def test_a_static_input_that_changes_shape_is_named_at_replay():
    x = torch.zeros(3, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        y = x + 1
    x.resize_(5)
    with pytest.raises(RuntimeError, match=r"static input changed from float32\[3\] to float32\[5\]"):
        g.replay()
    del y


def test_memory_stays_flat_over_replays():
    m = model().to("tpu")
    opt = torch.optim.AdamW(m.parameters(), capturable=True)
    x, y = (t.to("tpu") for t in batches(1)[0])
    step = make_step(m, opt, x, y)
    step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        loss = step()
    for _ in range(5):
        g.replay()
    loss.item()
    before = len(jax.live_arrays())
    for _ in range(300):
        g.replay()
    loss.item()
    assert len(jax.live_arrays()) == before


def test_graph_pool_handle_and_debug_dump(tmp_path):
    pool = torch.tpu.graph_pool_handle()
    g = torch.tpu.TPUGraph()
    x = torch.ones(2, device="tpu")
    with torch.tpu.graph(g, pool=pool):
        y = x + 1
    assert g.pool() is pool
    g.replay()
    assert y.tolist() == [2.0, 2.0]
    with torch_tpu.profile(None) as prof:
        g.replay()
    assert "tpu graph (" in prof.summary()
    g.debug_dump(str(tmp_path / "graph.txt"))
    assert "HloModule" in (tmp_path / "graph.txt").read_text()


def test_make_graphed_callables_trains_like_cpu():
    """A module and a function made graphed train like their CPU eager originals."""
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    data = batches(6)
    xt = data[0][0].to("tpu").requires_grad_(False)
    graphed = torch.tpu.make_graphed_callables(mt, (xt,))

    def scale(a):
        return a * 2.0 + 1.0

    graphed_scale = torch.tpu.make_graphed_callables(scale, (torch.ones(8, 3, device="tpu", requires_grad=True),))
    oc = torch.optim.SGD(mc.parameters(), lr=0.1)
    ot = torch.optim.SGD(mt.parameters(), lr=0.1)
    for x, y in data:
        oc.zero_grad()
        lc = nn.functional.mse_loss(scale(mc(x)), y)
        lc.backward()
        oc.step()
        ot.zero_grad()
        lt = nn.functional.mse_loss(graphed_scale(graphed(x.to("tpu"))), y.to("tpu"))
        lt.backward()
        ot.step()
        torch.testing.assert_close(lt.item(), lc.item(), rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)


def test_a_compiled_model_inside_a_captured_step_matches_cpu():
    """torch.compile graphs inside the region record into the same trace (one executable)."""
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    compiled = torch.compile(mt, backend="tpu")
    oc = torch.optim.AdamW(mc.parameters(), lr=0.01)
    ot = torch.optim.AdamW(mt.parameters(), lr=0.01, capturable=True)
    x, y = batches(1)[0]
    step_c = make_step(mc, oc, x, y)
    step_t = make_step(compiled, ot, x.to("tpu"), y.to("tpu"))
    for _ in range(2):
        step_c()
        step_t()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = step_t()
    for _ in range(5):
        g.replay()
        torch.testing.assert_close(static_loss.item(), step_c().item(), rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)


def test_a_compiled_model_runs_eagerly_after_a_capture_of_it():
    """The compiled model called outside the graph after a capture used it (evaluation between
    replays) gives CPU's outputs: the capture's own check of every input leaves what later calls
    trust in place (they raised StopIteration)."""
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    compiled = torch.compile(mt, backend="tpu")
    x = batches(1)[0][0]
    xt = x.to("tpu")
    with torch.no_grad():
        for _ in range(3):
            compiled(xt)
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            static_out = compiled(xt)
        g.replay()
        after = compiled(xt)
        want = mc(x)
    assert_same(static_out, want, rtol=RTOL, atol=ATOL)
    assert_same(after, want, rtol=RTOL, atol=ATOL)


def test_a_tensor_learning_rate_follows_its_schedule_across_replays():
    """Python numbers are frozen at capture; a tensor lr is a static input, so a scheduler that
    updates it in place (between replays) changes the replayed steps, as on CPU."""
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    oc = torch.optim.AdamW(mc.parameters(), lr=torch.tensor(0.01), foreach=False)
    ot = torch.optim.AdamW(mt.parameters(), lr=torch.tensor(0.01, device="tpu"), capturable=True)
    sc = torch.optim.lr_scheduler.StepLR(oc, step_size=2, gamma=0.5)
    st = torch.optim.lr_scheduler.StepLR(ot, step_size=2, gamma=0.5)
    x, y = batches(1)[0]
    step_c, step_t = make_step(mc, oc, x, y), make_step(mt, ot, x.to("tpu"), y.to("tpu"))
    step_c()
    step_t()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = step_t()
    for _ in range(6):
        g.replay()
        torch.testing.assert_close(static_loss.item(), step_c().item(), rtol=RTOL, atol=ATOL)
        sc.step()
        st.step()
    assert ot.param_groups[0]["lr"].item() == pytest.approx(oc.param_groups[0]["lr"].item())
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)


def test_a_capture_that_repeats_an_earlier_one_takes_its_executable():
    """Two captures of the same step on other tensors of the same shapes (a training loop's second
    bucket whose step differs only in values) compile once; each graph updates its own tensors, as
    CPU does. A different frozen number is another program."""
    data = [(x[:5], y[:5]) for x, y in batches(4)]  # a batch size no other test captures
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    oc, ot = OPTIMIZERS["SGD"](mc.parameters(), "cpu"), OPTIMIZERS["SGD"](mt.parameters(), "tpu")
    step_c = make_step(mc, oc, *data[0])
    step_c()
    xt, yt = (t.to("tpu") for t in data[0])
    make_step(mt, ot, xt, yt)()
    graphs = []
    count = torch_tpu.metrics()["compile_count"]
    for x, y in data[1:3]:  # two captures on fresh static inputs
        xs, ys = x.to("tpu"), y.to("tpu")
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            loss = make_step(mt, ot, xs, ys)()
        graphs.append((g, loss))
    assert torch_tpu.metrics()["compile_count"] == count + 1
    for (g, loss), (x, y) in zip(graphs, data[1:3]):
        g.replay()
        torch.testing.assert_close(loss.item(), make_step(mc, oc, x, y)().item(), rtol=RTOL, atol=ATOL)
    for a, b in zip(mc.parameters(), mt.parameters()):
        assert_same(b.detach(), a.detach(), rtol=RTOL, atol=ATOL)
    ot.param_groups[0]["momentum"] = 0.5  # frozen into the graph: another program
    oc.param_groups[0]["momentum"] = 0.5
    g = torch.tpu.TPUGraph()
    xs, ys = (t.to("tpu") for t in data[3])
    with torch.tpu.graph(g):
        loss = make_step(mt, ot, xs, ys)()
    assert torch_tpu.metrics()["compile_count"] == count + 2
    g.replay()
    torch.testing.assert_close(loss.item(), make_step(mc, oc, *data[3])().item(), rtol=RTOL, atol=ATOL)


_ACCELERATOR_GRAPH = pytest.mark.skipif(
    not hasattr(torch.accelerator, "Graph") or not torch_tpu.core.extension.available(),
    reason="torch.accelerator.Graph (torch >= 2.13) and torch_tpu's C++ extension, which registers it for tpu")


@_ACCELERATOR_GRAPH
def test_accelerator_graph_is_the_tpu_graph():
    """Device-generic code: ``with torch.accelerator.Graph():`` captures a training step on tpu,
    and each ``replay()`` after fresh inputs are copied in gives CPU eager's losses and weights;
    keep_graph with an explicit instantiate, a shared pool token, and CUDA's host-read refusal."""
    data = batches(12, seed=4)
    mc = model()
    mt = copy.deepcopy(mc).to("tpu")
    oc, ot = OPTIMIZERS["AdamW"](mc.parameters(), "cpu"), OPTIMIZERS["AdamW"](mt.parameters(), "tpu")
    xc, yc = data[0][0].clone(), data[0][1].clone()
    xt, yt = xc.to("tpu"), yc.to("tpu")
    step_c, step_t = make_step(mc, oc, xc, yc), make_step(mt, ot, xt, yt)
    for x, y in data[:2]:
        for xs, ys, s in ((xc, yc, step_c), (xt, yt, step_t)):
            xs.copy_(x)
            ys.copy_(y)
            s()
    g = torch.accelerator.Graph()
    with g:
        loss_t = step_t()
    for x, y in data[2:]:
        xc.copy_(x)
        yc.copy_(y)
        xt.copy_(x)
        yt.copy_(y)
        g.replay()
        assert_same(loss_t, step_c().detach(), rtol=RTOL, atol=ATOL)
    for pc, pt in zip(mc.parameters(), mt.parameters()):
        assert_same(pt.detach(), pc.detach(), rtol=RTOL, atol=ATOL)

    kept = torch.accelerator.Graph(keep_graph=True, pool=g.pool())
    kept.capture_begin()
    tripled = xt * 3
    kept.capture_end()
    kept.instantiate()
    xt.fill_(2.0)
    kept.replay()
    assert_same(tripled, torch.full((8, 6), 6.0))
    kept.reset()
    with pytest.raises(RuntimeError, match=r"_local_scalar_dense.*cannot be captured"):
        with torch.accelerator.Graph():
            (xt * 2).sum().item()


@pytest.mark.skipif(not hasattr(torch.accelerator, "empty_host_cache") or not torch_tpu.core.extension.available(),
                    reason="torch.accelerator.empty_host_cache (torch >= 2.13) and torch_tpu's C++ extension")
def test_empty_host_cache_once_the_device_is_used():
    # torch asks the accelerator's host allocator, which the extension registers: without one,
    # torch 2.13 dereferenced a null pointer here
    x = torch.ones(3, device="tpu") * 2
    torch.accelerator.empty_host_cache()
    assert_same(x, torch.full((3,), 2.0))


@pytest.mark.parametrize("make", ["clone", "full"])
def test_a_shared_array_is_never_donated_from_under_its_other_tensors(make):
    """A clone, or a small ``torch.full``, shares its source's (or an equal constant's) device
    array. A captured graph that writes one of the sharers in place donates that array's buffer
    at replay only when nothing else holds it: the other tensors keep their values, as on CPU."""
    results = {}
    for dev in ("cpu", "tpu"):
        if make == "clone":
            a = torch.arange(4.0, device=dev)
            b = a.clone()
        else:
            a = torch.full((4,), 3.0, device=dev)
            b = torch.full((4,), 3.0, device=dev)
        x = torch.ones(4, device=dev)
        if dev == "tpu":
            g = torch.tpu.TPUGraph()
            with torch.tpu.graph(g):
                a.add_(x)
            for _ in range(3):
                g.replay()
        else:
            for _ in range(3):
                a.add_(x)
        c = torch.full((4,), 3.0, device=dev)  # the constant kept for full() is intact too
        results[dev] = [t.cpu() for t in (a, b, c)]
    for cpu, tpu in zip(results["cpu"], results["tpu"]):
        assert torch.equal(cpu, tpu)
