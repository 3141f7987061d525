"""Memory layout of results: a tpu result has the strides CPU gives it.

PyTorch's ops lay a fresh result out after their inputs (TensorIterator follows the input's
dimension order, ``empty_like`` keeps a dense layout). Code checks this, e.g.
``out.is_contiguous(memory_format=torch.channels_last)`` after a dropout or a pooling, and
autograd's gradient-layout contract makes a parameter's ``.grad`` take the parameter's strides.
On tpu the storage's array is held in the result's physical order and the tensor gets the meta
kernel's strides over it, so these answers are CPU's.
"""

import pytest
import torch
import torch.nn.functional as F

import torch_tpu  # noqa: F401

CL = torch.channels_last


def _nhwc(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).contiguous(memory_format=CL)


def _same_layout(cpu: torch.Tensor, tpu: torch.Tensor) -> None:
    assert tpu.device.type == "tpu"
    assert tpu.shape == cpu.shape
    assert tpu.stride() == cpu.stride(), (tpu.stride(), cpu.stride())
    assert not tpu._is_view() and tpu._base is None  # a fresh result, not a view of something
    torch.testing.assert_close(tpu.cpu(), cpu)


@pytest.mark.parametrize(
    "fn",
    [
        lambda a: a + 1,
        lambda a: a.relu(),
        lambda a: a * a.sigmoid(),
        lambda a: a.clone(),
        lambda a: a.double(),
        lambda a: F.avg_pool2d(a, 2),
        lambda a: F.max_pool2d(a, 2),
        lambda a: F.adaptive_avg_pool2d(a, 1),
        lambda a: F.batch_norm(a, torch.zeros(3, device=a.device), torch.ones(3, device=a.device), training=True),
        lambda a: F.batch_norm(a, torch.zeros(3, device=a.device), torch.ones(3, device=a.device), training=False),
        lambda a: F.pad(a, (1, 2, 2, 1), mode="reflect"),
        lambda a: F.pad(a, (1, 2, 2, 1), mode="replicate"),
    ],
    ids=["add", "relu", "silu", "clone", "to_double", "avg_pool2d", "max_pool2d", "adaptive_avg_pool2d",
         "batch_norm_train", "batch_norm_eval", "reflection_pad2d", "replication_pad2d"],
)
def test_channels_last_results_keep_cpu_strides(fn):
    x = _nhwc(2, 3, 6, 6)
    _same_layout(fn(x), fn(x.to("tpu")))


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_padding_a_channels_last_3d_input_keeps_its_layout_forward_and_backward(mode):
    x = torch.randn(2, 3, 4, 5, 6).contiguous(memory_format=torch.channels_last_3d)
    grads = []
    for a in (x.clone().requires_grad_(), x.to("tpu").requires_grad_()):
        y = F.pad(a, (1, 1, 2, 1, 1, 2), mode=mode)
        y.backward(torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape).to(a.device))
        grads.append((y, a.grad))
    (cy, cg), (ty, tg) = grads
    _same_layout(cy.detach(), ty.detach())
    assert tg.stride() == cg.stride()
    torch.testing.assert_close(tg.cpu(), cg)


def test_transfer_keeps_channels_last_both_ways():
    x = _nhwc(2, 3, 4, 5)
    t = x.to("tpu")
    assert t.stride() == x.stride() and t.is_contiguous(memory_format=CL)
    assert torch.equal(t.cpu(), x)
    assert x.to("tpu", memory_format=torch.contiguous_format).is_contiguous()


def test_factories_with_memory_format():
    e = torch.empty(2, 3, 4, 5, device="tpu", memory_format=CL)
    assert e.stride() == torch.empty(2, 3, 4, 5, memory_format=CL).stride()
    like = torch.empty_like(_nhwc(2, 3, 4, 5).to("tpu"))
    assert like.is_contiguous(memory_format=CL)
    s = torch.empty_strided((2, 3, 4), (1, 2, 6), device="tpu")  # a dense permutation: kept
    assert s.stride() == (1, 2, 6)
    gap = torch.empty_strided((2, 3), (6, 2), device="tpu")  # not dense: made contiguous
    assert gap.shape == (2, 3)


def test_clone_and_contiguous_to_a_memory_format():
    x = torch.randn(2, 3, 4, 5)
    t = x.to("tpu")
    a, b = x.clone(memory_format=CL), t.clone(memory_format=CL)
    _same_layout(a, b)
    assert t.contiguous(memory_format=CL).stride() == a.stride()
    assert t.clone().is_contiguous()  # the same op on a contiguous input stays contiguous


def test_permuted_input_gives_permuted_result():
    x = torch.randn(4, 5, 6).permute(2, 0, 1)
    _same_layout(x * 2, x.to("tpu") * 2)


def test_dropout_keeps_layout_and_grad_follows_parameter():
    x = _nhwc(2, 4, 3, 3).to("tpu").requires_grad_()
    out = F.dropout(x, 0.3, training=True)
    assert out.is_contiguous(memory_format=CL)
    out.backward(torch.ones(2, 4, 3, 3, device="tpu"))  # a contiguous gradient
    assert x.grad.is_contiguous(memory_format=CL)  # laid out like x, as on CPU
    kept = (out != 0).cpu()
    torch.testing.assert_close(x.grad.cpu()[kept], torch.full_like(x.grad.cpu()[kept], 1 / 0.7))


def test_writes_into_a_channels_last_result():
    x = _nhwc(2, 3, 4, 5)
    c, t = x + 1, x.to("tpu") + 1
    c[:, 1].mul_(3)
    t[:, 1].mul_(3)
    c.add_(torch.arange(5.0))
    t.add_(torch.arange(5.0, device="tpu"))
    _same_layout(c, t)
    assert torch.equal(t.sum(1).cpu(), c.sum(1))


def test_layout_in_fused_mode():
    x = _nhwc(2, 3, 4, 4)
    with torch_tpu.set_eager_mode("fused"):
        t = x.to("tpu")
        r = (t * 2).relu()
        assert r.is_contiguous(memory_format=CL)
        torch.testing.assert_close(r.cpu(), (x * 2).relu())


def test_unbatched_max_pool3d_lays_out_as_its_batch_of_one():
    # CPU pools a 4-D (unbatched) input as the batch of one it is: a channels_last_3d input
    # squeezed to 4-D gives results (and an input gradient) laid out channels_last_3d
    x = torch.randn(1, 3, 6, 5, 4).contiguous(memory_format=torch.channels_last_3d).squeeze(0).clone()
    g = torch.randn(1, 3, 3, 2, 2).contiguous(memory_format=torch.channels_last_3d).squeeze(0)
    outs = []
    for dev in ("cpu", "tpu"):
        xd = x.detach().to(dev).requires_grad_()
        out, ind = F.max_pool3d(xd, 2, return_indices=True)
        out.backward(g.to(dev))
        outs.append((out, ind, xd.grad))
    for cpu, tpu in zip(*outs):
        _same_layout(cpu, tpu)


_OUT_OPS = {
    "add": lambda a, b, out: torch.add(a, b, out=out),
    "eq": lambda a, b, out: torch.eq(a, b, out=out),
    "mul by a broadcast row": lambda a, b, out: torch.mul(a, b[0, 0], out=out),
    "exp": lambda a, b, out: torch.exp(a, out=out),
}


@pytest.mark.parametrize("perm", [(2, 0, 1), (1, 2, 0), (0, 2, 1)])
@pytest.mark.parametrize("name", sorted(_OUT_OPS))
def test_an_out_tensor_resized_from_empty_gets_cpu_strides(name, perm):
    """CPU restrides an ``out=`` tensor it resizes as the functional result would be laid out
    (permuted like a permuted input); one already of the right shape keeps its strides."""
    f = _OUT_OPS[name]
    x = torch.randn(2, 3, 4).permute(perm)
    results = {}
    for dev in ("cpu", "tpu"):
        a = x.to(dev)
        out = torch.empty(0, device=dev, dtype=torch.bool if name == "eq" else torch.float32)
        f(a, a, out)
        kept = torch.empty(x.shape, device=dev, dtype=out.dtype)
        f(a, a, kept)
        results[dev] = (out.stride(), kept.stride(), out.cpu())
    assert results["tpu"][:2] == results["cpu"][:2]
    torch.testing.assert_close(results["tpu"][2], results["cpu"][2])
