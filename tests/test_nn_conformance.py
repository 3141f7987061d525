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


_CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def _conv_case(dim, transposed, groups, dilated, dtype, x_format, w_format, dev):
    gen = torch.Generator().manual_seed(dim * 100 + groups * 10 + transposed)
    x = torch.randn((2, 4) + (6,) * dim, dtype=dtype, generator=gen)
    w_shape = (4, 6 // groups) if transposed else (6, 4 // groups)
    w = torch.randn(w_shape + (3,) * dim, dtype=dtype, generator=gen)
    b = torch.randn(6, dtype=dtype, generator=gen)
    if x_format:
        x = x.contiguous(memory_format=_CL[x.dim()])
    if w_format:
        w = w.contiguous(memory_format=_CL[w.dim()])
    n = (1,) * dim
    return [x.to(dev), w.to(dev), b.to(dev), n, (0,) * dim, (2,) * dim if dilated else n, transposed, (0,) * dim,
            groups]


@pytest.mark.parametrize("dim, x_format, w_format", [
    (1, False, False), (2, False, False), (2, True, False), (2, False, True), (3, True, False), (3, False, True),
])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # CPU: oneDNN kernels, then its slow ones
def test_convolution_backend_choice_and_layouts_are_cpus(dim, x_format, w_format, transposed, dtype):
    # torch's kernel choice for a tpu convolution is CPU's, and so are the memory formats of the
    # result and of both gradients it implies: eager, and FakeTensor's prediction under compile
    from torch._subclasses.fake_tensor import FakeTensorMode

    groups, dilated = (2, True) if dtype == torch.float64 else (1, False)
    seen = {}
    for dev in ["cpu", "tpu"]:
        args = _conv_case(dim, transposed, groups, dilated, dtype, x_format, w_format, dev)
        backend = torch._C._select_conv_backend(*args)
        out = torch.ops.aten.convolution(*args)
        grads = torch.ops.aten.convolution_backward(
            torch.ones_like(out), args[0], args[1], [6], *args[3:], [True, True, False])
        with FakeTensorMode() as mode:
            fake = torch.ops.aten.convolution(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                for a in args])
        seen[dev] = backend, out, grads, fake.stride()
    (cpu_backend, cpu_out, cpu_grads, cpu_fake), (backend, out, grads, fake) = seen["cpu"], seen["tpu"]
    assert backend == cpu_backend and fake == cpu_fake
    assert out.stride() == cpu_out.stride()
    torch.testing.assert_close(out.cpu(), cpu_out)
    assert grads[2] is None
    for got, want in zip(grads[:2], cpu_grads[:2]):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got.cpu(), want)


def test_a_copy_to_the_host_keeps_a_dense_layout():
    # as a copy from CUDA: channels_last and transposed tensors keep their strides, others are
    # made contiguous
    x = torch.randn(2, 4, 5, 6, device="tpu")
    for t, dense in [(x.contiguous(memory_format=torch.channels_last), True), (x.transpose(1, 3), True),
                     (x[:, :, ::2], False), (x, True)]:
        host = t.cpu()
        assert host.stride() == (t.stride() if dense else torch.empty(t.shape).stride())
        assert torch.equal(host, t.to("cpu", memory_format=torch.contiguous_format))
        assert t.to("cpu", memory_format=torch.contiguous_format).is_contiguous()


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


def test_rrelu_with_noise_in_place_returns_its_argument():
    # rrelu_with_noise_ writes self and noise, and returns self alone, as on CPU
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


def _cpu_and_tpu_error(fn):
    """(type, message) that ``fn(device)`` raises on CPU and on tpu."""
    got = []
    for dev in ("cpu", "tpu"):
        with pytest.raises(Exception) as info:
            fn(dev)
        got.append((type(info.value), str(info.value)))
    return got


@pytest.mark.parametrize("name, write", [
    ("elu_", lambda x: torch.nn.functional.elu_(x)),
    ("silu", lambda x: torch.nn.functional.silu(x, inplace=True)),
    ("mish", lambda x: torch.nn.functional.mish(x, inplace=True)),
    ("hardswish", lambda x: torch.nn.functional.hardswish(x, inplace=True)),
    ("leaky_relu_", lambda x: torch.nn.functional.leaky_relu_(x)),
    ("softplus out", lambda x: torch._C._nn.softplus(x.clone(), out=x)),
    ("add_", lambda x: x.add_(1)),
    ("uniform_", lambda x: x.uniform_()),
])
def test_writing_into_an_expanded_tensor_is_refused_as_on_cpu(name, write):
    # one element of an expanded tensor stands for a whole row: CPU refuses to write it
    (cpu_type, cpu_msg), (tpu_type, tpu_msg) = _cpu_and_tpu_error(
        lambda dev: write(torch.randn(1, 6, device=dev).expand(6, 6)))
    assert cpu_type is tpu_type is RuntimeError
    assert cpu_msg.startswith("unsupported operation") and cpu_msg in tpu_msg


@pytest.mark.parametrize("name, write", [
    ("threshold_", lambda x: torch.nn.functional.threshold_(x, 0.5, 0.5)),
    ("masked_fill_", lambda x: x.masked_fill_(torch.zeros(6, 6, dtype=torch.bool, device=x.device), 1.0)),
    ("fill_", lambda x: x.fill_(2.0)),
])
def test_writes_cpu_allows_into_an_expanded_tensor(name, write):
    # idempotent or fill-like writes are let through on CPU, so they are here
    for dev in ("cpu", "tpu"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            write(torch.randn(1, 6, device=dev).expand(6, 6))


@pytest.mark.parametrize("forward", [
    lambda a: torch.nn.functional.elu_(a, alpha=-2),
    lambda a: torch.nn.functional.celu_(a, alpha=-2),
    lambda a: torch.nn.functional.leaky_relu_(a, -2),
    lambda a: torch.nn.functional.rrelu_(a, -5.0, 1.0),
])
def test_in_place_activation_with_negative_slope_refuses_backward(forward):
    def run(dev):
        a = torch.tensor([-1.0, 1.0], device=dev, requires_grad=True)
        forward(a.clone()).backward(torch.ones(2, device=dev))

    (cpu_type, cpu_msg), (tpu_type, tpu_msg) = _cpu_and_tpu_error(run)
    assert cpu_type is tpu_type is RuntimeError and cpu_msg in tpu_msg


def test_in_place_leaky_relu_with_zero_slope_has_cpu_gradient():
    def grad(dev, dtype):
        a = torch.tensor([-2.0, 0.0, 2.0], device=dev, dtype=dtype, requires_grad=True)
        torch.nn.functional.leaky_relu_(a.clone(), 0.0).backward(torch.ones(3, device=dev, dtype=dtype))
        return a.grad

    for dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(grad("tpu", dtype).cpu(), grad("cpu", dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hardswish_gradient_at_the_ends_of_its_ramp(dtype):
    def grad(dev):
        x = torch.tensor([-3.5, -3.0, -1.0, 0.0, 1.0, 3.0, 3.5], device=dev, dtype=dtype, requires_grad=True)
        torch.nn.functional.hardswish(x).sum().backward()
        return x.grad

    torch.testing.assert_close(grad("tpu").cpu(), grad("cpu"))


@pytest.mark.parametrize("target_shape, weight_shape", [((10, 2), None), ((10,), (4,)), ((10,), (1, 3)), ((3,), None)])
def test_nll_loss_shape_errors_in_cpu_words(target_shape, weight_shape):
    def run(dev):
        x = torch.randn(10, 3, device=dev)
        t = torch.zeros(target_shape, dtype=torch.long, device=dev)
        w = None if weight_shape is None else torch.ones(weight_shape, device=dev)
        torch.nn.functional.nll_loss(x, t, weight=w)

    (cpu_type, cpu_msg), (tpu_type, tpu_msg) = _cpu_and_tpu_error(run)
    assert tpu_type is cpu_type and cpu_msg in tpu_msg


def test_nll_loss_takes_a_uint8_target_as_cpu():
    x = torch.randn(10, 4).log_softmax(-1)
    t = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1], dtype=torch.uint8)
    for reduction in ("none", "mean", "sum"):
        xt = x.to("tpu").requires_grad_()
        xc = x.clone().requires_grad_()
        got = torch.nn.functional.nll_loss(xt, t.to("tpu"), reduction=reduction)
        want = torch.nn.functional.nll_loss(xc, t, reduction=reduction)
        torch.testing.assert_close(got.cpu(), want)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(xt.grad.cpu(), xc.grad)


def test_ctc_loss_refuses_empty_log_probs():
    def run(dev):
        empty = torch.tensor([], device=dev, dtype=torch.long)
        torch.nn.functional.ctc_loss(torch.rand(0, 0, 4, device=dev), empty, empty, empty, reduction="none")

    (cpu_type, cpu_msg), (tpu_type, tpu_msg) = _cpu_and_tpu_error(run)
    assert cpu_type is tpu_type is RuntimeError and cpu_msg in tpu_msg


def test_ctc_loss_with_every_target_empty():
    # each loss is then the blank path's: minus the sum of the blank log-probs
    log_probs = torch.randn(20, 3, 6, dtype=torch.double).log_softmax(2)
    for lengths, targets in (([0, 0, 0], torch.zeros(0, dtype=torch.long)), ([0, 4, 0], torch.tensor([1, 2, 2, 5]))):
        want = torch.nn.functional.ctc_loss(log_probs, targets, [20, 20, 20], lengths, reduction="none")
        got = torch.nn.functional.ctc_loss(log_probs.to("tpu"), targets.to("tpu"), [20, 20, 20], lengths,
                                           reduction="none")
        torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cell", [torch.nn.LSTM, torch.nn.GRU])
def test_rnn_cells_pass_gradcheck_with_and_without_bias(cell, bias):
    # gradcheck also calls the backward with undefined output gradients, which a fused cell
    # must answer with undefined input gradients; bias=False cells have no biases at all
    torch.manual_seed(0)
    mod = cell(3, 3, bias=bias).double().to("tpu")
    x = torch.rand(1, 2, 3, dtype=torch.double, device="tpu", requires_grad=True)

    def flat(inp):
        out, hidden = mod(inp)
        return (out, *hidden) if isinstance(hidden, tuple) else (out, hidden)

    assert torch.autograd.gradcheck(flat, (x,), check_batched_grad=False)
