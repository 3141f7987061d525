"""torch.compile(backend="tpu") trains convolutional models: the graphs' backward ops
(``convolution_backward``, batch norm's backward, pooling's) are served by the same table entries
as in eager mode, and the losses and weights follow CPU's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torch_tpu

RTOL, ATOL = 1e-4, 1e-4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(8, 4),
    )


class _TinyUNet(nn.Module):
    """Down by a strided convolution, up by a transposed one, a skip connection between."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU())
        self.down = nn.Conv2d(6, 12, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(12, 6, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(12, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        u = self.up(torch.relu(self.down(e)))
        return self.dec(torch.cat([e, u], dim=1))


def _train_both(model: nn.Module, x: torch.Tensor, loss_fn, steps: int = 3) -> None:
    cpu = model
    tpu = copy.deepcopy(model).to("tpu")
    compiled = torch.compile(tpu, backend="tpu")
    oc = torch.optim.SGD(cpu.parameters(), lr=0.05, momentum=0.9)
    ot = torch.optim.SGD(tpu.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        losses = []
        for m, o, dev in ((cpu, oc, "cpu"), (compiled, ot, "tpu")):
            o.zero_grad()
            loss = loss_fn(m(x.to(dev)), dev)
            loss.backward()
            o.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=RTOL, abs=ATOL), f"step {step}: {losses}"
    for (name, a), b in zip(cpu.state_dict().items(), tpu.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def test_conv_batchnorm_pool_model_trains_compiled_as_on_cpu():
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    _train_both(_small_cnn(), x, lambda out, dev: nn.functional.cross_entropy(out, y.to(dev)))
    assert "aten.convolution_backward.default" not in torch_tpu.metrics()["fallback_counts"]


def test_unet_with_transposed_convolution_trains_compiled_as_on_cpu():
    torch.manual_seed(2)
    x, target = torch.randn(2, 2, 8, 8), torch.randn(2, 1, 8, 8)
    _train_both(_TinyUNet(), x, lambda out, dev: nn.functional.mse_loss(out, target.to(dev)))


@pytest.mark.parametrize("conv", [nn.Conv1d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose3d])
def test_other_convolutions_backward_compiled(conv):
    torch.manual_seed(3)
    dims = {nn.Conv1d: 1, nn.ConvTranspose1d: 1}.get(conv, 3)
    model = conv(2, 3, 3, padding=1)
    x = torch.randn(2, 2, *([5] * dims))
    _train_both(model, x, lambda out, dev: out.square().mean(), steps=2)


def test_batch_norm_eval_saved_statistics_shape_as_on_cpu():
    """In eval mode CPU saves no statistics (shape (0,)); torch's meta kernel says (C,)."""
    x, w, b = torch.randn(3, 2, 4), torch.randn(2), torch.randn(2)
    rm, rv = torch.randn(2), torch.rand(2) + 0.5

    def f(*a):
        return torch.native_batch_norm(*a, False, 0.1, 1e-5)

    want = f(x, w, b, rm, rv)
    got = torch.compile(f, backend="tpu")(*(t.to("tpu") for t in (x, w, b, rm, rv)))
    for g, c in zip(got, want):
        assert tuple(g.shape) == tuple(c.shape)
        torch.testing.assert_close(g.cpu(), c, rtol=RTOL, atol=ATOL)
