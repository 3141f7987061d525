"""Layer-level parity: torch.nn modules on tpu (a deepcopy of the CPU module) match CPU.

Forward outputs and every parameter and input gradient are compared; a few short training runs
check that losses and weights stay equal through optimizer steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

TOL = dict(rtol=1e-4, atol=1e-5)


def _cotangent(out: torch.Tensor) -> torch.Tensor:
    return (torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape) % 7 - 3) / 3


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def check_module(module: nn.Module, *inputs: torch.Tensor, call=None, tol=None) -> nn.Module:
    """Forward and backward of ``module`` agree on CPU and tpu; returns the tpu module."""
    tol = tol or TOL
    call = call or (lambda m, *xs: _first(m(*xs)))
    tpu_module = copy.deepcopy(module).to("tpu")
    cx = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    tx = [x.detach().to("tpu").requires_grad_(x.is_floating_point()) for x in inputs]
    co, to = call(module, *cx), call(tpu_module, *tx)
    torch.testing.assert_close(to.cpu(), co, **tol)
    w = _cotangent(co)
    co.backward(w)
    to.backward(w.to("tpu"))
    for a, b in zip(cx, tx, strict=True):
        if a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, **tol)
    for (name, p), q in zip(module.named_parameters(), tpu_module.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad.cpu(), p.grad, **tol, msg=lambda m, name=name: f"{name}: {m}")
    for (name, b), c in zip(module.named_buffers(), tpu_module.buffers(), strict=True):
        torch.testing.assert_close(c.cpu(), b, **tol, msg=lambda m, name=name: f"buffer {name}: {m}")
    return tpu_module


def test_linear():
    check_module(nn.Linear(7, 5), torch.randn(3, 7))
    check_module(nn.Linear(7, 5, bias=False), torch.randn(2, 3, 7))


@pytest.mark.parametrize(
    "module,shape",
    [
        (nn.Conv1d(3, 4, 3, stride=2, padding=1), (2, 3, 10)),
        (nn.Conv2d(4, 6, 3, padding=1, groups=2), (2, 4, 7, 6)),
        (nn.Conv2d(3, 4, (3, 2), stride=(2, 1), dilation=(1, 2), padding_mode="reflect", padding=1), (2, 3, 8, 8)),
        (nn.Conv3d(2, 3, 3, padding=1), (1, 2, 4, 5, 3)),
        (nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1), (2, 4, 5, 5)),
    ],
)
def test_conv_layers(module, shape):
    check_module(module, torch.randn(shape))


@pytest.mark.parametrize("train", [True, False])
def test_batch_norm(train):
    cases = ((nn.BatchNorm1d(4), (6, 4)), (nn.BatchNorm1d(4), (3, 4, 5)), (nn.BatchNorm2d(3), (4, 3, 5, 5)))
    for module, shape in cases:
        module.running_mean.uniform_(-1, 1)
        module.running_var.uniform_(0.5, 2)
        module.train(train)
        tpu_module = check_module(module, torch.randn(shape))
        assert int(tpu_module.num_batches_tracked.cpu()) == int(module.num_batches_tracked)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.LazyLinear(4), (2, 3)),
    (lambda: nn.LazyConv1d(4, 3), (2, 3, 7)),
    (lambda: nn.LazyConvTranspose2d(2, 3), (1, 3, 4, 4)),
    (lambda: nn.LazyBatchNorm1d(), (5, 3)),
])
def test_a_lazy_module_moved_before_its_first_forward_materialises_on_tpu(make, shape):
    """As on CUDA: .to("tpu") before the first forward keeps the parameters uninitialised, and the
    first forward makes them on tpu; with CPU's weights loaded, the outputs are CPU's."""
    x = torch.randn(shape)
    cpu = make()
    cpu(x)  # materialises CPU's weights
    tpu = make().to("tpu")
    assert all(isinstance(p, nn.parameter.UninitializedParameter) and p.device.type == "tpu"
               for p in tpu.parameters())
    assert tpu(x.to("tpu")).device.type == "tpu"
    assert all(type(p) is nn.Parameter and p.device.type == "tpu" for p in tpu.parameters())
    tpu.load_state_dict(cpu.state_dict())
    torch.testing.assert_close(tpu(x.to("tpu")).cpu(), cpu(x), rtol=1e-4, atol=1e-5)
    back = make().to("tpu").to("cpu")  # and back, still uninitialised
    assert all(isinstance(p, nn.parameter.UninitializedParameter) and p.device.type == "cpu"
               for p in back.parameters())
    assert back(x).shape == cpu(x).shape


def test_norm_layers():
    check_module(nn.LayerNorm((5, 6)), torch.randn(3, 4, 5, 6))
    check_module(nn.GroupNorm(2, 4), torch.randn(3, 4, 5, 6))
    check_module(nn.RMSNorm(6), torch.randn(3, 4, 6))
    check_module(nn.InstanceNorm2d(3, affine=True), torch.randn(2, 3, 5, 5))


def test_weight_norm_gradients_on_the_device():
    """``weight_norm``'s backward (``_weight_norm_interface_backward``, which has no torch
    decomposition) ran on CPU; it is a lowering now, with CPU's gradients for both parameters."""
    import torch_tpu

    torch.manual_seed(0)
    before = dict(torch_tpu.metrics()["fallback_counts"])
    for dim in (0, 1):
        cases = ((lambda: nn.Linear(4, 3), torch.randn(2, 4)), (lambda: nn.Conv1d(3, 5, 3), torch.randn(2, 3, 7)))
        for make, x in cases:
            check_module(nn.utils.parametrizations.weight_norm(make(), dim=dim), x, tol=dict(rtol=1e-4, atol=2e-5))
            check_module(nn.utils.parametrizations.weight_norm(make().double(), dim=dim), x.double(),
                         tol=dict(rtol=1e-12, atol=1e-12))
    assert torch_tpu.metrics()["fallback_counts"] == before


def test_embeddings():
    idx = torch.tensor([[1, 2, 4], [4, 3, 9]])
    check_module(nn.Embedding(10, 4, padding_idx=3), idx)
    check_module(nn.EmbeddingBag(10, 4, mode="mean"), idx)
    check_module(nn.EmbeddingBag(10, 4, mode="max"), torch.tensor([1, 2, 4, 4, 3]), torch.tensor([0, 2]))


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_recurrent(cls):
    # batch_first GRU uses aten.transpose_, a core in-place view op (its kernel is not in this family)
    check_module(cls(5, 6, num_layers=2, batch_first=cls is nn.LSTM), torch.randn(3, 4, 5))
    check_module(cls(5, 6, bidirectional=True), torch.randn(4, 2, 5))


def test_attention():
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    q, k = torch.randn(2, 5, 8), torch.randn(2, 6, 8)
    check_module(mha, q, k, k, call=lambda m, q, k, v: m(q, k, v)[0])
    mha.zero_grad(set_to_none=True)
    check_module(mha, q, call=lambda m, q: m(q, q, q, need_weights=False)[0])
    q, k, v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    sdpa = F.scaled_dot_product_attention
    check_module(nn.Identity(), q, k, v, call=lambda m, q, k, v: sdpa(q, k, v, is_causal=True))
    mask = torch.rand(5, 5) > 0.3
    mask.fill_diagonal_(True)
    check_module(nn.Identity(), q, k, v,
                 call=lambda m, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.device)))


def _eval_parity(module: nn.Module, *inputs, **kwargs):
    """An eval-mode forward without autograd (torch's transformer fast path) on CPU and tpu: the
    same outputs (NaN where CPU's are), on the device, with no op sent through the CPU fallback."""
    import torch_tpu

    module = module.eval()
    with torch.no_grad():
        ref = module(*inputs, **kwargs)
        dev = copy.deepcopy(module).to("tpu")
        before = dict(torch_tpu.metrics()["fallback_counts"])
        got = dev(*[x.to("tpu") if isinstance(x, torch.Tensor) else x for x in inputs],
                  **{k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    assert torch_tpu.metrics()["fallback_counts"] == before
    refs, gots = (ref, got) if isinstance(ref, tuple) else ((ref,), (got,))
    for r, g in zip(refs, gots, strict=True):
        if r is None:
            assert g is None  # CPU's kernel returns no weights without need_weights
            continue
        assert g.device.type == "tpu" and g.shape == r.shape
        torch.testing.assert_close(g.cpu(), r, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_transformer_fast_path_runs_on_the_device_as_cpu():
    """Eval-mode nn.MultiheadAttention / TransformerEncoderLayer call torch's fused fast-path ops
    (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``), which tpu served
    through the CPU fallback; they are device programs now, with CPU's results."""
    torch.manual_seed(0)
    E = 16
    x, mem = torch.randn(3, 5, E), torch.randn(3, 4, E)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [True] * 5])  # the last row fully masked
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    mha = nn.MultiheadAttention(E, 4, batch_first=True)
    _eval_parity(mha, x, x, x)  # weights averaged over heads
    _eval_parity(mha, x, x, x, need_weights=False)
    _eval_parity(mha, x, x, x, need_weights=True, average_attn_weights=False)
    _eval_parity(mha, x, mem, mem)  # cross attention: another key length
    _eval_parity(mha, x, x, x, key_padding_mask=padding)  # NaN for the fully masked row, as on CPU
    _eval_parity(mha, x, x, x, attn_mask=causal.bool())
    _eval_parity(mha, x, x, x, attn_mask=causal.bool(), key_padding_mask=padding[:2].repeat(2, 1)[:3])
    for norm_first, activation in ((False, "relu"), (True, "gelu")):
        layer = nn.TransformerEncoderLayer(E, 4, 32, batch_first=True, norm_first=norm_first, activation=activation)
        _eval_parity(layer, x)
        _eval_parity(layer, x, src_mask=causal, is_causal=True)
        _eval_parity(layer, x[:2], src_key_padding_mask=padding[:2])
        _eval_parity(layer, torch.randn(0, 5, E))
    _eval_parity(nn.Transformer(E, 4, 1, 1, 32, batch_first=True), x, mem)


def test_pooling_layers():
    x = torch.randn(2, 3, 9, 8)
    check_module(nn.MaxPool2d(3, 2, 1), x)
    check_module(nn.AvgPool2d(3, 2, 1), x)
    check_module(nn.AdaptiveAvgPool2d((4, 3)), x)
    check_module(nn.AdaptiveMaxPool2d(2), x)
    check_module(nn.MaxPool1d(2), torch.randn(2, 3, 9))


@pytest.mark.parametrize(
    "loss,make",
    [
        (nn.MSELoss(), lambda: (torch.randn(4, 5), torch.randn(4, 5))),
        (nn.L1Loss(), lambda: (torch.randn(4, 5), torch.randn(4, 5))),
        (nn.SmoothL1Loss(beta=0.5), lambda: (torch.randn(4, 5), torch.randn(4, 5))),
        (nn.HuberLoss(delta=0.5), lambda: (torch.randn(4, 5), torch.randn(4, 5))),
        (nn.CrossEntropyLoss(label_smoothing=0.1), lambda: (torch.randn(4, 5), torch.tensor([0, 3, 4, 1]))),
        (nn.NLLLoss(), lambda: (torch.randn(4, 5).log_softmax(-1), torch.tensor([0, 3, 4, 1]))),
        (nn.BCELoss(), lambda: (torch.rand(4, 5) * 0.9 + 0.05, torch.rand(4, 5))),
        (nn.BCEWithLogitsLoss(), lambda: (torch.randn(4, 5), torch.rand(4, 5))),
        (nn.KLDivLoss(reduction="batchmean"), lambda: (torch.randn(4, 5).log_softmax(-1), torch.rand(4, 5))),
        (nn.SoftMarginLoss(), lambda: (torch.randn(4, 5), torch.randn(4, 5).sign())),
        (nn.MultiLabelSoftMarginLoss(), lambda: (torch.randn(4, 5), (torch.rand(4, 5) > 0.5).float())),
        (nn.MultiMarginLoss(), lambda: (torch.randn(4, 5), torch.tensor([0, 3, 4, 1]))),
    ],
)
def test_losses(loss, make):
    x, target = make()
    check_module(loss, x, call=lambda m, x: m(x, target.to(x.device)))


# --------------------------------------------------------------------------- training parity
def _train(model: nn.Module, batches, loss_fn, steps: int = 4, lr: float = 0.05) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in batches[:steps]:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _training_parity(model: nn.Module, batches, loss_fn, rel: float = 1e-4) -> None:
    tpu_model = copy.deepcopy(model).to("tpu")
    tpu_batches = [(x.to("tpu"), y.to("tpu")) for x, y in batches]
    cpu_losses = _train(model, batches, loss_fn)
    tpu_losses = _train(tpu_model, tpu_batches, loss_fn)
    torch.testing.assert_close(torch.tensor(tpu_losses), torch.tensor(cpu_losses), rtol=rel, atol=1e-6)
    for (name, p), q in zip(model.state_dict().items(), tpu_model.state_dict().values(), strict=True):
        torch.testing.assert_close(q.cpu(), p, rtol=rel, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_train_mlp():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    batches = [(torch.randn(10, 8), torch.randint(0, 3, (10,))) for _ in range(4)]
    _training_parity(model, batches, F.cross_entropy)


def test_train_cnn_with_batch_norm():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 4),
    )
    batches = [(torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))) for _ in range(4)]
    _training_parity(model, batches, F.cross_entropy)


class _LSTMRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


def test_train_lstm():
    batches = [(torch.randn(5, 6, 4), torch.randn(5, 1)) for _ in range(4)]
    _training_parity(_LSTMRegressor(), batches, F.mse_loss)


class _TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(x))).flatten(0, 1)


def test_train_transformer():
    batches = [(torch.randint(0, 20, (3, 7)), torch.randint(0, 20, (21,))) for _ in range(4)]
    _training_parity(_TinyTransformer(), batches, F.cross_entropy)


def test_rrelu_runs_on_the_device_as_cpu():
    """RReLU: eval mode is CPU's leaky ReLU exactly; in training each element <= 0 is scaled by its
    own draw from [lower, upper), which the noise keeps (1 elsewhere) and the gradient is; in
    place, under torch.compile, and with CPU's errors; nothing runs on CPU."""
    import torch_tpu
    from tests.conftest import assert_same

    before = dict(torch_tpu.metrics()["fallback_counts"])
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = torch.randn(200).to(dtype)
        for lo, hi in ((0.125, 1 / 3), (0.1, 0.3)):
            assert_same(F.rrelu(x.to("tpu"), lo, hi, training=False), F.rrelu(x, lo, hi, training=False))
    x = torch.tensor([-1.0, 0.0, 1.0, 2.0, -3.0, -0.5] * 100)
    noise = torch.full_like(x, 7.0).to("tpu")
    out = torch.ops.aten.rrelu_with_noise(x.to("tpu"), noise, 0.1, 0.3, True).cpu()
    noise, neg = noise.cpu(), x <= 0
    assert ((noise[neg] >= 0.1) & (noise[neg] < 0.3)).all() and (noise[~neg] == 1).all()
    assert abs(noise[neg].mean().item() - 0.2) < 0.01  # uniform: 400 draws
    assert torch.equal(out, x * noise)
    xt = torch.randn(64, device="tpu", requires_grad=True)
    y = nn.RReLU(0.1, 0.3)(xt)
    y.sum().backward()
    slope = (y / xt).detach()
    assert torch.allclose(xt.grad, slope)
    assert ((slope >= 0.1) & (slope <= 1)).all()
    xi = torch.randn(64, device="tpu")
    kept = xi.clone()
    assert F.rrelu(xi, 0.1, 0.3, training=True, inplace=True) is xi
    assert torch.equal(xi[kept > 0], kept[kept > 0]) and not torch.equal(xi, kept)
    draws = []
    for _ in range(2):
        torch.manual_seed(3)
        draws.append(F.rrelu(torch.full((8,), -1.0, device="tpu"), training=True).cpu())
    assert torch.equal(*draws)
    compiled = torch.compile(lambda t: F.rrelu(t, training=True) * 2, backend="tpu")
    r = compiled(torch.full((16,), -1.0, device="tpu")).cpu()
    assert ((r <= -0.25) & (r > -2 / 3)).all()
    assert dict(torch_tpu.metrics()["fallback_counts"]) == before
    for f in (lambda d: F.rrelu(torch.randn(5, device=d), 0.5, 0.2, training=True),
              lambda d: torch.ops.aten.rrelu_with_noise(torch.randn(5, device=d), torch.empty(3, device=d), 0.1, 0.3,
                                                        True),
              lambda d: torch.ops.aten.rrelu_with_noise(torch.randn(5, device=d),
                                                        torch.empty(5, dtype=torch.float64, device=d), 0.1, 0.3, True)):
        with pytest.raises(RuntimeError) as cpu:
            f("cpu")
        with pytest.raises(RuntimeError) as tpu:
            f("tpu")
        assert str(cpu.value) in str(tpu.value)
