"""``torch.matmul`` of batched operands (and ``F.linear`` of a batched input) as one op on tpu:
CPU's values, gradients and errors, and no reshape copies or ``bmm`` in what runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import torch_tpu
from torch_tpu.runtime import metrics

SHAPES = [
    ((2, 3, 4, 5), (2, 3, 5, 6)),  # attention's shapes
    ((2, 1, 4, 5), (3, 5, 6)),  # batch dimensions broadcast, on both sides
    ((4, 5, 6), (4, 6, 2)),
    ((2, 3, 4, 5), (5, 6)),  # a 2-D right operand: a weight
]


def _pair(shape_a, shape_b, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(shape_a, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(shape_b, generator=g, dtype=dtype, requires_grad=True)
    return a, b, a.detach().to("tpu").requires_grad_(), b.detach().to("tpu").requires_grad_()


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("shapes", SHAPES, ids=str)
def test_batched_matmul_gives_cpus_values_and_gradients(shapes, mode):
    a, b, at, bt = _pair(*shapes)
    with torch_tpu.set_eager_mode(mode):
        out = at @ bt
        out.pow(2).sum().backward()
        got = (out.cpu(), at.grad.cpu(), bt.grad.cpu())
    ref = a @ b
    ref.pow(2).sum().backward()
    for x, y in zip(got, (ref, a.grad, b.grad)):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


def test_attention_matmuls_run_as_one_op_each_without_copies():
    """q @ k^T on transposed views, forward and backward: no clone, reshape copy or bmm."""
    x = torch.randn(2, 8, 3, 4, device="tpu", requires_grad=True)
    q = x.transpose(1, 2)  # [2, 3, 8, 4], a view
    metrics.reset()
    att = q @ q.transpose(-2, -1)
    (att @ q).sum().backward()
    ops = torch_tpu.metrics()["op_counts"]
    assert ops.get("torch_tpu_ops.batched_matmul.default", 0) >= 2, ops
    for copying in ("aten.bmm.default", "aten.clone.default", "aten._unsafe_view.default", "aten.mm.default"):
        assert copying not in ops, (copying, ops)
    xc = x.detach().cpu().requires_grad_()
    qc = xc.transpose(1, 2)
    ((qc @ qc.transpose(-2, -1)) @ qc).sum().backward()
    torch.testing.assert_close(x.grad.cpu(), xc.grad, rtol=1e-4, atol=1e-4)


def test_linear_of_a_batched_input_is_one_product_with_its_weights_gradient_summed_in_it():
    g = torch.Generator().manual_seed(1)
    x, w, bias = (torch.randn(s, generator=g, requires_grad=True) for s in ((2, 3, 6, 5), (4, 5), (4,)))
    xt, wt, bt = (t.detach().to("tpu").requires_grad_() for t in (x, w, bias))
    metrics.reset()
    out = F.linear(xt, wt, bt)
    out.pow(2).sum().backward()
    ops = torch_tpu.metrics()["op_counts"]
    assert "aten.addmm.default" not in ops and "aten.mm.default" not in ops, ops
    assert ops.get("torch_tpu_ops.batched_matmul_summed.default") == 1, ops
    F.linear(x, w, bias).pow(2).sum().backward()
    for got, ref in ((xt, x), (wt, w), (bt, bias)):
        torch.testing.assert_close(got.grad.cpu(), ref.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shapes", [SHAPES[1], SHAPES[3]], ids=str)
def test_second_derivatives(shapes):
    """fast_mode: gradgradcheck compares the second derivatives along random directions rather than
    element by element; a wrong one still fails, and fused mode compiles a few programs, not ~300."""
    *_, at, bt = _pair(*shapes, dtype=torch.float64)
    assert torch.autograd.gradgradcheck(lambda a, b: a @ b, (at, bt), fast_mode=True)


def test_forward_mode_ad_takes_atens_path():
    import torch.autograd.forward_ad as fwAD

    a, b, at, bt = _pair(*SHAPES[0])
    with fwAD.dual_level():
        dual = fwAD.make_dual(at.detach(), torch.ones_like(at))
        tangent = fwAD.unpack_dual(dual @ bt.detach()).tangent
    torch.testing.assert_close(tangent.cpu(), torch.ones_like(a) @ b.detach(), rtol=1e-4, atol=1e-4)


def test_a_dispatch_mode_sees_atens_ops():
    """A flop counter (a user's dispatch mode) counts the product as CPU does."""
    a, b, at, bt = _pair(*SHAPES[0])
    with FlopCounterMode(display=False) as cpu_count:
        a @ b
    with FlopCounterMode(display=False) as tpu_count:
        at @ bt
    assert tpu_count.get_total_flops() == cpu_count.get_total_flops() > 0


@pytest.mark.parametrize("shapes", [((2, 3, 4), (2, 5, 6)), ((2, 3, 4, 5), (3, 2, 5, 6)), ((2, 3, 4), (6, 2))],
                         ids=str)
def test_mismatched_operands_raise_cpus_error_type(shapes):
    """They take ATen's composite, as before: its errors, which name the shapes."""
    a, b = (torch.randn(s) for s in shapes)
    with pytest.raises(RuntimeError):
        a @ b
    with pytest.raises(RuntimeError, match=r"\b2\b"):
        a.to("tpu") @ b.to("tpu")


def test_mixed_dtypes_raise_cpus_error_type():
    a, b = torch.randn(2, 3, 4), torch.randn(2, 4, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="Double|float64"):
        a @ b
    with pytest.raises(RuntimeError, match="Double|float64"):
        a.to("tpu") @ b.to("tpu")


def test_integer_and_complex_products_keep_atens_path():
    for dtype in (torch.int32, torch.complex64):
        a = torch.arange(24).reshape(2, 3, 4).to(dtype)
        b = torch.arange(40).reshape(2, 4, 5).to(dtype)
        metrics.reset()
        got = (a.to("tpu") @ b.to("tpu")).cpu()
        assert "torch_tpu_ops.batched_matmul.default" not in torch_tpu.metrics()["op_counts"]
        torch.testing.assert_close(got, a @ b)


def test_compiled_step_holds_the_op_and_matches_cpu():
    a, b, at, bt = _pair(*SHAPES[0])

    def f(x, y):
        return (x @ y.transpose(-2, -1).transpose(-2, -1)).sin().sum()

    got = torch.compile(f, backend="tpu")(at, bt)
    got.backward()
    ref = f(a, b)
    ref.backward()
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(at.grad.cpu(), a.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(bt.grad.cpu(), b.grad, rtol=1e-4, atol=1e-4)


def test_autograds_traced_graphs_hold_the_op():
    """What torch.compile's AOTAutograd traces on tpu: the op in the forward and backward graphs."""
    from functorch.compile import aot_function, make_boxed_func

    seen: list[set] = []

    def record(gm: torch.fx.GraphModule, _inputs: list) -> torch.fx.GraphModule:
        seen.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm)

    *_, at, bt = _pair(*SHAPES[0])
    out = aot_function(lambda x, y: (x @ y).sum(), fw_compiler=record, bw_compiler=record)(at, bt)
    out.backward()
    assert len(seen) == 2
    for ops in seen:
        assert "torch_tpu_ops.batched_matmul.default" in ops and "aten.bmm.default" not in ops, ops


@pytest.mark.parametrize("setting", ["medium", "highest"])
def test_compiled_graphs_take_the_float32_matmul_precision(setting, monkeypatch):
    """As eager mode does: torch.compile's products run at torch.get_float32_matmul_precision()."""
    import jax

    from torch_tpu.ops import linalg

    torch_tpu.sync()  # fused mode: earlier tests' pending traces are lowered when they run, not here
    seen = []
    dot = linalg._dot

    def spy(a, b, precision, subscripts=None):
        seen.append(precision)
        return dot(a, b, precision, subscripts)

    monkeypatch.setattr(linalg, "_dot", spy)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        torch._dynamo.reset()
        a, b = torch.randn(3, 4, device="tpu"), torch.randn(4, 5, device="tpu")
        torch.compile(lambda x, y: (x @ y).sin(), backend="tpu")(a, b).cpu()
    finally:
        torch.set_float32_matmul_precision(before)
    want = jax.lax.Precision.DEFAULT if setting == "medium" else jax.lax.Precision.HIGHEST
    assert seen and set(seen) == {want}, seen
