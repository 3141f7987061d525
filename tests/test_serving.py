"""One serving table for eager mode and graphs.

Every op eager mode serves on tpu is served in ``torch.compile`` graphs too, by the same table
entry (or torch's decomposition), or it is on the short, reasoned ``GRAPH_UNSERVED`` list and a
graph naming it raises a clear ``NotImplementedError``. The lists are enumerated from the serving
table, so a new kernel that graphs lack fails here. Every served op counts in ``metrics()``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_tpu
from torch_tpu.compile import backend
from torch_tpu.dispatch import op_kernel as _op_kernel
from torch_tpu.ops._registry import LOWERINGS, is_mutating


def _served_functional_ops() -> list[torch._ops.OpOverload]:
    """The non-mutating aten overloads with a tpu kernel of ours (graphs are functional: an
    in-place or ``out=`` overload reaches them as its functional twin)."""
    ops = []
    for name in _op_kernel.REGISTERED:
        if not name.startswith("aten."):
            continue
        base, _, overload = name.removeprefix("aten.").rpartition(".")
        op = getattr(getattr(torch.ops.aten, base), overload)
        if not is_mutating(op):
            ops.append(op)
    return ops


def _graph_serves(op: torch._ops.OpOverload) -> bool:
    if op in backend._decompositions() or op in backend._PYTHON_OPS or op in backend._DROPPED_EFFECTS:
        return True
    try:
        backend._lowering_of(op)
    except NotImplementedError:
        return False
    return True


def test_every_op_served_eagerly_is_served_in_graphs_or_listed_with_a_reason():
    ops = _served_functional_ops()
    assert len(ops) > 500  # the enumeration found the table
    missing = sorted(str(op) for op in ops if not _graph_serves(op) and op not in backend.GRAPH_UNSERVED)
    assert not missing, f"served in eager mode, not in graphs (lower them, or list them with why): {missing}"


def test_the_unserved_list_holds_only_ops_graphs_lack():
    stale = sorted(str(op) for op in backend.GRAPH_UNSERVED if _graph_serves(op))
    assert not stale, f"graphs serve these now: remove them from GRAPH_UNSERVED: {stale}"
    for op, why in backend.GRAPH_UNSERVED.items():
        with pytest.raises(NotImplementedError, match=why.split(";")[0][:30].replace("(", r"\(").replace(")", r"\)")):
            backend._lowering_of(op)


def test_backward_ops_with_hand_kernels_are_table_entries():
    """The ops eager mode once served with hand kernels of their own (graphs never saw them)."""
    aten = torch.ops.aten
    for op in (aten.convolution_backward.default, aten.native_batch_norm_backward.default,
               aten.batch_norm_backward.default, aten.grid_sampler_2d_backward.default,
               aten.grid_sampler_3d_backward.default, aten.masked_scatter_backward.default,
               aten._efficientzerotensor.default, aten.native_layer_norm_backward.default):
        assert op in LOWERINGS and not LOWERINGS[op].graph_only, op


def test_every_registered_kernel_counts_its_calls():
    assert all(getattr(k, "counts_itself", False) for k in _op_kernel.KERNELS.values())


def test_hand_kernels_count_in_metrics():
    x = torch.tensor([3.0, 0.0, 1.0, 3.0], device="tpu")
    torch_tpu.reset_metrics()
    torch.nonzero(x)
    torch.unique(x)
    torch.equal(x, x)
    x.view(torch.int32)
    torch.arange(4, device="tpu")
    x.sum().item()
    counts = torch_tpu.metrics()["op_counts"]
    for name in ("aten.nonzero.default", "aten._unique2.default", "aten.equal.default", "aten.view.dtype",
                 "aten.arange.default", "aten._local_scalar_dense.default", "aten.sum.default"):
        assert counts.get(name) == 1, (name, counts)


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=600,
                          env=env)


def test_compiled_boolean_mask_index_put_with_grad_does_not_abort():
    """Its backward reads ``grad[mask]``, a data-dependent shape: torch's engine lost the error and
    aborted the process (std::terminate). The graph now runs in eager mode, with CPU's results."""
    r = _run("""
        import warnings, torch, torch_tpu
        torch.manual_seed(0)
        x = torch.randn(5, 3, requires_grad=True)
        mask = torch.tensor([True, True, False, True, False])
        v = torch.randn(3, 3, requires_grad=True)
        xt, vt = (t.detach().to("tpu").requires_grad_() for t in (x, v))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = torch.compile(lambda a, m, b: torch.index_put(a, (m,), b), backend="tpu", dynamic=False)(
                xt, mask.to("tpu"), vt)
        assert any("data-dependent shape" in str(m.message) for m in w), [str(m.message) for m in w]
        out.square().sum().backward()
        ref = torch.index_put(x, (mask,), v)
        ref.square().sum().backward()
        torch.testing.assert_close(out.detach().cpu(), ref.detach())
        torch.testing.assert_close(xt.grad.cpu(), x.grad)
        torch.testing.assert_close(vt.grad.cpu(), v.grad)
        assert torch_tpu.metrics()["eager_graphs"]
        print("ok")
    """)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-3000:])


def test_error_in_a_traced_backward_on_tpu_is_raised_not_an_abort():
    """Any exception a ``__torch_dispatch__`` mode raises inside a backward node on tpu (here fake
    tensors refusing a data-dependent shape) reaches the caller: as itself where the C++ extension
    answers device guards, or taken over by the Python guard (``_Guard.type_``) where it does not,
    which torch's engine then reports as a SystemError. Both guards are run, one process each."""
    for python_guard in ("0", "1"):
        r = _run("""
            import torch, torch_tpu
            from torch._subclasses.fake_tensor import FakeTensorMode
            with FakeTensorMode():
                x = torch.randn(5, 3, device="tpu", requires_grad=True)
                m = torch.ones(5, dtype=torch.bool, device="tpu")
                v = torch.randn(5, 3, device="tpu", requires_grad=True)
                y = torch.index_put(x, (m,), v).sum()
                try:
                    torch.autograd.grad(y, [x, v])  # v's gradient is grad[m]: a data-dependent shape
                    raise AssertionError("no error")
                except (SystemError, RuntimeError) as e:
                    raised = e
            lost = torch.tpu.take_lost_exception()
            assert "nonzero" in repr(lost if isinstance(raised, SystemError) else raised), (repr(raised), repr(lost))
            print("ok")
        """, env={**os.environ, "TORCH_TPU_PYTHON_DEVICE_GUARD": python_guard})
        assert r.returncode == 0 and "ok" in r.stdout, (python_guard, r.returncode, r.stderr[-3000:])


def _kernel(name: str) -> _op_kernel._OpKernel:
    kernel = _op_kernel.KERNELS[name]
    assert isinstance(kernel, _op_kernel._OpKernel), kernel
    return kernel


def test_a_signature_takes_the_slow_path_once_then_runs_its_plan(monkeypatch):
    """The first call of a signature makes its plan (meta kernel, refusals, program); later calls
    of the same signature look it up and run it, with CPU's results; a new signature makes one more."""
    kernel = _kernel("aten.add.Tensor")
    made = []
    original = _op_kernel._OpKernel._plan
    monkeypatch.setattr(_op_kernel._OpKernel, "_plan", lambda self, *a: made.append(self.name) or original(self, *a))
    x, y = torch.randn(3, 13, dtype=torch.float64), torch.randn(3, 13, dtype=torch.float64)  # shapes no other test adds
    for _ in range(3):
        assert torch.equal((x.to("tpu") + y.to("tpu")).cpu(), x + y)
    assert made.count("aten.add.Tensor") == 1
    before = len(kernel.plans)
    assert torch.equal((x[:2].to("tpu") + y[:2].to("tpu")).cpu(), x[:2] + y[:2])
    assert made.count("aten.add.Tensor") == 2 and len(kernel.plans) == before + 1


def test_a_plan_names_the_checks_its_calls_still_make():
    """A check that depends on values (an index bound) or on which tensors alias which cannot be
    answered once per signature: the plan names it, and the fast path makes it at every call."""
    x = torch.randn(5, 3)
    index = torch.tensor([4, 0])
    assert torch.equal(torch.index_select(x.to("tpu"), 0, index.to("tpu")).cpu(), torch.index_select(x, 0, index))
    plans = list(_kernel("aten.index_select.default").plans.values())
    assert plans and all(any("values" in c for c in p.value_checks) for p in plans), plans
    with pytest.raises(IndexError):  # the same signature, a value out of range: checked again
        torch.index_select(x.to("tpu"), 0, torch.tensor([5, 0]).to("tpu")).cpu()
    a = torch.randn(4).to("tpu")
    assert torch.equal((a + a).cpu(), (a.cpu() + a.cpu()))
    assert any(p.value_checks == () for p in _kernel("aten.add.Tensor").plans.values())
    assert _kernel("aten.add_.Tensor").value_checks  # an in-place write: its overlap with the inputs
    assert "every call checks" in repr(plans[0])
