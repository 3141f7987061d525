"""Single-process SPMD (torch_tpu.distributed): sharded tensors give the unsharded results, and the
arrays behind the results are really spread over the devices.

jax fixes its device count at import, and the pytest process has one device. So the multi-device
checks run in one subprocess with 8 virtual CPU devices (``--xla_force_host_platform_device_count``),
which runs this file as a script; each ``test_*`` below asserts that one of its checks passed.
Argument checks that need no second device run here directly.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import traceback
import warnings

import pytest
import torch
from torch import nn

import torch_tpu
import torch_tpu.distributed as td

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARK = "SPMD-RESULTS:"
N_DEVICES = 8


# ------------------------------------------------------------------ checks run in the subprocess
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _sgd_step(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward, backward and SGD step; returns (loss, hidden activations)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    hidden = net[1](net[0](x))
    loss = nn.functional.mse_loss(net[2](hidden), y)
    loss.backward()
    opt.step()
    return loss, hidden


def _spans_all(t: torch.Tensor) -> bool:
    return len(td.sharding_of(t).device_set) == N_DEVICES


def _is_split(t: torch.Tensor, dim: int, parts: int) -> bool:
    """The array behind ``t`` is cut into ``parts`` pieces along ``dim`` (not replicated)."""
    s = td.sharding_of(t)
    return s.shard_shape(tuple(t.shape))[dim] == t.shape[dim] // parts and not s.is_fully_replicated


def _data_parallel(tag: str) -> None:
    """Batch sharded over ("data",), parameters replicated: one training step equals the unsharded
    step (on tpu, and on CPU), activations stay split by batch, gradients come back replicated."""
    mesh = td.mesh((N_DEVICES,), ("data",))
    torch.manual_seed(1)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    ref = _mlp()
    ref_loss, _ = _sgd_step(ref, x, y)

    net = td.replicate_module(copy.deepcopy(_mlp()).to("tpu"), mesh)
    xs = td.shard(x.to("tpu"), mesh, ("data", None))
    ys = td.shard(y.to("tpu"), mesh, ("data",))
    loss, hidden = _sgd_step(net, xs, ys)
    assert _is_split(hidden, 0, N_DEVICES), td.sharding_of(hidden)
    for p in net.parameters():
        assert _spans_all(p.grad) and td.sharding_of(p.grad).is_fully_replicated, td.sharding_of(p.grad)
        assert _spans_all(p), td.sharding_of(p)
    torch.testing.assert_close(loss.cpu(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-5)

    if tag == "strict":  # the same step on unsharded tpu tensors
        plain = _mlp().to("tpu")
        plain_loss, _ = _sgd_step(plain, x.to("tpu"), y.to("tpu"))
        torch.testing.assert_close(loss.cpu(), plain_loss.cpu(), rtol=1e-5, atol=1e-5)
        for p, q in zip(net.parameters(), plain.parameters()):
            torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=1e-5, atol=1e-5)


def _tensor_parallel(tag: str) -> None:
    """A weight split over ("model",) by output features: the product equals the unsharded one and
    is itself split by output feature."""
    mesh = td.mesh(N_DEVICES, "model")
    torch.manual_seed(2)
    x, w = torch.randn(4, 16), torch.randn(32, 16)
    ws = td.shard(w.to("tpu"), mesh, ("model", None))
    assert td.sharding_of(ws).shard_shape((32, 16)) == (4, 16)
    out = nn.functional.linear(x.to("tpu"), ws)
    assert _is_split(out, 1, N_DEVICES), td.sharding_of(out)
    torch.testing.assert_close(out.cpu(), x @ w.T, rtol=1e-5, atol=1e-5)
    # split along the contracted dim too: XLA adds the reduction
    ks = td.shard(x.to("tpu"), mesh, (None, "model"))
    wk = td.shard(w.T.contiguous().to("tpu"), mesh, ("model", None))
    torch.testing.assert_close((ks @ wk).cpu(), x @ w.T, rtol=1e-5, atol=1e-5)


def check_strict_data_parallel() -> None:
    _data_parallel("strict")


def check_strict_tensor_parallel() -> None:
    _tensor_parallel("strict")


def check_fused_data_parallel() -> None:
    with torch_tpu.set_eager_mode("fused"):
        _data_parallel("fused")


def check_fused_tensor_parallel() -> None:
    with torch_tpu.set_eager_mode("fused"):
        _tensor_parallel("fused")


def check_fused_same_trace_sharded_and_not() -> None:
    """The same fused trace run once on unsharded and once on sharded inputs."""
    mesh = td.mesh(N_DEVICES, "data")
    x = torch.randn(24, 8)
    with torch_tpu.set_eager_mode("fused"):
        plain = (x.to("tpu") * 3).tanh().sum()
        assert plain.item() == pytest.approx((x * 3).tanh().sum().item(), rel=1e-5)
        sharded = (td.shard(x.to("tpu"), mesh, ("data",)) * 3).tanh().sum()
        assert sharded.item() == pytest.approx(plain.item(), rel=1e-5)


def check_compile() -> None:
    """torch.compile(backend="tpu") on a sharded batch: forward and gradients equal the unsharded
    compiled run; the output stays split by batch."""
    mesh = td.mesh((N_DEVICES,), ("data",))
    torch.manual_seed(3)
    x = torch.randn(32, 16)
    plain = torch.compile(_mlp().to("tpu"), backend="tpu")
    base = _mlp().to("tpu")
    sharded = torch.compile(td.replicate_module(base, mesh), backend="tpu")
    ref = plain(x.to("tpu"))
    out = sharded(td.shard(x.to("tpu"), mesh, ("data", None)))
    assert _is_split(out, 0, N_DEVICES), td.sharding_of(out)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.cpu(), _mlp()(x).detach(), rtol=1e-5, atol=1e-5)
    ref.square().mean().backward()
    out.square().mean().backward()
    for p, q in zip(base.parameters(), plain.parameters()):
        assert _spans_all(p.grad)
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-5, atol=1e-5)


def check_mixing_and_views() -> None:
    """Ordinary tpu tensors (factories, .to) mix with sharded ones in one op, also on a 2-D mesh
    over devices that exclude device 0; views of a sharded base read and write correctly."""
    mesh = td.mesh((2, 2), ("data", "model"), devices=[4, 5, 6, 7])
    torch.manual_seed(4)
    x, w = torch.randn(8, 6), torch.randn(12, 6)
    xs = td.shard(x.to("tpu"), mesh, ("data", None))
    ws = td.shard(w.to("tpu"), mesh, ("model", None))
    out = nn.functional.linear(xs, ws) + torch.ones(12, device="tpu") + torch.arange(12.0).to("tpu")
    assert td.sharding_of(out).spec[:2] == ("data", "model"), td.sharding_of(out)
    torch.testing.assert_close(out.cpu(), x @ w.T + 1 + torch.arange(12.0), rtol=1e-5, atol=1e-5)

    mesh8 = td.mesh(N_DEVICES, "data")
    base = td.shard(x.repeat(2, 1).to("tpu"), mesh8, ("data",))
    v = base[3:11, 1:4]
    torch.testing.assert_close(v.cpu(), x.repeat(2, 1)[3:11, 1:4])
    v.mul_(2)
    expect = x.repeat(2, 1)
    expect[3:11, 1:4] *= 2
    torch.testing.assert_close(base.cpu(), expect)
    assert _spans_all(base)
    try:
        td.shard(v, mesh8, ("data",))
    except ValueError as e:
        assert "view" in str(e)
    else:
        raise AssertionError("sharding a view did not raise")
    try:
        td.shard(torch.zeros(6, 4, device="tpu"), mesh8, ("data",))
    except ValueError as e:
        assert "evenly" in str(e)
    else:
        raise AssertionError("an uneven split did not raise")


def _shard_llama(model: nn.Module, mesh) -> None:
    """Tensor parallelism by name: the attention projections split by heads and the MLP's up and
    gate by hidden features (their weights' rows), their output projections along the contracted
    dim (columns), where XLA adds the reduction; everything else replicated."""
    rows = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
    for name, p in model.named_parameters():
        if name.endswith(rows):
            td.shard(p, mesh, ("model", None))
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            td.shard(p, mesh, (None, "model"))
        else:
            td.replicate(p, mesh)
    for b in model.buffers():
        td.replicate(b, mesh)


def check_tensor_parallel_decoding() -> None:
    """A transformers Llama sharded over 4 devices (``_shard_llama``) decodes greedily with XLA's
    collectives: CPU's tokens with a static cache (strict and fused mode) and a dynamic one; the
    MLP's hidden activations are split over the 4 devices, and an output projection's result,
    summed over them, is whole on each."""
    try:
        from torch_tpu.bench.decode import tiny_llama
    except ImportError:  # transformers is a test dependency; the pytest side skips without it
        return
    import jax

    mesh = td.mesh(4, "model", devices=jax.devices()[:4])
    cpu_model = tiny_llama(layers=2, hidden=64)
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    model = tiny_llama(layers=2, hidden=64)
    model.load_state_dict(cpu_model.state_dict())
    model = model.to("tpu")
    _shard_llama(model, mesh)
    ids = td.replicate(prompt.to("tpu"), mesh)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = cpu_model.generate(prompt, **kw)
        for mode, cache in (("strict", "static"), ("fused", "static"), ("strict", None)):
            with torch_tpu.set_eager_mode(mode):
                got = model.generate(ids, cache_implementation=cache, **kw)
            assert torch.equal(got.cpu(), expected), (mode, cache, got.cpu(), expected)
        mlp = model.model.layers[0].mlp
        x = td.replicate(torch.randn(2, 3, 64).to("tpu"), mesh)
        hidden = mlp.up_proj(x)
        assert td.sharding_of(hidden).shard_shape((2, 3, 128)) == (2, 3, 32), td.sharding_of(hidden)
        out = mlp(x)
        assert len(td.sharding_of(out).device_set) == 4 and td.sharding_of(out).is_fully_replicated
        torch.testing.assert_close(out.cpu(), cpu_model.model.layers[0].mlp(x.cpu()), rtol=1e-5, atol=1e-5)


def check_sharded_programs_compile_for_a_slice() -> None:
    """With a multi-chip TPU target, each program on sharded inputs is compiled partitioned over
    as many of the slice's chips as it spans here, with XLA:TPU's figures per chip: a fused
    data-parallel step over 8 devices, the Estimator's replayed step with ``dp`` and ``fsdp`` (whose
    parameters and optimizer state take less memory per chip), and tensor-parallel decoding over 4
    devices (CPU's tokens). A program over more devices than the topology has chips is a failure
    that says so. Needs libtpu (the pytest side skips without it)."""
    from torch.utils.data import DataLoader, TensorDataset

    from torch_tpu.estimator import TPUEstimator
    from torch_tpu.runtime import target

    if not target.available():
        return
    mesh = td.mesh((N_DEVICES,), ("data",))
    x, y = torch.randn(64, 16), torch.randn(64, 4)

    def fused_dp_step() -> None:
        net = _mlp().to("tpu")
        td.replicate_module(net, mesh)
        with torch_tpu.set_eager_mode("fused"):
            _sgd_step(net, td.shard(x.to("tpu"), mesh, ("data", None)),
                      td.shard(y.to("tpu"), mesh, ("data", None)))[0].item()

    with torch_tpu.set_target("v5e:2x4"):
        fused_dp_step()
        r = torch_tpu.target_report()
        assert r["programs"]["failed"] == 0 and r["per_program"], str(r)
        assert {p["chips"] for p in r["per_program"]} == {N_DEVICES}, str(r)
        assert f"per chip of {N_DEVICES}" in str(r), str(r)

        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(256, 64, generator=g), torch.randint(0, 2, (256,), generator=g))
        per_chip = {}
        for sharding in ("dp", "fsdp"):
            target.reset()
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 2))
            TPUEstimator(verbose=False, sharding=sharding).fit(model, DataLoader(data, batch_size=64), epochs=1)
            r = torch_tpu.target_report()
            graphs = [p for p in r["per_program"] if p["kind"] == "graph"]
            assert r["programs"]["failed"] == 0 and graphs, str(r)
            assert all(p["chips"] == N_DEVICES for p in graphs), str(r)
            per_chip[sharding] = max(p["argument_bytes"] for p in graphs)
        # the first layer's weight, bias and AdamW moments split 8 ways
        assert per_chip["fsdp"] < per_chip["dp"] / 2, per_chip

    try:
        from torch_tpu.bench.decode import tiny_llama
    except ImportError:  # transformers is a test dependency
        return
    import jax

    four = td.mesh(4, "model", devices=jax.devices()[:4])
    cpu_model = tiny_llama(layers=2, hidden=64)
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch_tpu.set_target("v5e:2x4"):
        model = tiny_llama(layers=2, hidden=64)
        model.load_state_dict(cpu_model.state_dict())
        model = model.to("tpu")
        _shard_llama(model, four)
        with torch.no_grad(), torch_tpu.set_eager_mode("fused"):
            got = model.generate(td.replicate(prompt.to("tpu"), four), **kw)
            assert torch.equal(got.cpu(), cpu_model.generate(prompt, **kw)), got
        r = torch_tpu.target_report()
        assert r["programs"]["failed"] == 0, str(r)
        assert 4 in {p["chips"] for p in r["per_program"]}, str(r)

    with torch_tpu.set_target("v5e"), warnings.catch_warnings(record=True) as caught:  # 2x2: 4 chips
        warnings.simplefilter("always")
        fused_dp_step()
        r = torch_tpu.target_report()
    assert r["programs"]["failed"] and all("sharded over 8 devices" in f["error"] and "4 chips" in f["error"]
                                           for f in r["failures"]), str(r)
    assert any("sharded over 8 devices" in str(w.message) for w in caught), [str(w.message) for w in caught]


CHECKS = [name for name in list(globals()) if name.startswith("check_")]


def _run_checks() -> None:
    results = {}
    for name in CHECKS:
        try:
            globals()[name]()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(MARK + json.dumps(results), flush=True)


# ------------------------------------------------------------------ the pytest side
_WORKER = (
    "import sys, runpy, torch_tpu\n"
    "assert 'torch_tpu.distributed' not in sys.modules, 'import torch_tpu imported torch_tpu.distributed'\n"
    f"runpy.run_path({os.path.abspath(__file__)!r}, run_name='__spmd_worker__')\n"
)


@pytest.fixture(scope="module")
def results() -> dict:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=(env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}").strip(),
        TORCH_TPU_PLATFORM="cpu",
        TORCH_TPU_EAGER_MODE="strict",
    )
    env.pop("TORCH_TPU_LAUNCH_BLOCKING", None)
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARK)]
    assert proc.returncode == 0 and lines, f"the SPMD worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len(MARK):])


def _passed(results: dict, name: str) -> None:
    assert results[name] == "ok", results[name]


def test_strict_data_parallel_mlp_step(results):
    _passed(results, "check_strict_data_parallel")


def test_strict_tensor_parallel_matmul(results):
    _passed(results, "check_strict_tensor_parallel")


def test_fused_data_parallel_mlp_step(results):
    _passed(results, "check_fused_data_parallel")


def test_fused_tensor_parallel_matmul(results):
    _passed(results, "check_fused_tensor_parallel")


def test_fused_same_trace_sharded_and_unsharded(results):
    _passed(results, "check_fused_same_trace_sharded_and_not")


def test_compile_on_sharded_inputs(results):
    _passed(results, "check_compile")


def test_mixing_plain_and_sharded_tensors_and_views(results):
    _passed(results, "check_mixing_and_views")


def test_tensor_parallel_decoding_gives_cpus_tokens(results):
    pytest.importorskip("transformers")
    _passed(results, "check_tensor_parallel_decoding")


def test_sharded_programs_compile_for_a_tpu_slice(results):
    from torch_tpu.runtime import target

    if not target.available():
        pytest.skip("a TPU target needs libtpu (pip install libtpu)")
    _passed(results, "check_sharded_programs_compile_for_a_slice")


# ------------------------------------------------------------------ argument checks (one device here)
def test_mesh_validates_shape_and_names():
    n = torch.tpu.device_count()
    m = td.mesh(n, "data")
    assert dict(m.shape) == {"data": n} and m.axis_names == ("data",)
    assert dict(td.mesh((-1,), ("x",)).shape) == {"x": n}
    with pytest.raises(ValueError, match=f"needs {n + 1} devices but {n} are used"):
        td.mesh(n + 1, "data")
    with pytest.raises(ValueError, match="2 axis names"):
        td.mesh((n,), ("a", "b"))
    with pytest.raises(ValueError, match="distinct"):
        td.mesh((n, 1), ("a", "a"))
    with pytest.raises(ValueError, match="positive"):
        td.mesh((0,), ("a",))


def test_shard_on_one_device_and_argument_errors():
    mesh = td.mesh((1,), ("data",))
    c = torch.randn(4, 3)
    t = c.to("tpu")
    assert td.shard(t, mesh, ("data", None)) is t
    assert tuple(td.sharding_of(t).spec) == ("data", None)
    torch.testing.assert_close((t * 2).cpu(), c * 2)
    assert td.sharding_of(td.replicate(t, mesh)).is_fully_replicated
    with pytest.raises(ValueError, match="view"):
        td.shard(t[1:], mesh, ("data",))
    with pytest.raises(ValueError, match="view"):
        td.shard(t.T, mesh, ())
    with pytest.raises(ValueError, match="tpu tensor"):
        td.shard(c, mesh, ())
    with pytest.raises(ValueError, match="not an axis"):
        td.shard(t, mesh, ("model",))
    with pytest.raises(ValueError, match="3 entries"):
        td.shard(t, mesh, ("data", None, None))
    with pytest.raises(ValueError, match="more than one dim"):
        td.shard(t, mesh, ("data", "data"))
    mesh2 = td.mesh((1, 1), ("a", "b"))
    assert tuple(td.sharding_of(td.shard(t, mesh2, (("a", "b"),))).spec) == (("a", "b"), None)
    torch.testing.assert_close(t.cpu(), c)


if __name__ == "__spmd_worker__":
    _run_checks()
