"""A target TPU chip (torch_tpu.runtime.target): the programs that run here are compiled for it by
XLA:TPU (libtpu's compile-only client), failures are reported with their ops and the user's line,
and the report projects a step's speed from XLA:TPU's own figures. Needs libtpu; skipped without."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import torch_tpu
from torch_tpu.runtime import target as _target
from torch_tpu.testing.expected import fallbacks

pytestmark = pytest.mark.skipif(not _target.available(), reason="a TPU target needs libtpu (pip install libtpu)")


@pytest.fixture
def v5e(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_TPU_CACHE_DIR", str(tmp_path))  # the analyses' disk cache: empty
    # strict: one program per op, which the tests name (the fused pass runs this file too; the
    # fused trace's own test sets fused mode)
    with torch_tpu.set_eager_mode("strict"), torch_tpu.set_target("v5e") as t:
        yield t


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)


def test_a_program_compiles_for_the_chip_with_its_cost_and_memory(v5e):
    a, b = torch.randn(64, 32, device="tpu"), torch.randn(32, 16, device="tpu")
    (a @ b).cpu()
    (a @ b).cpu()  # the same signature: counted, not compiled again
    report = torch_tpu.target_report()
    assert report["chip"] == "v5e" and report["topology"] == "v5e:2x2"
    assert report["programs"]["failed"] == 0 and report["programs"]["pending"] == 0
    mm = [p for p in report["per_program"] if p["program"].startswith("aten.mm.default(float32[64, 32]")]
    assert len(mm) == 1, [p["program"] for p in report["per_program"]]
    mm = mm[0]
    assert mm["calls"] == 2 and mm["kind"] == "program"
    assert mm["flops"] == 2 * 64 * 32 * 16  # XLA:TPU's own count of the matmul
    # HBM as the chip lays it out, in tiles: at least the arrays' own bytes
    assert mm["argument_bytes"] >= (64 * 32 + 32 * 16) * 4 and mm["output_bytes"] >= 64 * 16 * 4
    assert mm["peak_bytes"] > 0 and 0 < mm["peak_hbm_share"] < 1e-3
    assert mm["device_ms"] > 0 and mm["device_ms_source"] in ("xla", "roofline")


def test_64_bit_ops_are_counted_with_their_bytes_and_lose_xlas_own_estimate(v5e):
    """An int64 op's program names its 64-bit ops and their bytes; XLA:TPU emulates them and has no
    time estimate for such a program (the projection uses the roofline); a float32 op has none."""
    i = torch.arange(1000, device="tpu")
    (i * 3).cpu()
    f = torch.randn(1000, device="tpu")
    (f * 3).cpu()
    report = torch_tpu.target_report()
    mul = {p["program"].split("(")[1].split("[")[0]: p for p in report["per_program"]
           if p["program"].startswith("aten.mul.Tensor(")}
    assert set(mul) == {"int64", "float32"}, [p["program"] for p in report["per_program"]]
    assert mul["int64"]["x64_ops"] >= 1 and mul["int64"]["x64_bytes"] >= 1000 * 8, mul["int64"]
    assert mul["int64"]["xla_ms"] is None and mul["int64"]["device_ms_source"] == "roofline"
    assert mul["float32"]["x64_ops"] == 0 and mul["float32"]["x64_bytes"] == 0, mul["float32"]


def test_a_loss_and_a_causal_mask_keep_64_bit_work_off_the_logits(v5e):
    """cross_entropy's backward and tril, as a training step runs them, hold no 64-bit op the size
    of the logits or the mask (int64 targets stay int64 to the user). (JAX's random bits are
    counted from 64-bit iotas whatever the dtype: the data here is made on the CPU.)"""
    logits = torch.randn(64, 100).to("tpu").requires_grad_()
    target = torch.randint(0, 100, (64,)).to("tpu")
    loss = torch.nn.functional.cross_entropy(logits, target)
    loss.backward()
    mask = torch.ones(32, 32, dtype=torch.bool, device="tpu").tril()
    logits.grad.cpu(), mask.cpu()
    torch.testing.assert_close(mask.cpu(), torch.ones(32, 32, dtype=torch.bool).tril())
    report = torch_tpu.target_report()
    big = [(p["program"][:60], p["x64_bytes"]) for p in report["per_program"] if p["x64_bytes"] >= 32 * 32 * 8]
    assert not big, big
    assert any(p["program"].startswith("aten.nll_loss_backward") for p in report["per_program"])


def test_x64_figures_read_the_ops_results_of_the_program_text():
    text = """
    %0 = stablehlo.iota dim = 0 : tensor<8x64xi64>
    %1 = stablehlo.convert %0 : (tensor<8x64xi64>) -> tensor<8x64xf32>
    %2 = stablehlo.add %0, %0 : tensor<8x64xi64>
    %3:2 = stablehlo.sort %a, %b : (tensor<4xf32>, tensor<4xi32>) -> (tensor<4xf32>, tensor<4xf64>)
    %4 = stablehlo.constant dense<1.0> : tensor<complex<f64>>
    """
    assert _target.x64_figures(text) == {"ops": 4, "bytes": 2 * 8 * 64 * 8 + 4 * 8 + 16}


@torch_tpu.jax_op
def eigenvalue_sum(x):
    """A custom kernel XLA:TPU cannot compile: jax has no TPU lowering of a general eigensolver."""
    import jax.numpy as jnp

    return jnp.linalg.eig(x)[0].real.sum(keepdims=True)


def test_a_program_that_does_not_compile_is_reported_once_with_its_op_and_line(v5e):
    a = torch.eye(4, device="tpu") * 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = eigenvalue_sum(a).cpu()  # [eig-line]
        report = torch_tpu.target_report()
        torch_tpu.target_report()
    assert got.item() == pytest.approx(8.0)  # it runs here all the same
    said = [str(w.message) for w in seen if "does not compile" in str(w.message)]
    assert len(said) == 1, said
    line = f"{__file__}:{_line_of('[eig-line]')}"
    assert "eigenvalue_sum" in said[0] and line in said[0]
    assert report["programs"]["failed"] == 1
    (failure,) = report["failures"]
    assert failure["site"] == line and "eigenvalue_sum" in failure["ops"][0]
    assert "eig" in failure["error"]
    assert "FAILED" in str(report) and "eigenvalue_sum" in str(report)


def test_strict_raises_at_the_op(v5e, monkeypatch):
    monkeypatch.setattr(_target, "_strict", True)
    a = torch.eye(3, device="tpu")
    with pytest.raises(torch_tpu.TargetCompileError, match=r"eigenvalue_sum.*test_target\.py:\d+"):
        eigenvalue_sum(a)


def test_a_fused_trace_that_fails_is_blamed_on_its_op(v5e):
    with torch_tpu.set_eager_mode("fused"):
        x = torch.randn(4, 4, device="tpu")
        y = (x * 2).sum() + eigenvalue_sum(x @ x.T).sum()  # [fused-eig-line]
        y.cpu()
    report = torch_tpu.target_report()
    failed = [f for f in report["failures"] if f["kind"] == "fused"]
    assert len(failed) == 1, report["failures"]
    line = f"{__file__}:{_line_of('[fused-eig-line]')}"
    assert len(failed[0]["ops"]) == 1 and "eigenvalue_sum" in failed[0]["ops"][0], failed[0]["ops"]
    assert failed[0]["ops"][0].endswith(f" at {line}")


def test_64_bit_integer_products_compile_for_the_chip(v5e):
    """XLA:TPU has no 64-bit integer dot; torch_tpu's lowering of the products needs none."""
    i = torch.arange(16, device="tpu").reshape(4, 4)
    (i @ i).cpu()
    torch.mv(i, i[0]).cpu()
    report = torch_tpu.target_report()
    assert report["programs"]["failed"] == 0, report["failures"]
    assert any(p["program"].startswith("aten.mm.default(int64[4, 4]") for p in report["per_program"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
def test_an_svd_compiles_for_the_chip_and_gives_cpus_values(v5e, dtype):
    """JAX's TPU SVD made 64-bit loop values that XLA:TPU could not rewrite (found by
    tools/target_sweep.py: svd, pinv, nuclear norms did not compile for a TPU); the 32-bit SVD is
    now traced with 64-bit types off. Full and reduced, tall and wide, batched, and its gradient.
    (float64 compiled before and does now, in about 80 s here: XLA:TPU emulates it.)"""
    torch.manual_seed(0)
    for shape in ((5, 4), (4, 5), (3, 5, 5)):
        a = torch.randn(*shape, dtype=dtype)
        for full in (False, True):
            u, s, vh = torch.linalg.svd(a.to("tpu"), full_matrices=full)
            want_s = torch.linalg.svdvals(a)
            k = want_s.shape[-1]
            torch.testing.assert_close(s.cpu(), want_s, rtol=1e-4, atol=1e-5)
            rebuilt = (u.cpu()[..., :k] * s.cpu().to(u.dtype)[..., None, :]) @ vh.cpu()[..., :k, :]
            torch.testing.assert_close(rebuilt, a, rtol=1e-4, atol=1e-4)
    x = torch.randn(4, 3, dtype=dtype, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    torch.linalg.svd(x, full_matrices=False)[1].sum().backward()
    torch.linalg.svd(xt, full_matrices=False)[1].sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-4, atol=1e-5)
    torch.linalg.pinv(torch.randn(3, 3).to("tpu")).cpu()
    # least squares through the same SVD (the sweep's second third found its 'gels' driver)
    a, b = torch.randn(5, 3, dtype=dtype), torch.randn(5, 2, dtype=dtype)
    got = torch.linalg.lstsq(a.to("tpu"), b.to("tpu"), driver="gels").solution.cpu()
    torch.testing.assert_close(got, torch.linalg.lstsq(a, b, driver="gels").solution, rtol=1e-4, atol=1e-4)
    report = torch_tpu.target_report()
    assert report["programs"]["failed"] == 0, report["failures"]
    assert any(p["program"].startswith("aten._linalg_svd.default") for p in report["per_program"])


def test_a_float64_fft_runs_on_the_host_for_a_tpu_target_and_a_float32_one_compiles(tmp_path, monkeypatch):
    """XLA:TPU's FFT takes 32-bit types only ("Unexpected operand type for FFT: f64"): with a TPU
    target a float64 or complex128 FFT runs on the host, CPU's values, counted and named; a
    float32 one compiles for the chip; without a target both run on the device."""
    from torch_tpu.runtime import metrics

    monkeypatch.setenv("TORCH_TPU_CACHE_DIR", str(tmp_path))
    x = torch.randn(5, 3, 10, dtype=torch.float64)
    name = "aten._fft_r2c.default"
    before = metrics.fallback_counts[name]
    torch.fft.rfftn(x.to("tpu"), dim=(1, 2)).cpu()
    assert metrics.fallback_counts[name] == before  # no target: XLA:CPU's float64 FFT
    with torch_tpu.set_eager_mode("strict"), torch_tpu.set_target("v5e"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.fft.rfftn(x.to("tpu"), dim=(1, 2))
            back = torch.fft.irfftn(got, dim=(1, 2), s=(3, 10))
            single = torch.fft.fft(x.float().to("tpu"))
        torch.testing.assert_close(got.cpu(), torch.fft.rfftn(x, dim=(1, 2)))
        torch.testing.assert_close(back.cpu(), x)
        torch.testing.assert_close(single.cpu(), torch.fft.fft(x.float()), rtol=1e-4, atol=1e-4)
        report = torch_tpu.target_report()
    assert metrics.fallback_counts[name] == before + 1
    assert report["host_fallbacks"] == {name: 1, "aten._fft_c2r.default": 1}, report["host_fallbacks"]
    assert report["programs"]["failed"] == 0, report["failures"]
    assert any(p["program"].startswith("aten._fft_c2c.default(complex64") or
               p["program"].startswith("aten._fft_r2c.default(float32") for p in report["per_program"])


def test_an_int64_convolution_runs_on_the_host_for_a_tpu_target(tmp_path, monkeypatch):
    """XLA:TPU has no 64-bit integer convolution (found by tools/target_sweep.py): with a TPU
    target it runs on the host, CPU's values, counted and named; without one, on the device."""
    from torch_tpu.runtime import metrics

    monkeypatch.setenv("TORCH_TPU_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randint(-5, 5, (1, 3, 6, 6), generator=g), torch.randint(-5, 5, (4, 3, 3, 3), generator=g)
    name = "aten.convolution.default"
    before = metrics.fallback_counts[name]
    want = torch.nn.functional.conv2d(x, w, stride=2, padding=1)
    assert torch.equal(torch.nn.functional.conv2d(x.to("tpu"), w.to("tpu"), stride=2, padding=1).cpu(), want)
    assert metrics.fallback_counts[name] == before  # no target: XLA:CPU's convolution
    with torch_tpu.set_eager_mode("strict"), torch_tpu.set_target("v5e"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.nn.functional.conv2d(x.to("tpu"), w.to("tpu"), stride=2, padding=1)
            floats = torch.nn.functional.conv2d(x.float().to("tpu"), w.float().to("tpu"), stride=2, padding=1)
        assert torch.equal(got.cpu(), want) and torch.equal(floats.cpu(), want.float())
        report = torch_tpu.target_report()
    assert metrics.fallback_counts[name] == before + 1
    assert report["host_fallbacks"] == {name: 1} and report["programs"]["failed"] == 0, report


def test_a_captured_graph_compiles_for_the_chip(v5e):
    x = torch.randn(8, 8, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        y = (x @ x).relu()
    for _ in range(3):
        g.replay()
    y.cpu()
    graphs = [p for p in torch_tpu.target_report()["per_program"] if p["kind"] == "graph"]
    assert len(graphs) == 1 and graphs[0]["calls"] == 3 and graphs[0]["flops"] >= 2 * 8**3


def test_a_replay_the_graph_refuses_raises_its_own_error_and_is_no_target_failure(v5e):
    """A static input resized after capture: the replay raises the graph's error on the local
    platform, and the target reports no failed program (nothing was due to compile)."""
    x = torch.zeros(3, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        (x + 1).relu()
    x.resize_(5)
    with pytest.raises(RuntimeError, match=r"static input changed from float32\[3\] to float32\[5\]"):
        g.replay()
    report = torch_tpu.target_report()
    assert report["programs"]["failed"] == 0 and report["programs"]["pending"] == 0, str(report)


def test_steps_project_speed_and_which_side_binds(v5e):
    w = torch.randn(128, 128, device="tpu")
    for _ in range(3):
        with torch_tpu.target_step():
            (w @ w).tanh().sum().item()
    s = torch_tpu.target_report()["step"]
    assert s["steps"] == 2  # the first, which compiled, is left out
    for key in ("device_ms_per_step", "device_ms_source", "host_ms_per_step", "projected_steps_per_s",
                "projected_mfu", "bound", "peak_hbm_bytes", "peak_hbm_share"):
        assert key in s
    assert s["bound"] == "host"  # a few tiny ops: microseconds on the chip, the host's Python is the step
    assert s["projected_steps_per_s"] == pytest.approx(1e3 / max(s["host_ms_per_step"], s["device_ms_per_step"]))


def test_a_benchmarks_timed_window_begins_after_the_pending_compiles(v5e, monkeypatch):
    """``snapshot()`` (where ``bench train`` and ``bench decode`` start timing) waits for the worker
    thread's compiles of the warm-up's programs, which would otherwise share the cores with the
    timed steps; the calls after it are what ``since`` projects. (Each compile is made slow here,
    so that none has finished by itself when the snapshot is taken.)"""
    import time

    compile_for_target = _target._compile

    def slow(*args):
        time.sleep(0.3)
        compile_for_target(*args)

    monkeypatch.setattr(_target, "_compile", slow)
    w = torch.randn(96, 96, device="tpu")
    for _ in range(2):
        ((w @ w).sin() @ w).cos().sum().cpu()
    snap = _target.snapshot()
    assert _target._results and all(r.future is None or r.future.done() for r in _target._results)
    ((w @ w).sin() @ w).cos().sum().cpu()
    out = _target.since(snap, 1, 1e-3)
    assert out["failed_programs"] == 0 and out["device_ms_per_step"] > 0


def test_projections_from_known_figures():
    chip = _target.CHIPS["v5e"]
    assert _target.roofline(197e12, 0, chip) == pytest.approx(1.0)
    assert _target.roofline(0, 819e9 / 2, chip) == pytest.approx(0.5)
    p = _target.projection(device_s=0.004, host_s=0.001, flops=197e12 * 0.002, chip=chip, peak=chip.hbm_bytes // 4)
    assert p["bound"] == "device" and p["projected_steps_per_s"] == pytest.approx(250)
    assert p["projected_mfu"] == pytest.approx(0.5) and p["peak_hbm_share"] == pytest.approx(0.25)
    p = _target.projection(device_s=0.001, host_s=0.002, flops=0, chip=chip)
    assert p["bound"] == "host" and p["projected_steps_per_s"] == pytest.approx(500)
    r = _target.Result("program", "p", ["p"], None, cost={"flops": 197e9, "bytes accessed": 0.0, "optimal_seconds": -1})
    assert r.device_seconds(chip) == (pytest.approx(1e-3), "roofline")
    r.cost["optimal_seconds"] = 2e-3
    assert r.device_seconds(chip) == (2e-3, "xla")


def test_set_target_is_a_context_manager_and_names_what_it_accepts():
    assert _target.current() is None
    with torch_tpu.set_target("v6e:2x2") as t:
        assert _target.current() is t and t.chip.name == "v6e"
    assert _target.current() is None
    with pytest.raises(RuntimeError, match="no tpu target is set"):
        torch_tpu.target_report()
    with pytest.raises(ValueError, match="v4, v5e, v5p, v6e"):
        torch_tpu.set_target("v3")


def test_the_environment_variable_sets_the_target(tmp_path):
    script = ("import torch, torch_tpu\n"
              "(torch.ones(3, device='tpu') * 2).cpu()\n"
              "r = torch_tpu.target_report()\n"
              "print(r['chip'], r['topology'], r['programs']['compiled'] >= 1, r['programs']['failed'])\n")
    env = {**os.environ, "TORCH_TPU_TARGET": "v5p", "TORCH_TPU_PLATFORM": "cpu", "TORCH_TPU_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["v5p", "v5p:2x2x1", "True", "0"], out.stdout


def test_eig_runs_on_the_host_for_a_tpu_target_and_is_named(tmp_path, monkeypatch):
    """XLA has no TPU kernel for a general eigensolver: with a TPU target (or on a TPU) eager eig
    runs on the host, counted as a fallback and named in the report; without one, on the device."""
    from torch_tpu.runtime import metrics

    monkeypatch.setenv("TORCH_TPU_CACHE_DIR", str(tmp_path))
    a = torch.randn(5, 5)
    name = "aten.linalg_eig.default"
    before = metrics.fallback_counts[name]
    torch.linalg.eig(a.to("tpu"))
    assert metrics.fallback_counts[name] == before  # no target: XLA:CPU's eig
    with torch_tpu.set_target("v5e"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            w, _ = torch.linalg.eig(a.to("tpu"))
        torch.testing.assert_close(w.cpu(), torch.linalg.eig(a)[0])
        report = torch_tpu.target_report()
    assert metrics.fallback_counts[name] == before + 1
    assert report["host_fallbacks"] == {name: 1} and report["programs"]["failed"] == 0, report
    assert any("no TPU kernel" in str(m.message) for m in seen) and "on the host" in str(report)
    # a fallback by design: the conformance gates' verdict is the same with the target as without
    assert torch_tpu.metrics()["no_tpu_kernel_counts"][name] >= 1
    assert name not in fallbacks(torch_tpu.metrics())


def test_compiled_graphs_with_eig_run_op_by_op_and_svds_compile_for_the_chip(v5e):
    """torch.compile: a graph holding eig (no TPU kernel) runs op by op, eig on the host; pinv and
    svdvals (32-bit SVDs) compile for the chip. Values are CPU's and no program fails."""
    torch._dynamo.reset()
    a = torch.randn(2, 5, 5)

    def f(x):
        return torch.linalg.eigvals(x).real.sum(-1) + 1, torch.linalg.pinv(x), torch.linalg.svdvals(x)

    got = torch.compile(f, backend="tpu")(a.to("tpu"))
    for g, want in zip(got, f(a)):
        torch.testing.assert_close(g.cpu(), want, atol=1e-4, rtol=1e-4)
    report = torch_tpu.target_report()
    assert report["programs"]["failed"] == 0, str(report)
    eig = [op for op in report["host_fallbacks"] if "eig" in op]  # the graph's eig op (AOTAutograd's choice)
    assert eig and torch_tpu.metrics()["eager_graphs"].get(eig[0], 0) >= 1, (report["host_fallbacks"], eig)
    g = lambda x: (torch.linalg.pinv(x), torch.linalg.svdvals(x))  # noqa: E731
    torch.compile(g, backend="tpu")(a.to("tpu"))[1].cpu()
    assert torch_tpu.target_report()["programs"]["failed"] == 0


def test_profile_keeps_its_summary_but_writes_no_trace_beside_the_compile_client(v5e, tmp_path):
    """With libtpu's compile-only client loaded and no TPU, JAX's profiler crashes the process:
    torch_tpu.profile says so and keeps its own summary."""
    x = torch.randn(8, 8, device="tpu")
    (x + 1).cpu()
    with pytest.warns(RuntimeWarning, match="no JAX trace is written"):
        with torch_tpu.profile(tmp_path / "trace") as prof:
            (x @ x).sum().item()
    assert "host->device" in prof.summary() and not (tmp_path / "trace").exists()


def test_a_captured_graph_that_fails_is_blamed_on_its_op(v5e):
    x = torch.randn(4, 4, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        y = (x * 3).relu() + eigenvalue_sum(x @ x.T)  # [graph-eig-line]
    g.replay()
    y.cpu()
    failed = [f for f in torch_tpu.target_report()["failures"] if f["kind"] == "graph"]
    assert len(failed) == 1
    line = f"{__file__}:{_line_of('[graph-eig-line]')}"
    assert len(failed[0]["ops"]) == 1 and "eigenvalue_sum" in failed[0]["ops"][0] and failed[0]["ops"][0].endswith(line)
