"""Nested tensors (``torch.nested``, strided layout) on tpu, against the same code on CPU.

torch registers no nested-tensor kernel for a PrivateUse1 backend: before this, a nested tpu tensor
could be made but not read, and ``nn.TransformerEncoder`` in eval mode with a padding mask (torch's
fast path packs the batch into nested tensors) raised "NestedTensorImpl doesn't support sizes".
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torch_tpu

pytestmark = [
    pytest.mark.skipif(not torch_tpu.core.extension.available(),
                       reason=f"torch_tpu's C++ extension: {torch_tpu.core.extension.why_not()}"),
    pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage"),
    pytest.mark.filterwarnings("ignore:tpu. .* has no lowering"),
    pytest.mark.filterwarnings("ignore:enable_nested_tensor is True"),
]


def _parts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 6, generator=g), torch.randn(3, 6, generator=g), torch.randn(1, 6, generator=g)]


def _same(tpu: torch.Tensor, cpu: torch.Tensor) -> None:
    assert tpu.is_nested == cpu.is_nested
    if cpu.is_nested:
        assert tpu.device.type == "tpu"
        assert torch.equal(tpu._nested_tensor_size(), cpu._nested_tensor_size())
        for a, b in zip(tpu.unbind(), cpu.unbind(), strict=True):
            torch.testing.assert_close(a.cpu(), b)
    else:
        torch.testing.assert_close(tpu.cpu(), cpu)


def test_a_nested_tpu_tensor_is_made_read_and_moved_as_on_cpu():
    parts = _parts()
    cpu = torch.nested.nested_tensor(parts)
    made = [torch.nested.nested_tensor(parts, device="tpu"), cpu.to("tpu"),
            torch.nested.as_nested_tensor([p.to("tpu") for p in parts])]
    for t in made:
        _same(t, cpu)
        assert t.dim() == cpu.dim() and t.size(0) == cpu.size(0)
        assert torch.equal(t._nested_tensor_strides(), cpu._nested_tensor_strides())
        back = t.cpu()
        assert back.device.type == "cpu" and back.is_nested
        _same(t, back)
    _same(made[0].to(torch.float64), cpu.to(torch.float64))
    _same(made[0].clone(), cpu.clone())
    assert made[0].detach().is_nested and made[0].detach().device.type == "tpu"
    empty = torch.nested.nested_tensor([torch.rand(0, 4, dtype=torch.float64)], device="tpu")
    assert empty.cpu().unbind()[0].shape == (0, 4)


def test_views_of_a_nested_tpu_tensor_share_its_buffer():
    parts = _parts(1)
    cpu = torch.nested.nested_tensor(parts)
    views = [lambda t: t.unsqueeze(1), lambda t: t.transpose(1, 2), lambda t: t.select(0, 1),
             lambda t: t.view(3, -1, 3, 2), lambda t: t.unsqueeze(2).squeeze(2), lambda t: t.values(),
             lambda t: t.chunk(2, dim=-1)[1], lambda t: t.reshape(3, -1, 2, 3)]
    for view in views:
        _same(view(cpu.to("tpu")), view(cpu))
    t = cpu.to("tpu")
    t.unsqueeze(1).mul_(3)  # a write through a view reaches the base, as on CPU
    _same(t, cpu * 3)
    with pytest.raises(RuntimeError, match="only dim=0 supported"):  # CPU's own refusal, in CPU's words
        t.narrow(2, 1, 3)


def test_other_ops_run_on_cpu_counted_and_come_back_nested():
    parts = _parts(2)
    cpu = torch.nested.nested_tensor(parts)
    t = cpu.to("tpu")
    before = torch_tpu.metrics()["fallback_counts"].get("aten.relu.default", 0)
    _same(torch.relu(t - 0.5), torch.relu(cpu - 0.5))
    assert torch_tpu.metrics()["fallback_counts"]["aten.relu.default"] == before + 1
    _same(t.softmax(-1), cpu.softmax(-1))
    _same(torch.nested.to_padded_tensor(t, -1.0), torch.nested.to_padded_tensor(cpu, -1.0))
    t.mul_(2)  # in place: the tpu tensor itself holds the result
    _same(t, cpu * 2)
    with pytest.raises(RuntimeError) as on_cpu:
        torch.nested.to_padded_tensor(cpu, 0.0, output_size=(3, 1, 1))
    with pytest.raises(RuntimeError) as on_tpu:  # CPU's own error, type and words, through the fallback
        torch.nested.to_padded_tensor(t, 0.0, output_size=(3, 1, 1))
    assert str(on_tpu.value) == str(on_cpu.value)


def test_gradients_flow_through_nested_tpu_tensors():
    grads = []
    for device in ("cpu", "tpu"):
        nt = torch.nested.nested_tensor(_parts(3), device=device, requires_grad=True)
        torch.nested.to_padded_tensor((nt * 2).relu(), 0.0).sum().backward()
        grads.append(nt.grad)
    _same(grads[1], grads[0])


def test_transformer_encoder_fast_path_with_a_padding_mask_gives_cpus_result():
    """torch's eval fast path packs the padded batch into nested tensors and lists PrivateUse1 as
    a device it serves; tpu runs it (through CPU) and gives CPU's numbers, masked rows included."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True), 2).eval()
    src = torch.randn(3, 5, 32)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    with torch.no_grad():
        ref = enc(src, src_key_padding_mask=mask)
        got = enc.to("tpu")(src.to("tpu"), src_key_padding_mask=mask.to("tpu"))
    assert got.device.type == "tpu" and got.shape == ref.shape
    torch.testing.assert_close(got.cpu(), ref)


def test_transformer_encoder_layer_takes_nested_inputs_as_on_cpu():
    """A nested batch, and an empty one (what PyTorch's test_TransformerEncoderLayer_empty feeds);
    a nested tensor without components is refused by torch's slow path with its AssertionError."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, dtype=torch.float64).eval()
    parts = [torch.randn(3, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ref = layer(torch.nested.nested_tensor(parts))
        layer_tpu = layer.to("tpu")
        _same(layer_tpu(torch.nested.nested_tensor(parts, device="tpu")), ref)
        empty = torch.nested.nested_tensor([torch.rand(0, 16, dtype=torch.float64)], device="tpu")
        out = layer_tpu(empty)
        assert out.is_nested and out.device.type == "tpu" and out.unbind()[0].shape == (0, 16)
        with pytest.raises(AssertionError, match="MultiheadAttention does not support NestedTensor outside"):
            layer_tpu(torch.nested.nested_tensor([], device="tpu"))


def test_unserved_views_and_a_missing_extension_raise_naming_the_op(monkeypatch):
    t = torch.nested.nested_tensor(_parts(4), device="tpu")
    with pytest.raises(NotImplementedError, match=r"aten\.expand\.default on a nested tpu tensor: views"):
        torch.ops.aten.expand.default(t, [3, -1, 6])
    monkeypatch.setattr(torch_tpu.core.extension, "available", lambda: False)
    with pytest.raises(NotImplementedError, match=r"aten\.relu\.default on a nested tpu tensor: .*C\+\+ extension"):
        torch.relu(t)
