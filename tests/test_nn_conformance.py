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



@pytest.mark.parametrize("loss, x_shape, y_shape", [
    (torch.nn.MultiMarginLoss(), (0,), (10,)),
    (torch.nn.MultiMarginLoss(), (10, 0), (10,)),
    (torch.nn.MultiLabelMarginLoss(), (10, 0), (10, 0)),
    (torch.nn.MultiLabelMarginLoss(), (0,), (10,)),
])
def test_refused_shape_leaves_no_value_check_behind(loss, x_shape, y_shape):
    # the target's values are out of range too, but CPU refuses the shape first; the op never
    # runs, so its queued value check must not raise later at an unrelated host read
    def error(dev):
        x = torch.randn(x_shape, device=dev)
        y = torch.ones(y_shape, device=dev).long()
        with pytest.raises(Exception) as info:
            loss(x, y)
        assert torch.ones(3, device=dev).sum().item() == 3.0  # a host read after the failure
        return info.value

    want, got = error("cpu"), error("tpu")
    assert type(got) is type(want)
    assert "Expected non-empty vector or matrix" in str(got)


def test_value_check_of_an_op_that_ran_still_raises():
    # a well-shaped call with an out-of-range target: CPU's RuntimeError, at the op or the next read
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 5])
    with pytest.raises(RuntimeError, match="target out of range"):
        torch.nn.functional.multi_margin_loss(x, y)
    with pytest.raises(RuntimeError, match="target out of range"):
        torch.nn.functional.multi_margin_loss(x.to("tpu"), y.to("tpu")).item()
