"""nn behaviours PyTorch's own nn test files (nn/test_convolution, nn/test_pooling) check, against
CPU: empty inputs, CPU's error words, forward AD through views, the strides of empty tensors."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torch_tpu  # noqa: F401


def test_empty_tensors_have_cpu_strides():
    # an empty tensor's outer dims count the 0 as a 1, as CPU's (gradcheck refuses stride 0)
    for shape in [(12, 0, 3), (2, 0, 7), (0, 4), (3, 0)]:
        assert torch.empty(shape, device="tpu").stride() == torch.empty(shape).stride()
        assert torch.randn(shape, device="tpu").double().stride() == torch.randn(shape).double().stride()


def test_convolution_backward_without_channels_is_zero():
    # no input channels: CPU's result has no channels either, and every gradient is zero
    def run(dev):
        x = torch.randn(2, 0, 9, device=dev, requires_grad=True)
        w = torch.randn(6, 0, 3, device=dev, requires_grad=True)
        b = torch.randn(6, device=dev, requires_grad=True)
        out = torch.ops.aten.convolution(x, w, b, [1], [0], [1], False, [0], 1)
        out.backward(torch.randn(out.shape, device=dev))
        return out, x.grad, w.grad, b.grad

    for want, got in zip(run("cpu"), run("tpu")):
        assert got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("x_shape, w_shape, groups, transposed", [
    ((2, 1, 0), (8, 0, 2), 1, False),
    ((2, 4, 5), (8, 3, 2), 2, False),
    ((2, 3, 5), (4, 2, 2), 1, True),  # torch's meta kernel lets this one through
])
def test_convolution_channel_mismatch_in_cpu_words(x_shape, w_shape, groups, transposed):
    def message(dev):
        x, w = torch.randn(x_shape, device=dev), torch.randn(w_shape, device=dev)
        with pytest.raises(RuntimeError) as info:
            torch.ops.aten.convolution(x, w, None, [1], [0], [1], transposed, [0], groups)
        return str(info.value)

    want = message("cpu")
    assert want.startswith("Given ") and want in message("tpu")


def test_forward_ad_tangent_of_a_view():
    # a primal that views another storage (x.real) gets a tangent laid out like it, writable
    def run(dev):
        x = (torch.arange(6, dtype=torch.double) * (1 + 2j)).reshape(2, 3).to(dev)
        with fwAD.dual_level():
            dual = fwAD.make_dual(x.real, torch.zeros_like(x.real))
            tangent = fwAD.unpack_dual(dual).tangent
            tangent[1, 2] = 1.0
            out = fwAD.unpack_dual(torch.sin(dual) * 3).tangent
        return tangent.stride(), out

    (want_stride, want), (got_stride, got) = run("cpu"), run("tpu")
    assert got_stride == want_stride
    torch.testing.assert_close(got.cpu(), want)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode, weighted", [("sum", True), ("sum", False), ("mean", False), ("max", False)])
def test_embedding_bag_half_sums_round_as_cpu(dtype, mode, weighted):
    # CPU sums a bag in float32 and rounds once, bfloat16 ties away from zero; mean divides that
    # rounded sum. Small dyadic per-sample weights make many weighted sums land exactly on a tie.
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(30, 8, generator=gen).to(dtype)
    index = torch.randint(0, 30, (60,), generator=gen)
    offsets = torch.tensor([0, 0, 3, 9, 9, 17, 30, 41])
    psw = (torch.randint(-20, 20, (60,), generator=gen) / 16).to(dtype) if weighted else None
    want = torch.nn.functional.embedding_bag(index, weight, offsets, mode=mode, per_sample_weights=psw)
    got = torch.nn.functional.embedding_bag(
        index.to("tpu"), weight.to("tpu"), offsets.to("tpu"), mode=mode,
        per_sample_weights=None if psw is None else psw.to("tpu"))
    assert got.dtype == want.dtype
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_max_pool_picks_cpus_element_and_index(dtype):
    # ties give the first index, NaN wins its window, -0.0 keeps its sign, padding never wins
    x = torch.tensor([[[0.0, -0.0, 3, 3, -1, float("nan"), 2, 7, 7, -5, -0.0, 0.0]]])
    if not dtype.is_floating_point:
        x = torch.nan_to_num(x, nan=9)
    x = x.to(dtype)
    for kw in [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2, dilation=3),
               dict(kernel_size=3, stride=1, ceil_mode=True)]:
        want = torch.nn.functional.max_pool1d(x, return_indices=True, **kw)
        got = torch.nn.functional.max_pool1d(x.to("tpu"), return_indices=True, **kw)
        torch.testing.assert_close(got[0].cpu(), want[0], equal_nan=True, rtol=0, atol=0)
        real = ~want[0].float().isnan()  # a NaN's sign bit means nothing
        assert torch.equal(got[0].cpu().float().signbit()[real], want[0].float().signbit()[real])
        assert torch.equal(got[1].cpu(), want[1])
    x2 = torch.randn(2, 3, 9, 8).to(dtype) if dtype.is_floating_point else torch.randint(-5, 5, (2, 3, 9, 8))
    want = torch.nn.functional.max_pool2d(x2, 3, stride=2, padding=1, return_indices=True)
    got = torch.nn.functional.max_pool2d(x2.to("tpu"), 3, stride=2, padding=1, return_indices=True)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
