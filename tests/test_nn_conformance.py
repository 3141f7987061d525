"""nn behaviours PyTorch's own nn test files (nn/test_convolution, nn/test_pooling, test_nn) check,
against CPU: empty inputs, CPU's error words, forward AD through views, the strides of empty
tensors, the dtypes interpolate takes and its uint8 values, the results of an op run on CPU."""

from __future__ import annotations

import warnings

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


_RESIZES = [("nearest", 1, False), ("nearest", 2, False), ("nearest-exact", 3, False), ("linear", 1, False),
            ("bilinear", 2, False), ("bilinear", 2, True), ("trilinear", 3, False), ("bicubic", 2, False),
            ("bicubic", 2, True)]


@pytest.mark.parametrize("mode, n, antialias", _RESIZES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int32, torch.int64, torch.bool])
def test_interpolate_refuses_the_integer_dtypes_cpu_refuses(mode, n, antialias, dtype):
    # CPU resizes floating images, and uint8 ones in nearest and the 2-D bilinear/bicubic modes
    def run(dev):
        x = torch.ones((2, 3) + (6,) * n, dtype=dtype, device=dev)
        try:
            out = torch.nn.functional.interpolate(x, (4,) * n, mode=mode, antialias=antialias)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            return e
        return out.cpu()

    want, got = run("cpu"), run("tpu")
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(want) in str(got)
    else:
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("antialias", [False, True])
@pytest.mark.parametrize("align_corners", [False, True])
def test_interpolate_uint8_images_as_cpu(mode, antialias, align_corners):
    # CPU's uint8 path: rounded (not truncated), and bicubic's overshoot clipped between the passes
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 3, 19, 23), dtype=torch.uint8, generator=g)
    kw = dict(size=(29, 11), mode=mode, antialias=antialias, align_corners=align_corners)
    want = torch.nn.functional.interpolate(x, **kw)
    got = torch.nn.functional.interpolate(x.to("tpu"), **kw).cpu()
    assert got.dtype == torch.uint8
    # CPU's fixed-point weights round a few values the other way: within 1, never more
    assert (got.int() - want.int()).abs().max().item() <= 1


def test_cpu_fallback_returns_the_argument_of_each_aliased_result():
    # rrelu_with_noise_ (no lowering: it runs on CPU) writes self and noise, and returns self alone
    x = torch.tensor([float("nan"), -1.0, 2.0, -4.0], device="tpu")
    noise = torch.zeros(4, device="tpu")
    with warnings.catch_warnings():  # the fallback's one-time "runs on CPU" warning
        warnings.simplefilter("ignore")
        out = torch.ops.aten.rrelu_with_noise_(x, noise, 0.125, 0.25, True)
    assert out is x
    got, slopes = x.cpu(), noise.cpu()
    assert got[0].isnan() and got[2] == 2.0 and slopes[2] == 1.0
    assert 0.125 <= slopes[1] <= 0.25 and got[1] == -slopes[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.nn.functional.rrelu(torch.tensor([float("nan")], device="tpu"), inplace=True).isnan().item()


def test_shape_refusal_comes_before_a_host_value_check():
    # the target's values are on the host (so checked at the op), out of range for 0 classes:
    # CPU refuses the empty input's shape before it reads a target value
    def message(dev):
        x, y = torch.randn(10, 0, device=dev), torch.tensor([1] * 10).to(dev)
        with pytest.raises(RuntimeError) as info:
            torch.nn.functional.multi_margin_loss(x, y)
        return str(info.value)

    assert "Expected non-empty vector or matrix" in message("cpu")
    assert "Expected non-empty vector or matrix" in message("tpu")


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
