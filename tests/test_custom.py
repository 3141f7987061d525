"""@torch_tpu.jax_op: jax functions (and Pallas kernels) as PyTorch ops on tpu tensors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
from jax import lax

import torch_tpu


@torch_tpu.jax_op
def rms_norm_scale(x, w):
    """A fused RMSNorm + scale written in jax.numpy."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def reference(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def inputs():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    xt = x.detach().to("tpu").requires_grad_()
    wt = w.detach().to("tpu").requires_grad_()
    return x, w, xt, wt


@pytest.mark.parametrize("mode", ["strict", "debug", "fused"])
def test_forward_and_vjp_gradients_in_each_mode(mode):
    x, w, xt, wt = inputs()
    with torch_tpu.set_eager_mode(mode):
        y = rms_norm_scale(xt, wt)
        (y * y).sum().backward()
        (reference(x, w) ** 2).sum().backward()
        torch.testing.assert_close(y.detach().cpu(), reference(x, w).detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xt.grad.cpu(), x.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(wt.grad.cpu(), w.grad, rtol=1e-4, atol=1e-5)


def test_user_supplied_vjp():
    calls = []

    def double_vjp(x, g):
        calls.append(1)
        return (2 * g,)

    @torch_tpu.jax_op(name="double_with_vjp", vjp=double_vjp)
    def double(x):
        return 2 * x

    x = torch.randn(5, device="tpu", requires_grad=True)
    double(x).sum().backward()
    assert calls and torch.equal(x.grad.cpu(), torch.full((5,), 2.0))


def test_stays_one_node_under_torch_compile():
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch_tpu.compile import tpu_backend

        return tpu_backend(gm, example_inputs)

    x, w, xt, wt = inputs()
    f = torch.compile(lambda a, b: rms_norm_scale(a, b).sum(), backend=backend, fullgraph=True)
    out = f(xt.detach(), wt.detach())
    torch.testing.assert_close(out.cpu(), reference(x, w).sum().detach(), rtol=1e-5, atol=1e-4)
    assert any("rms_norm_scale" in s for s in seen), seen


def test_pallas_kernel_in_interpret_mode():
    pl = pytest.importorskip("jax.experimental.pallas")

    def add_one_kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    @torch_tpu.jax_op
    def add_one(x):
        return pl.pallas_call(add_one_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True)(x)

    x = torch.randn(8, 128)
    torch.testing.assert_close(add_one(x.to("tpu")).cpu(), x + 1)


def test_numbers_are_bound_before_decorating():
    """A jax_op takes tensors; a number or an option passed at the call says how to bind it."""
    x = torch.ones(2, 4, device="tpu")
    with pytest.raises(TypeError, match=r"takes tensors only \(got eps\); bind numbers and options"):
        rms_norm_scale(x, torch.ones(4, device="tpu"), eps=1e-5)
    with pytest.raises(TypeError, match=r"takes tensors only \(got float\)"):
        rms_norm_scale(x, 2.0)
