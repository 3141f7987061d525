"""The tpu device and the torch.tpu module."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_tpu


def test_plain_tensor_on_tpu():
    t = torch.ones(2, 3, device="tpu")
    assert type(t) is torch.Tensor
    assert t.device == torch.device("tpu", 0)
    assert t.is_contiguous()
    assert torch.ones(2, device=torch.device("tpu")).device.type == "tpu"


def test_platform_is_an_xla_platform():
    assert torch_tpu.platform() in ("cpu", "gpu", "tpu")


def test_torch_tpu_module():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(0)
    with torch.tpu.device(0):
        pass
    torch.tpu.synchronize()
    assert isinstance(torch.tpu.get_device_name(), str)
    props = torch.tpu.get_device_properties(0)
    assert props.platform == torch_tpu.platform() or torch_tpu.platform() == "gpu"


def test_missing_device_index_raises():
    n = torch.tpu.device_count()
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.empty(2, device=f"tpu:{n}")
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.tpu.set_device(n + 3)


def test_memory_stats_never_made_up():
    try:
        used = torch.tpu.memory_allocated()
    except RuntimeError as e:
        assert "reports no memory statistics" in str(e)
    else:
        assert used >= 0 and torch.tpu.max_memory_allocated() >= used


def test_memory_summary_tabulates_xlas_statistics(monkeypatch):
    import torch_tpu.device.tpu_module as device

    try:
        torch.tpu.memory_stats()
    except RuntimeError as e:  # XLA:CPU keeps none: the summary says so the same way
        with pytest.raises(RuntimeError, match="reports no memory statistics"):
            torch.tpu.memory_summary()
        assert "reports no memory statistics" in str(e)
    monkeypatch.setattr(device, "memory_stats", lambda device=None: {"bytes_in_use": 3 << 20, "num_allocs": 7})
    text = torch.tpu.memory_summary()
    assert "bytes_in_use" in text and "3.00 MiB" in text and "num_allocs" in text and " 7" in text


def test_cudas_older_memory_names_and_device_of():
    assert torch.tpu.memory_cached is torch.tpu.memory_reserved
    assert torch.tpu.max_memory_cached is torch.tpu.max_memory_reserved
    with pytest.raises(NotImplementedError, match="no reset"):
        torch.tpu.reset_max_memory_allocated()
    with torch.tpu.device_of(torch.ones(2, device="tpu")):
        assert torch.tpu.current_device() == 0
    with torch.tpu.device_of(torch.ones(2)):  # a CPU tensor selects nothing, as with CUDA's
        assert torch.tpu.current_device() == 0


def test_seeding_is_reproducible():
    torch.tpu.manual_seed(123)
    state = torch.tpu.get_rng_state()
    assert torch.tpu.initial_seed() == 123
    torch.tpu.set_rng_state(state)
    assert torch.equal(torch.tpu.get_rng_state(), state)
    torch.manual_seed(7)  # torch.manual_seed seeds the device too
    assert torch.tpu.initial_seed() == 7
    s = torch.tpu.seed()
    assert torch.tpu.initial_seed() == s
    torch.tpu.manual_seed_all(3)
    assert torch.tpu.initial_seed() == 3


def test_rng_states_of_all_devices_round_trip_like_cudas():
    """Checkpointing code written for CUDA saves ``get_rng_state_all()`` and restores it with
    ``set_rng_state_all``: the same draws follow. tpu devices share one stream, so states that
    disagree are refused, not reduced to one of them."""
    torch.tpu.init()
    assert torch.tpu.is_initialized()
    torch.tpu.manual_seed_all(11)
    states = torch.tpu.get_rng_state_all()
    assert len(states) == torch.tpu.device_count()
    first = torch.rand(5, device="tpu").cpu()
    torch.rand(3, device="tpu")
    torch.tpu.set_rng_state_all(states)
    assert torch.equal(torch.rand(5, device="tpu").cpu(), first)
    torch.tpu.set_rng_state_all([])  # nothing to restore, as on CUDA
    other = torch.tpu.get_rng_state()
    torch.tpu.manual_seed(12)
    with pytest.raises(ValueError, match="share one random stream"):
        torch.tpu.set_rng_state_all([other, torch.tpu.get_rng_state()])


def _draws(g):
    ones = torch.ones(6, device="tpu")
    out = [
        torch.randn(4, generator=g, device="tpu"), torch.rand(4, generator=g, device="tpu"),
        torch.randint(0, 100, (4,), generator=g, device="tpu"), torch.randperm(6, generator=g, device="tpu"),
        torch.empty(4, device="tpu").uniform_(generator=g), torch.empty(4, device="tpu").exponential_(generator=g),
        torch.bernoulli(ones * 0.5, generator=g), torch.poisson(ones * 3, generator=g),
        torch.multinomial(ones, 3, generator=g), torch.normal(ones, 2.0, generator=g),
    ]
    return [t.cpu() for t in out]


_tpu_generators = pytest.mark.skipif(
    not torch_tpu.core.extension.available(),
    reason=f"torch_tpu's C++ extension: {torch_tpu.core.extension.why_not()}")


@_tpu_generators
def test_a_tpu_generator_is_a_seed_and_an_offset_like_cudas():
    """``torch.Generator(device="tpu")`` (through the C++ extension, built at the first import): seeded
    alike, the same numbers, and the default stream's numbers for that seed, as a CUDA generator
    gives; each op advances its offset; its state saves and restores; the default state is left
    alone."""
    g = torch.Generator(device="tpu")
    assert g.device == torch.device("tpu", 0) and g.initial_seed() == torch.Generator().initial_seed()
    state = torch.tpu.get_rng_state()
    first = _draws(torch.Generator(device="tpu").manual_seed(11))
    again = _draws(torch.Generator("tpu").manual_seed(11))
    other = _draws(torch.Generator("tpu").manual_seed(12))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    assert torch.equal(torch.tpu.get_rng_state(), state)

    g.manual_seed(5)
    a = torch.randn(8, device="tpu", generator=g)
    assert g.get_offset() == 1
    torch.manual_seed(5)
    assert torch.equal(a.cpu(), torch.randn(8, device="tpu").cpu())

    saved = g.get_state()
    assert saved.dtype == torch.uint8 and saved.numel() == 16
    x = torch.rand(5, device="tpu", generator=g)
    g.set_state(saved)
    assert torch.equal(torch.rand(5, device="tpu", generator=g).cpu(), x.cpu())
    with pytest.raises(RuntimeError, match="16 bytes"):
        g.set_state(torch.zeros(3, dtype=torch.uint8))


@_tpu_generators
def test_making_a_tpu_generator_warns_nothing_even_with_warnings_as_errors():
    """torch prints a deprecation notice about the registration the extension must use at every
    generator made; a suite run with warnings as errors (pytest's ``-W error``) must still make one."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()  # no filter of torch_tpu's left, as a harness leaves none
        warnings.simplefilter("always")
        g = torch.Generator(device="tpu").manual_seed(2)
        torch.rand(2, device="tpu", generator=g)
    assert [str(w.message) for w in seen] == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.Generator(device="tpu").device.type == "tpu"


@_tpu_generators
def test_a_tpu_generator_seeds_a_cpu_fallback_kernel():
    """A random op served by the CPU fallback gets a CPU generator seeded from the tpu one's seed
    and next offset: reproducible, and each call advances the tpu generator."""
    from torch_tpu.dispatch import fallback as _fallback

    def draw(g):
        return _fallback.cpu_fallback(torch.ops.aten.randn.generator, ([3],), {"generator": g, "device": "tpu"})

    a, b = draw(torch.Generator("tpu").manual_seed(3)), draw(torch.Generator("tpu").manual_seed(3))
    assert a.device.type == "tpu" and torch.equal(a.cpu(), b.cpu())
    g = torch.Generator("tpu").manual_seed(3)
    assert not torch.equal(draw(g).cpu(), draw(g).cpu()) and g.get_offset() == 2


def test_a_cpu_generator_seeds_tpu_random_ops():
    """A CPU generator passed to a tpu random op seeds it (the way where the C++ extension that
    makes tpu generators is not built): seeded alike, the same numbers; each op advances it; the
    device's own state is left alone. It used to be ignored."""

    def draws(seed):
        return _draws(torch.Generator().manual_seed(seed))

    state = torch.tpu.get_rng_state()
    first, again, other = draws(11), draws(11), draws(12)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0]) and not torch.equal(first[1], other[1])
    assert not torch.equal(first[0][:4], draws(11)[1])  # not the same numbers op after op
    assert torch.equal(torch.tpu.get_rng_state(), state)


def test_host_round_trip_every_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.int16,
                  torch.int32, torch.int64, torch.uint8, torch.bool):
        c = (torch.arange(-3, 9) % 5).to(dtype).reshape(3, 4)
        t = c.to("tpu")
        assert t.dtype == dtype
        assert torch.equal(t.cpu(), c)
        assert t.tolist() == c.tolist()


@pytest.mark.parametrize("form", ["transposed", "sliced", "expanded", "conj", "neg", "grad", "complex32"])
def test_uploading_a_strided_or_flagged_cpu_tensor_gives_its_values(form):
    """Uploads take numpy's view of a plain CPU tensor as it is; views with strides, expanded
    rows, conjugate and negative bits, tensors that require grad and dtypes numpy lacks give
    CPU's values too, and the upload is a copy: writing the CPU tensor afterwards changes nothing."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    if form == "transposed":
        c = base.t()
    elif form == "sliced":
        c = base[1:, ::2]
    elif form == "expanded":
        c = base[:1].expand(3, 6)
    elif form == "conj":
        c = torch.complex(base, -base).conj()
        assert c.is_conj()
    elif form == "neg":
        c = torch.complex(base, base).conj()._neg_view()
        assert c.is_neg()
    elif form == "grad":
        c = base.clone().requires_grad_()
    else:
        c = torch.complex(base, base).to(torch.complex32)
    expected = c.detach().resolve_conj().resolve_neg().clone()
    t = c.to("tpu")
    assert t.dtype == c.dtype and t.shape == c.shape
    base.add_(100)  # the source changes after the upload
    got = t.cpu()
    if got.dtype == torch.complex32:  # CPU torch compares no complex32
        got, expected = got.to(torch.complex64), expected.to(torch.complex64)
    assert torch.equal(got, expected)


def test_int64_is_exact():
    big = torch.tensor([2**53 + 1, -(2**62)], dtype=torch.int64)
    t = big.to("tpu")
    assert torch.equal((t + 1).cpu(), big + 1)
    assert (t[0] + 0).item() == 2**53 + 1


def test_item_and_numpy():
    t = torch.tensor([2.5], device="tpu")
    assert t.item() == 2.5
    assert isinstance(torch.tensor(3, device="tpu").item(), int)
    with pytest.raises(TypeError, match="can't convert tpu:0 device type tensor to numpy"):
        t.numpy()
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        torch.ones(2, device="tpu").item()


def test_repr_copies_to_host_once():
    t = torch.arange(6.0).reshape(2, 3).to("tpu")
    torch_tpu.reset_metrics()
    text = repr(t)
    assert text == "tensor([[0., 1., 2.],\n        [3., 4., 5.]], device='tpu:0')"
    ops = torch_tpu.metrics()["op_counts"]
    assert sum(ops.values()) <= 3, ops  # one copy (and its view bookkeeping), no per-element ops
    assert "device='tpu:0', dtype=torch.int32" in repr(t.int())
    g = t.requires_grad_() * 2
    assert "grad_fn=<MulBackward0>" in repr(g)


def test_streams_and_events_like_cuda():
    """One implicit XLA stream: the CUDA stream API runs (FSDP2-style code), waits are free, and
    timed events measure the work between them."""
    s = torch.tpu.Stream(priority=-1)
    assert torch.tpu.current_stream() == torch.tpu.default_stream() == s
    x = torch.ones(64, 64, device="tpu")
    start, end = torch.tpu.Event(enable_timing=True), torch.tpu.Event(enable_timing=True)
    start.record()
    with torch.tpu.stream(s):
        y = x @ x
    s.wait_stream(torch.tpu.current_stream())
    end = s.record_event(end)
    torch.tpu.current_stream().wait_event(end)
    assert end.query() and start.elapsed_time(end) >= 0
    torch.testing.assert_close(y.cpu(), torch.full((64, 64), 64.0))
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.tpu.Event().elapsed_time(end)


_LATE_IMPORT_SCRIPT = """
import warnings
import torch
torch.ones(1, requires_grad=True).sum().backward()  # the autograd engine starts before torch_tpu exists
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch_tpu
print(sum("before torch_tpu was imported" in str(w.message) for w in caught))
x = torch.ones(2, device="tpu", requires_grad=True)
try:
    x.sum().backward()
    print("backward ran")
except RuntimeError:
    print("backward failed")
"""


def test_import_after_a_backward_pass_warns():
    """PyTorch's autograd engine makes its per-device threads at the process's first backward. A
    backward before ``import torch_tpu`` leaves it without one for tpu: the import says so, rather
    than a later backward failing on an internal assert that asks for a PyTorch bug report."""
    import os
    import subprocess
    import sys
    import warnings

    # with PyTorch's backend autoload off: autoload registers tpu during ``import torch``, so the
    # trap exists only without it (tests/test_autoload.py has the autoload case)
    env = {**os.environ, "TORCH_TPU_CACHE_DIR": "off", "TORCH_TPU_PLATFORM": "cpu",
           "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    out = subprocess.run([sys.executable, "-c", _LATE_IMPORT_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["1", "backward failed"], out.stdout
    # imported first (as here), the engine has a tpu thread: no warning, and backward works
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_tpu.device.tpu_module.check_autograd_engine()
    x = torch.ones(2, device="tpu", requires_grad=True)
    (x * 3).sum().backward()
    assert x.grad.cpu().tolist() == [3.0, 3.0]


def test_pin_memory_for_tpu():
    """``DataLoader(pin_memory=True)``, a line of many CUDA scripts, with tpu the current accelerator:
    pinning for tpu gives an ordinary contiguous copy (XLA copies host buffers at the transfer)."""
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(6, 3)
    batches = [b for (b,) in DataLoader(TensorDataset(x), batch_size=2, pin_memory=True)]
    torch.testing.assert_close(torch.cat(batches), x)
    t = torch.randn(4, 5).t()
    p = t.pin_memory()
    assert p.device.type == "cpu" and p.is_contiguous() and torch.equal(p, t)
    assert p.data_ptr() != t.data_ptr()  # a copy: the loader may reuse its buffer
    assert torch.equal(p.to("tpu").cpu(), t)



def test_record_stream_is_accepted_as_on_cuda():
    # prefetching code records a tensor's use on a stream; XLA keeps a buffer while queued programs
    # read it, so there is nothing to record, and nothing runs on CPU (which has no such kernel)
    import torch_tpu

    before = dict(torch_tpu.metrics()["fallback_counts"])
    t = torch.arange(4.0, device="tpu")
    for s in (torch.accelerator.current_stream(), torch.Stream(device="tpu")):
        assert t.record_stream(s) is None
    assert dict(torch_tpu.metrics()["fallback_counts"]) == before
    assert torch.equal(t.cpu(), torch.arange(4.0))


@pytest.mark.skipif(not torch_tpu.core.extension.available(), reason="needs the C++ extension")
def test_device_guards_ask_python_nothing_and_answer_as_before(monkeypatch):
    """With the extension, tpu device guards are answered in C++: a training step with backward
    calls the Python guard's ``type_`` not once (torch's Python registration called it over a
    thousand times in a small model's step), and the answers are the ones the Python guard gave:
    device index 0, the default stream, CPU's gradients."""
    import _torch_tpu_autoload

    calls = []
    original = _torch_tpu_autoload._Guard.type_
    monkeypatch.setattr(_torch_tpu_autoload._Guard, "type_", lambda self: calls.append(1) or original(self))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    moved = copy.deepcopy(model).to("tpu")
    x = torch.randn(3, 4)
    model(x).square().sum().backward()
    moved(x.to("tpu")).square().sum().backward()
    for a, b in zip(model.parameters(), moved.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad)
    assert calls == []
    assert torch.tpu.current_device() == 0 and torch.tpu.device_count() >= 1
    assert torch.tpu.current_stream().stream_id == torch.tpu.default_stream().stream_id


_CPU_STREAM_SCRIPT = """
import torch, torch_tpu

def draws(dev, mode):
    torch.manual_seed(7)
    with torch_tpu.set_eager_mode(mode):
        # without the C++ extension no tpu generator can be made: a CPU one seeds tpu random ops
        g = torch.Generator(device=dev if torch_tpu.core.extension.available() else "cpu").manual_seed(3)
        out = [torch.randn(5, device=dev), torch.rand(3, 2, device=dev, dtype=torch.bfloat16),
               torch.randint(0, 100, (6,), device=dev), torch.randperm(8, device=dev),
               torch.empty(4, device=dev).normal_(2, 3), torch.nn.functional.dropout(torch.ones(10, device=dev), 0.5),
               torch.bernoulli(torch.full((6,), 0.3, device=dev) * 2),
               torch.multinomial(torch.tensor([0.1, 0.5, 0.4], device=dev), 5, replacement=True),
               torch.randn(3, device=dev, generator=g), torch.randn(3, device=dev, generator=g)]
        g.manual_seed(3)  # reseeded: the stream starts again, as a CPU generator's does
        out.append(torch.randn(3, device=dev, generator=g))
        return [t.cpu() for t in out]

for mode in ("strict", "fused"):
    print(mode, all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(draws("cpu", mode), draws("tpu", mode))))
torch.manual_seed(0)
cpu_then = torch.randn(2)
torch.manual_seed(0)
torch.randn(1, device="tpu")  # one stream: a tpu draw advances CPU's generator, as a CPU draw would
print("shared", torch.equal(torch.randn(1), cpu_then[1:]))
"""


@pytest.mark.parametrize("source", ["device", "cpu"])
def test_torch_tpu_random_cpu_draws_cpus_numbers(source):
    """``TORCH_TPU_RANDOM=cpu`` (read at import, hence a fresh process): eager random ops draw from
    CPU's generator with CPU's kernels, so a seed gives the very numbers CPU gives, in strict and
    fused mode, for explicit generators too. By default tpu draws its own stream (same
    distributions, other numbers)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCH_TPU_CACHE_DIR": "off", "TORCH_TPU_PLATFORM": "cpu", "TORCH_TPU_RANDOM": source}
    out = subprocess.run([sys.executable, "-c", _CPU_STREAM_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    same = "True" if source == "cpu" else "False"
    assert out.stdout.split() == ["strict", same, "fused", same, "shared", same], out.stdout
