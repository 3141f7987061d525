"""nn op lowerings (conv, norms, pooling, losses, embeddings, resampling, padding) against CPU.

Every case runs forward and backward on CPU and tpu and asserts the op never fell back to CPU.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import torch_tpu

aten = torch.ops.aten
TOL = dict(rtol=1e-4, atol=1e-5)
# the ops of this family: none of them may fall back to CPU (other families are tested elsewhere)
_NN_OP = re.compile(r"conv|norm|pool|loss|embedding|upsample|pad|shuffle|im2col|col2im|pdist|unpool")


def _leaf(x: torch.Tensor, device: str) -> torch.Tensor:
    y = x.detach().clone().to(device)
    return y.requires_grad_() if y.is_floating_point() else y


def check(fn, *inputs: torch.Tensor, grad: bool = True, **tol) -> None:
    """``fn`` gives the same outputs and input gradients on tpu as on CPU, with no CPU fallback."""
    tol = tol or TOL
    ci = [_leaf(x, "cpu") for x in inputs]
    ti = [_leaf(x, "tpu") for x in inputs]
    torch_tpu.reset_metrics()
    co, to = fn(*ci), fn(*ti)
    co, to = (co, to) if isinstance(co, tuple) else ((co,), (to,))
    for a, b in zip(co, to, strict=True):
        torch.testing.assert_close(b.cpu(), a, **tol)
    if grad:
        for a, b in zip(co, to, strict=True):
            if a.requires_grad:
                w = torch.arange(a.numel(), dtype=a.dtype).reshape(a.shape) % 5 + 1
                a.backward(w, retain_graph=True)
                b.backward(w.to("tpu"), retain_graph=True)
        for a, b in zip(ci, ti, strict=True):
            if a.grad is not None:
                torch.testing.assert_close(b.grad.cpu(), a.grad, **tol)
    mine = {k for k in torch_tpu.metrics()["fallback_counts"] if _NN_OP.search(k)}
    assert not mine, f"fell back to CPU: {mine}"


# ------------------------------------------------------------------------------- convolution
@pytest.mark.parametrize(
    "kw",
    [dict(), dict(stride=2, padding=1), dict(dilation=2, padding=2, groups=2), dict(padding="same", dilation=3)],
)
def test_conv2d(kw):
    w = torch.randn(6, 4 // kw.get("groups", 1), 3, 3)
    check(lambda x, w, b: F.conv2d(x, w, b, **kw), torch.randn(2, 4, 9, 8), w, torch.randn(6))


def test_conv1d_and_conv3d():
    check(lambda x, w: F.conv1d(x, w, stride=3, padding=2), torch.randn(2, 3, 11), torch.randn(5, 3, 4))
    check(lambda x, w, b: F.conv3d(x, w, b, padding=1, stride=(1, 2, 1)), torch.randn(1, 2, 5, 6, 4),
          torch.randn(3, 2, 3, 3, 3), torch.randn(3))


@pytest.mark.parametrize(
    "kw", [dict(), dict(stride=2, padding=1, output_padding=1), dict(groups=2, dilation=2, stride=3)]
)
def test_conv_transpose2d(kw):
    check(lambda x, w, b: F.conv_transpose2d(x, w, b, **kw), torch.randn(2, 4, 5, 6), torch.randn(4, 3, 3, 2),
          torch.randn(3 * kw.get("groups", 1)))


def test_conv_transpose_1d_3d_large_padding():
    check(lambda x, w: F.conv_transpose1d(x, w, stride=2, padding=3), torch.randn(2, 3, 7), torch.randn(3, 2, 2))
    check(lambda x, w: F.conv_transpose3d(x, w, stride=2), torch.randn(1, 2, 3, 3, 2), torch.randn(2, 2, 2, 2, 2))


def test_conv_backward_output_mask():
    x, w = torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3)
    g = torch.randn(2, 4, 4, 4)
    args = ([4], [1, 1], [0, 0], [1, 1], False, [0, 0], 1, [False, True, False])
    c = aten.convolution_backward(g, x, w, *args)
    t = aten.convolution_backward(g.to("tpu"), x.to("tpu"), w.to("tpu"), *args)
    assert t[0] is None and t[2] is None
    torch.testing.assert_close(t[1].cpu(), c[1], **TOL)


def test_conv_errors():
    with pytest.raises(RuntimeError):
        F.conv2d(torch.randn(1, 3, 5, 5, device="tpu"), torch.randn(4, 2, 3, 3, device="tpu"))
    with pytest.raises(RuntimeError):
        F.conv2d(torch.randn(1, 3, 5, 5, device="tpu"), torch.randn(4, 3, 3, 3))


# ----------------------------------------------------------------------------- normalisation
def test_batch_norm_train_updates_running_stats():
    x = torch.randn(4, 3, 5, 5)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    trm, trv = rm.to("tpu"), rv.to("tpu")
    check(lambda x, w, b: F.batch_norm(x, rm if x.device.type == "cpu" else trm, rv if x.device.type == "cpu" else trv,
                                       w, b, training=True, momentum=0.3), x, torch.randn(3), torch.randn(3))
    torch.testing.assert_close(trm.cpu(), rm, **TOL)
    torch.testing.assert_close(trv.cpu(), rv, **TOL)


def test_batch_norm_eval_and_no_stats():
    x = torch.randn(4, 3, 6)
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    check(lambda x, w, b: F.batch_norm(x, rm.to(x.device), rv.to(x.device), w, b, training=False), x,
          torch.randn(3), torch.randn(3))
    check(lambda x: F.batch_norm(x, None, None, training=True), x)


def test_native_batch_norm_eval_saves_nothing():
    x, rm, rv = torch.randn(2, 3, 4), torch.zeros(3), torch.ones(3)
    c = aten.native_batch_norm(x, None, None, rm, rv, False, 0.1, 1e-5)
    t = aten.native_batch_norm(x.to("tpu"), None, None, rm.to("tpu"), rv.to("tpu"), False, 0.1, 1e-5)
    assert [tuple(a.shape) for a in t] == [tuple(a.shape) for a in c]


def test_batch_norm_functional_variants():
    x, w, b, rm, rv = torch.randn(3, 2, 4), torch.randn(2), torch.randn(2), torch.randn(2), torch.rand(2) + 1
    t = [a.to("tpu") for a in (x, w, b, rm, rv)]
    c_out = aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)
    t_out = aten._native_batch_norm_legit_functional(*t, True, 0.1, 1e-5)
    for a, o in zip(c_out, t_out, strict=True):
        torch.testing.assert_close(o.cpu(), a, **TOL)
    torch.testing.assert_close(t[3].cpu(), rm)  # the functional form leaves its inputs alone
    rm2, rv2 = rm.clone(), rv.clone()
    trm2, trv2 = rm2.to("tpu"), rv2.to("tpu")
    c_out = aten._batch_norm_with_update(x, w, b, rm2, rv2, 0.2, 1e-5)
    t_out = aten._batch_norm_with_update(t[0], t[1], t[2], trm2, trv2, 0.2, 1e-5)
    for a, o in zip(c_out[:3], t_out[:3], strict=True):
        torch.testing.assert_close(o.cpu(), a, **TOL)
    torch.testing.assert_close(trm2.cpu(), rm2, **TOL)
    torch.testing.assert_close(trv2.cpu(), rv2, **TOL)


def test_layer_and_group_norm():
    x = torch.randn(3, 4, 5, 6)
    check(lambda x, w, b: F.layer_norm(x, (5, 6), w, b, eps=1e-3), x, torch.randn(5, 6), torch.randn(5, 6))
    check(lambda x: F.layer_norm(x, (6,)), x)
    check(lambda x, w, b: F.group_norm(x, 2, w, b), x, torch.randn(4), torch.randn(4))
    check(lambda x: F.group_norm(x, 4), torch.randn(2, 4, 7))


def test_layer_norm_bf16_accumulates_in_float32():
    x = torch.randn(4, 64).to(torch.bfloat16)
    torch.testing.assert_close(F.layer_norm(x.to("tpu"), (64,)).cpu(), F.layer_norm(x, (64,)), rtol=2e-2, atol=2e-2)


def test_norm_errors():
    with pytest.raises(RuntimeError):
        F.layer_norm(torch.randn(2, 3, device="tpu"), (4,))
    with pytest.raises(RuntimeError):
        F.group_norm(torch.randn(2, 5, 3, device="tpu"), 2)


# ------------------------------------------------------------------------------------ pooling
@pytest.mark.parametrize(
    "kw",
    [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=3, dilation=2, ceil_mode=True)],
)
def test_max_pool2d(kw):
    check(lambda x: F.max_pool2d(x, **kw), torch.randn(2, 3, 9, 10))
    check(lambda x: F.max_pool2d(x, return_indices=True, **kw), torch.randn(3, 9, 10))


def test_max_pool1d_3d():
    check(lambda x: F.max_pool1d(x, 3, 2, 1, return_indices=True), torch.randn(2, 3, 11))
    check(lambda x: F.max_pool3d(x, 2, ceil_mode=True), torch.randn(1, 2, 5, 5, 3))


@pytest.mark.parametrize(
    "kw",
    [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=3, padding=1, ceil_mode=True,
                                                                         count_include_pad=False),
     dict(kernel_size=3, stride=1, padding=1, divisor_override=2)],
)
def test_avg_pool2d(kw):
    check(lambda x: F.avg_pool2d(x, **kw), torch.randn(2, 3, 9, 8))


def test_avg_pool1d_3d():
    check(lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False), torch.randn(2, 3, 10))
    check(lambda x: F.avg_pool3d(x, 2, ceil_mode=True), torch.randn(1, 2, 5, 4, 3))


def test_adaptive_pools():
    x = torch.randn(2, 3, 10, 7)
    check(lambda x: F.adaptive_avg_pool2d(x, (3, 4)), x)
    check(lambda x: F.adaptive_max_pool2d(x, (4, 3), return_indices=True), x)
    check(lambda x: F.adaptive_avg_pool1d(x, 4), torch.randn(2, 3, 9))
    check(lambda x: F.adaptive_max_pool1d(x, 4), torch.randn(2, 3, 9))
    check(lambda x: F.adaptive_avg_pool3d(x, (2, 3, 2)), torch.randn(1, 2, 5, 6, 4))
    check(lambda x: F.adaptive_max_pool3d(x, (2, 3, 2)), torch.randn(1, 2, 5, 6, 4))


def test_max_unpool():
    x = torch.randn(2, 3, 8, 8)
    out, idx = F.max_pool2d(x, 2, return_indices=True)
    check(lambda o: F.max_unpool2d(o, idx.to(o.device), 2), out)


# ------------------------------------------------------------------------------------- losses
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_pointwise_losses(reduction):
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    check(lambda x, y: F.mse_loss(x, y, reduction=reduction), x, y)
    check(lambda x, y: F.l1_loss(x, y, reduction=reduction), x, y)
    check(lambda x, y: F.smooth_l1_loss(x, y, reduction=reduction, beta=0.5), x, y)
    check(lambda x, y: F.smooth_l1_loss(x, y, reduction=reduction, beta=0.0), x, y)
    check(lambda x, y: F.huber_loss(x, y, reduction=reduction, delta=0.7), x, y)
    sign = y.sign()
    check(lambda x: F.soft_margin_loss(x, sign.to(x.device), reduction=reduction), x)
    p, t = torch.rand(4, 5) * 0.98 + 0.01, torch.rand(4, 5)
    w = torch.rand(5)
    check(lambda p, t: F.binary_cross_entropy(p, t, w.to(p.device), reduction=reduction), p, t)
    pw = torch.rand(5)
    check(lambda x, t: F.binary_cross_entropy_with_logits(x, t, w.to(x.device), reduction=reduction,
                                                          pos_weight=pw.to(x.device)), x * 5, t)
    check(lambda x, t: F.kl_div(x, t, reduction="batchmean" if reduction == "mean" else reduction),
          x.log_softmax(-1), t.softmax(-1))


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_and_cross_entropy(reduction):
    x = torch.randn(6, 5).log_softmax(-1)
    t = torch.tensor([0, 4, 2, -100, 1, 2])
    check(lambda x: F.nll_loss(x, t.to(x.device), reduction=reduction), x)
    w, t2 = torch.rand(5), torch.tensor([0, 4, 2, 3, 1, 2])
    check(lambda x: F.nll_loss(x, t2.to(x.device), w.to(x.device), reduction=reduction, ignore_index=2), x)
    x2 = torch.randn(2, 5, 3, 4)
    t2 = torch.randint(0, 5, (2, 3, 4))
    t2[0, 0, 0] = -100
    check(lambda x: F.nll_loss(x, t2.to(x.device), reduction=reduction), x2)
    check(lambda x: F.cross_entropy(x, t2.to(x.device), reduction=reduction, label_smoothing=0.1), x2)
    check(lambda x: F.nll_loss(x, torch.tensor(3, device=x.device), reduction=reduction), torch.randn(5))


def test_loss_errors():
    x = torch.randn(3, 4, device="tpu")
    with pytest.raises(IndexError, match="out of bounds"):
        F.nll_loss(x, torch.tensor([0, 4, 1], device="tpu"))
    with torch_tpu.set_eager_mode("debug"), pytest.raises(RuntimeError, match="between 0 and 1"):
        F.binary_cross_entropy(x.abs() + 1, torch.rand(3, 4, device="tpu"))  # values from the device: at the op
    # outside debug mode, a check on values the device computed is raised at the next host read
    loss = F.binary_cross_entropy(x.abs() + 1, torch.rand(3, 4, device="tpu"))
    with pytest.raises(RuntimeError, match="between 0 and 1.*found on the device after the op"):
        loss.item()
    with pytest.raises(ValueError):
        F.mse_loss(x, torch.randn(3, 4, device="tpu"), reduction="bogus")


def test_margin_losses():
    x = torch.randn(4, 5)
    t = torch.tensor([[3, 0, -1, 1, 2], [1, 2, 3, -1, 0], [0, -1, 2, 2, 2], [-1, 1, 1, 1, 1]])
    check(lambda x: F.multilabel_margin_loss(x, t.to(x.device)), x)
    check(lambda x: F.multilabel_margin_loss(x, t.to(x.device), reduction="none"), x)
    y = torch.tensor([1, 0, 4, 2])
    check(lambda x: F.multi_margin_loss(x, y.to(x.device)), x)
    w = torch.rand(5)
    check(lambda x: F.multi_margin_loss(x, y.to(x.device), p=2, margin=0.5, weight=w.to(x.device), reduction="sum"), x)


# --------------------------------------------------------------------------------- embeddings
def test_embedding():
    w = torch.randn(10, 4)
    idx = torch.tensor([[1, 2, 4], [4, 3, 9]])
    check(lambda w: F.embedding(idx.to(w.device), w), w)
    check(lambda w: F.embedding(idx.to(w.device), w, padding_idx=4, scale_grad_by_freq=True), w)
    with pytest.raises(IndexError):
        F.embedding(torch.tensor([10], device="tpu"), w.to("tpu"))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag(mode):
    w = torch.randn(10, 3)
    idx, off = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9]), torch.tensor([0, 2, 2, 5])
    check(lambda w: F.embedding_bag(idx.to(w.device), w, off.to(w.device), mode=mode), w)
    check(lambda w: F.embedding_bag(idx.to(w.device), w, off.to(w.device), mode=mode, padding_idx=4), w)
    check(lambda w: F.embedding_bag(idx.reshape(2, 4).to(w.device), w, mode=mode), w)
    if mode == "sum":
        last = torch.tensor([0, 2, 2, 5, 8])
        check(lambda w, p: F.embedding_bag(idx.to(w.device), w, last.to(w.device), mode=mode, per_sample_weights=p,
                                           include_last_offset=True), w, torch.rand(8))


@pytest.mark.parametrize("sparse", [False, True])
def test_a_loop_over_padding_indices_matches_cpu_and_compiles_once(sparse):
    """``padding_idx`` is a runtime input of the embedding programs: a loop over padding values
    (as PyTorch's own test of it runs) stops compiling after its first values, not one per value."""
    w = torch.randn(12, 3)
    idx, off = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 11, 0]), torch.tensor([0, 2, 2, 5])

    def step(w: torch.Tensor, pad: int | None) -> list[torch.Tensor]:
        w = w.detach().requires_grad_()
        d = w.device
        outs = [F.embedding_bag(idx.to(d), w, off.to(d), mode=m, padding_idx=pad, sparse=sparse)
                for m in ("sum", "mean")]
        outs.append(F.embedding(idx.to(d), w, padding_idx=pad, sparse=sparse))
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
        return [o.detach() for o in outs] + [w.grad.to_dense()]

    counts = []
    for pad in [None, 0, 1, 2, 3, 4, 5, 9, 11]:
        for got, want in zip(step(w.to("tpu"), pad), step(w, pad), strict=True):
            torch.testing.assert_close(got.cpu(), want, **TOL)
        torch_tpu.sync()
        counts.append(torch_tpu.metrics()["compile_count"])
    assert counts[-1] == counts[3], counts  # the first few values compile (None is -1), then nothing


# ----------------------------------------------------------------------------- resampling/pads
@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "bilinear", "bicubic"])
@pytest.mark.parametrize("size", [(7, 5), (16, 10), (3, 2)])
def test_interpolate_2d(mode, size):
    align = dict(align_corners=False) if mode in ("bilinear", "bicubic") else {}
    check(lambda x: F.interpolate(x, size=size, mode=mode, **align), torch.randn(2, 3, 8, 5))
    if align:
        check(lambda x: F.interpolate(x, size=size, mode=mode, align_corners=True), torch.randn(2, 3, 8, 5))


def test_interpolate_scale_factor_1d_3d():
    check(lambda x: F.interpolate(x, scale_factor=1.7, mode="linear"), torch.randn(2, 3, 6))
    check(lambda x: F.interpolate(x, scale_factor=2.3, mode="nearest"), torch.randn(2, 3, 6))
    check(lambda x: F.interpolate(x, scale_factor=(1.5, 2, 0.7), mode="trilinear"), torch.randn(1, 2, 4, 3, 5))
    check(lambda x: F.interpolate(x, size=(3, 5, 4), mode="nearest"), torch.randn(1, 2, 4, 3, 5))
    check(lambda x: F.interpolate(x, scale_factor=1.3, mode="bilinear", recompute_scale_factor=False),
          torch.randn(1, 2, 5, 5))


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_pads(mode):
    check(lambda x: F.pad(x, (2, 1), mode=mode), torch.randn(2, 3, 5))
    check(lambda x: F.pad(x, (2, 1, 0, 3), mode=mode), torch.randn(2, 3, 5, 4))
    check(lambda x: F.pad(x, (1, 1, 2, 0, 1, 2), mode=mode), torch.randn(1, 2, 3, 4, 5))


def test_pixel_shuffle_unfold_fold_pdist():
    check(lambda x: F.pixel_shuffle(x, 2), torch.randn(2, 8, 3, 4))
    check(lambda x: F.pixel_unshuffle(x, 2), torch.randn(2, 2, 6, 4))
    check(lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=2), torch.randn(2, 3, 7, 8))
    check(lambda x: F.fold(x, (5, 6), (2, 2), padding=1), torch.randn(2, 12, 42))
    for p in (1.0, 2.0, 3.0, float("inf")):
        check(lambda x, p=p: F.pdist(x, p), torch.randn(5, 4))


def test_no_warnings_from_lowered_ops():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.conv2d(torch.randn(1, 1, 4, 4, device="tpu"), torch.randn(1, 1, 2, 2, device="tpu"))


@pytest.mark.parametrize("shape,k,o", [((2, 3, 9, 9), (2, 2), (4, 4)), ((3, 10, 7), (3, 2), (5, 3)),
                                       ((2, 3, 9, 8), (3, 3), (1, 2))])
def test_fractional_max_pool2d_matches_cpu_with_the_same_samples(shape, k, o):
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    samples = torch.rand(shape[0] if len(shape) == 4 else 1, shape[-3], 2)
    want, want_idx = torch.ops.aten.fractional_max_pool2d(x, k, o, samples)
    xt = x.detach().to("tpu").requires_grad_()
    got, got_idx = torch.ops.aten.fractional_max_pool2d(xt, k, o, samples.to("tpu"))
    torch.testing.assert_close(got.cpu(), want)
    assert torch.equal(got_idx.cpu(), want_idx)
    want.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)
    assert torch_tpu.metrics()["fallback_counts"].get("aten.fractional_max_pool2d.output") is None


def test_fractional_max_pool3d_matches_cpu():
    torch.manual_seed(0)
    x, samples = torch.randn(2, 3, 7, 8, 9), torch.rand(2, 3, 3)
    want, want_idx = torch.ops.aten.fractional_max_pool3d(x, (2, 3, 2), (3, 4, 5), samples)
    got, got_idx = torch.ops.aten.fractional_max_pool3d(x.to("tpu"), (2, 3, 2), (3, 4, 5), samples.to("tpu"))
    torch.testing.assert_close(got.cpu(), want)
    assert torch.equal(got_idx.cpu(), want_idx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2, 3])
def test_fractional_max_pool_low_precision_windows_as_cpu(n, dtype):
    """CPU computes the window starts in the input's dtype, rounding at each step: in bfloat16 and
    float16 its windows differ from those float32 arithmetic gives, for some samples."""
    torch.manual_seed(0)
    pool = getattr(torch.nn.functional, f"fractional_max_pool{n}d")
    for _ in range(6):
        x, samples = torch.randn(2, 3, *(9, 7, 11)[:n]).to(dtype), torch.rand(2, 3, n).to(dtype)
        want, want_idx = pool(x, 2, output_size=(4, 5, 6)[:n], _random_samples=samples, return_indices=True)
        got, got_idx = pool(x.to("tpu"), 2, output_size=(4, 5, 6)[:n], _random_samples=samples.to("tpu"),
                            return_indices=True)
        assert torch.equal(got_idx.cpu(), want_idx)
        assert torch.equal(got.cpu(), want)


def test_binomial_on_device_as_cpu_draws():
    """Successes out of ``count`` trials (torch.distributions.Binomial), in count's dtype: CPU's edges
    (a count <= 0 gives 0, a probability >= 1 gives the count) exactly, the mean within noise, CPU's
    dtype errors, and nothing on CPU."""
    torch.manual_seed(0)
    before = torch_tpu.metrics()["fallback_counts"].get("aten.binomial.default")
    count = torch.tensor([10.0, 5.0, 0.0, -1.0, 20.0] * 800)
    prob = torch.tensor([0.5, 1.0, 0.3, 0.5, 1.5] * 800)
    draws = torch.binomial(count.to("tpu"), prob.to("tpu")).cpu()
    cpu = torch.binomial(count, prob)
    assert draws.dtype == cpu.dtype == torch.float32
    edges = torch.tensor([False, True, True, True, True] * 800)
    assert torch.equal(draws[edges], cpu[edges])
    assert torch.equal(draws, draws.round()) and ((draws >= 0) & (draws <= count.clamp(min=0))).all()
    assert abs(draws[0::5].mean().item() - 5.0) < 0.15  # 800 draws of B(10, 0.5): sd of the mean 0.056
    sample = torch.distributions.Binomial(10, torch.full((3, 4), 0.25, device="tpu")).sample()
    assert sample.shape == (3, 4) and sample.device.type == "tpu"
    assert torch_tpu.metrics()["fallback_counts"].get("aten.binomial.default") == before
    for args in ((torch.tensor([10, 5]), torch.tensor([0.5, 0.5])),
                 (torch.tensor([1.0, 5.0]).double(), torch.tensor([0.5, 0.5]))):
        with pytest.raises((ValueError, RuntimeError)) as on_cpu:
            torch.binomial(*args)
        with pytest.raises(type(on_cpu.value), match=re.escape(str(on_cpu.value))):
            torch.binomial(*[a.to("tpu") for a in args])


def test_poisson_on_device():
    torch.manual_seed(0)
    rate = torch.rand(4000) * 4
    rate[:10] = 0
    counts = torch.poisson(rate.to("tpu")).cpu()
    assert counts.dtype == torch.float32
    assert torch.equal(counts, counts.round()) and (counts[:10] == 0).all()
    assert abs(counts.mean().item() - rate.mean().item()) < 0.1
    assert torch_tpu.metrics()["fallback_counts"].get("aten.poisson.default") is None
    with pytest.raises(RuntimeError, match="invalid Poisson rate"):
        torch.poisson(torch.tensor([1.0, -1.0]).to("tpu")).cpu()


def test_int_mm_is_exact_with_cpu_errors():
    """``torch._int_mm`` (int8 or uint8 by int8, int32 results: torchao's quantised linears) equals
    CPU bit for bit, with CPU's refusals, and nothing on CPU."""
    g = torch.Generator().manual_seed(0)
    b = torch.randint(-128, 128, (70, 17), dtype=torch.int8, generator=g)
    for a in (torch.randint(-128, 128, (33, 70), dtype=torch.int8, generator=g),
              torch.randint(0, 256, (33, 70), dtype=torch.uint8, generator=g)):
        try:
            torch._int_mm(a, b)
        except RuntimeError:  # uint8 is refused before torch 2.13
            with pytest.raises(RuntimeError):
                torch._int_mm(a.to("tpu"), b.to("tpu"))
            continue
        got = torch._int_mm(a.to("tpu"), b.to("tpu"))
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), torch._int_mm(a, b))
    assert torch_tpu.metrics()["fallback_counts"].get("aten._int_mm.default") is None
    a = torch.randint(-128, 128, (3, 70), dtype=torch.int8, generator=g)
    for args in ((a.int(), b), (a, b[:3]), (a[0], b), (a, b.int()), (a, b[0]), (a, b[None]), (a, b[0, 0])):
        with pytest.raises((RuntimeError, IndexError)) as on_cpu:
            torch._int_mm(*args)
        with pytest.raises(type(on_cpu.value), match=re.escape(str(on_cpu.value))):
            torch._int_mm(*[t.to("tpu") for t in args])


def test_gamma_rsample_gradient_on_device():
    """``Gamma.rsample`` backward (``_standard_gamma_grad``): the reparameterised derivative, within
    CPU's approximation of it, computed on the device."""
    torch.manual_seed(0)
    alpha = torch.rand(2000) * 3 + 0.1
    draws = torch._standard_gamma(alpha)
    want = torch._standard_gamma_grad(alpha, draws)
    got = torch._standard_gamma_grad(alpha.to("tpu"), draws.to("tpu")).cpu()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-5)
    a = torch.ones(3, device="tpu", requires_grad=True)
    torch.distributions.Gamma(a, 1.0).rsample().sum().backward()
    assert a.grad.shape == (3,) and torch.isfinite(a.grad).all()
    assert torch_tpu.metrics()["fallback_counts"].get("aten._standard_gamma_grad.default") is None


def test_assert_async_checks_without_waiting():
    """``torch._assert_async``: CPU's errors for a zero value, a message, and element counts; a value
    the device computes is checked with the step and raises at the next host read, naming the line."""
    torch._assert_async(torch.tensor(True, device="tpu"))
    torch._assert_async(torch.tensor(3, device="tpu") > 1, "fine")
    for fn in (lambda d: torch._assert_async(torch.tensor(0, device=d)),
               lambda d: torch._assert_async(torch.tensor([1, 1], device=d)),
               lambda d: torch._assert_async(torch.tensor([], device=d)),
               lambda d: torch._assert_async(torch.tensor(0.0, device=d), "my message")):
        with pytest.raises(RuntimeError) as on_cpu:
            fn("cpu")
        with pytest.raises(RuntimeError, match=re.escape(str(on_cpu.value))):
            fn("tpu")
            torch.tpu.synchronize()
    x = torch.zeros(3, device="tpu")
    torch._assert_async(x.sum() > 1, "the sum is too small")  # computed on the device: nothing waits here
    with pytest.raises(RuntimeError, match=r"the sum is too small \(found on the device after the op, called at "):
        x.cpu()
    assert torch_tpu.metrics()["fallback_counts"].get("aten._assert_async.msg") is None


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("needs", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dims", [2, 3])
def test_grid_sample_backward_whichever_of_input_and_grid_needs_a_gradient(dims, needs, mode):
    """A fixed sampling grid (a spatial transformer's without a learned grid) asks the backward
    for the input's gradient alone; CPU's kernel still returns the grid's, and so must ours (it
    returned one result where two were expected and raised)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn((1, 2) + (3,) * dims, generator=g)
    grid = torch.rand((1,) + (2,) * dims + (dims,), generator=g) * 2 - 1
    grads = []
    for device in ("cpu", "tpu"):
        with torch_tpu.set_eager_mode(mode):
            xi = x.detach().to(device).requires_grad_(needs[0])
            gi = grid.detach().to(device).requires_grad_(needs[1])
            out = F.grid_sample(xi, gi, align_corners=False)
            out.backward(torch.ones_like(out))
            grads.append([None if t.grad is None else t.grad.cpu() for t in (xi, gi)])
    for want, got in zip(*grads):
        assert (want is None) == (got is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
