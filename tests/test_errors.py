"""Bad input raises what CPU raises, with messages that name the op; never a raw JAX trace."""

from __future__ import annotations

import pytest
import torch


def both(f, *shapes):
    cs = [torch.randn(*s) for s in shapes]
    return f(*cs), (lambda: f(*[c.to("tpu") for c in cs]))


def test_device_mismatch_like_cuda():
    t = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        t + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.ones(2, 2, device="tpu"), torch.ones(2, 2))


@pytest.mark.parametrize(
    "f, shapes",
    [
        (lambda a, b: a + b, [(3,), (4,)]),
        (lambda a, b: a @ b, [(2, 3), (4, 5)]),
        (lambda a: a.view(5), [(6,)]),
        (lambda a: a.reshape(4, -1), [(6,)]),
        (lambda a: a[5], [(3,)]),
        (lambda a: a.sum(dim=3), [(2, 2)]),
        (lambda a, b: torch.cat([a, b]), [(2, 3), (2, 4)]),
        (lambda a: a.transpose(0, 2), [(2, 2)]),
    ],
)
def test_same_exception_type_as_cpu(f, shapes):
    cs = [torch.randn(*s) for s in shapes]
    with pytest.raises(Exception) as cpu_err:
        f(*cs)
    with pytest.raises(cpu_err.type) as tpu_err:
        f(*[c.to("tpu") for c in cs])
    tpu_msg, cpu_msg = str(tpu_err.value), str(cpu_err.value)
    assert tpu_msg.split("\n")[0] == cpu_msg.split("\n")[0] or tpu_msg.startswith("aten."), tpu_msg


def test_inplace_cast_error_like_cpu():
    with pytest.raises(RuntimeError):
        torch.ones(2, dtype=torch.int64).add_(torch.ones(2) * 0.5)
    with pytest.raises(RuntimeError, match=r"aten\.add_\.Tensor\(int64\[2\], float32\[2\]\)"):
        torch.ones(2, dtype=torch.int64, device="tpu").add_(torch.ones(2, device="tpu") * 0.5)


def test_lowering_failure_names_the_op(monkeypatch):
    from torch_tpu.ops import _registry

    op = torch.ops.aten.neg.default
    lowering = _registry.LOWERINGS[op]

    def broken(self):
        raise ValueError("boom")

    from torch_tpu import _dispatch

    kernel = _dispatch._OpKernel(op, _registry.Lowering(broken), "functional")
    with pytest.raises(ValueError, match=r"aten\.neg\.default\(float32\[2\]\).*: boom"):  # its own type
        kernel(torch.ones(2, device="tpu")).cpu()  # in fused mode the error surfaces at the sync
    assert lowering.fn is not broken


def test_index_checks_on_host_data_read_no_device_memory():
    import torch_tpu
    from torch_tpu.runtime import metrics

    w = torch.randn(10, 4, device="tpu")
    idx = torch.tensor([[1, 2], [9, 0]], device="tpu")  # uploaded: its host copy is kept
    torch_tpu.sync()
    before = metrics.transfer_bytes["device_to_host"]
    torch.nn.functional.embedding(idx, w)
    torch.nn.functional.cross_entropy(w, torch.tensor([3] * 10, device="tpu"))
    assert metrics.transfer_bytes["device_to_host"] == before
    with pytest.raises(IndexError, match="index out of range in self"):
        torch.nn.functional.embedding(torch.tensor([10], device="tpu"), w)  # at the op, as on CPU


@pytest.mark.parametrize("mode", ["debug", "strict", "fused"])
def test_index_check_on_device_values(mode):
    """Indices the device computed: checked at the op in debug mode, else at the next host read
    (like CUDA's device-side assert), naming the op's error and where it was called."""
    import torch_tpu

    w = torch.randn(10, 4, device="tpu")
    with torch_tpu.set_eager_mode(mode):
        idx = torch.arange(4, device="tpu") + 7  # 7..10: 10 is out of range
        if mode == "debug":
            with pytest.raises(IndexError, match="index out of range in self"):
                torch.nn.functional.embedding(idx, w)
        else:
            out = torch.nn.functional.embedding(idx, w)
            with pytest.raises(IndexError, match=r"index out of range in self.*test_errors.py:\d+"):
                out.sum().item()
        ok = torch.nn.functional.embedding(idx - 1, w)  # a failed check is reported once
        torch.testing.assert_close(ok.cpu(), w.cpu()[6:10])
