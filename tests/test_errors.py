"""Bad input raises what CPU raises, with messages that name the op; never a raw JAX trace."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import torch_tpu
from tests.conftest import assert_same, cpu_error


def both(f, *shapes):
    cs = [torch.randn(*s) for s in shapes]
    return f(*cs), (lambda: f(*[c.to("tpu") for c in cs]))


def test_device_mismatch_like_cuda():
    t = torch.ones(3, device="tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        t + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.mm(torch.ones(2, 2, device="tpu"), torch.ones(2, 2))
    for a, b in ((t, torch.ones(3)), (torch.ones(3), t)):  # the CPU tensor first too (it was an AttributeError)
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            torch.equal(a, b)


@pytest.mark.parametrize("index", [
    lambda x, i: x[i],
    lambda x, i: x[:, i, None],
    lambda x, i: x.index_put_((i,), torch.tensor(1.0)),
    lambda x, i: x.__setitem__(i, 2.0),
])
def test_a_cpu_tensor_indexed_by_tpu_indices_is_refused_in_cudas_words(index):
    """A CPU tensor indexed by device indices: CUDA refuses with "indices should be either on cpu
    or on the same device as the indexed tensor (cpu)" (PyTorch's test_advancedindex_mixed_devices_error);
    tpu indices with a tpu tensor, and CPU indices with a tpu tensor, index as on CPU."""
    x = torch.arange(12.0).view(3, 4)
    i = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match=re.escape("indices should be either on cpu or on the same device "
                                                     "as the indexed tensor (cpu)")):
        index(x.clone(), i.to("tpu"))
    for xs, ixs in ((x.to("tpu"), i.to("tpu")), (x.to("tpu"), i)):
        want, got = x.clone(), xs.clone()
        a, b = index(want, i), index(got, ixs)
        assert torch.equal(got.cpu(), want)
        if a is not None:
            assert torch.equal(b.cpu(), a)


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

    from torch_tpu.dispatch import op_kernel as _op_kernel

    kernel = _op_kernel._OpKernel(op, _registry.Lowering(broken), "functional")
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


# Each op with an index one past the end; CPU raises at the op, a compiled graph at the next read
_OUT_OF_RANGE = {
    "index_copy_": lambda x, i: x.clone().index_copy_(0, i, torch.ones(1, 8, device=x.device)),
    "index_select dim 0": lambda x, i: x.index_select(0, i),
    "index_select dim 1": lambda x, i: x.index_select(1, i + 4),
    "getitem": lambda x, i: x[i],
    "setitem": lambda x, i: x.clone().index_put_((i,), torch.ones(8, device=x.device)),
    "embedding": lambda x, i: _F.embedding(i, x),
    "gather": lambda x, i: x.gather(0, i.view(1, 1).expand(1, 8)),
    "scatter_": lambda x, i: x.clone().scatter_(0, i.view(1, 1).expand(1, 8), 1.0),
    "index_add_": lambda x, i: x.clone().index_add_(0, i, torch.ones(1, 8, device=x.device)),
    "index_fill_": lambda x, i: x.clone().index_fill_(0, i, 1.0),
    "index_reduce_": lambda x, i: x.clone().index_reduce_(0, i, torch.ones(1, 8, device=x.device), "prod"),
    "take": lambda x, i: x.take(i + 28),
    "nll_loss": lambda x, i: _F.nll_loss(x, i.expand(4) + 4),
}


@pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")
@pytest.mark.parametrize("mode", ["debug", "strict", "fused"])
@pytest.mark.parametrize("where", ["input", "computed"])
@pytest.mark.parametrize("name", sorted(_OUT_OF_RANGE))
def test_a_compiled_graph_checks_indices_as_eager_mode_does(name, where, mode):
    """A compiled graph's out-of-range index raises CPU's exception and message (after the op's name
    where CPU's does not name it); before, XLA's clamped or dropped access gave a silent wrong
    answer. Indices given to the graph from the host, or views of them, are checked there, at the
    call, as eager mode checks them at the op; indices the graph computes are checked by the graph's
    program and raised at the next read (at the call in debug mode). A call with good indices
    afterwards matches CPU."""
    op = _OUT_OF_RANGE[name]
    f = op if where == "input" else (lambda x, i: op(x, (i * 3 + 1) // 3))  # the same index, computed
    x, bad, good = torch.randn(4, 8), torch.tensor([4]), torch.tensor([2])
    expected = _raised(lambda d: op(x.to(d), bad.to(d)), "cpu")
    message = re.escape(str(expected))
    if where == "computed" and mode != "debug":
        message += r" \(found on the device after the op, called at .*test_errors.py:\d+"
    compiled = torch.compile(f, backend="tpu", dynamic=False)
    torch._dynamo.reset()
    with torch_tpu.set_eager_mode(mode):
        with pytest.raises(type(expected), match=message):
            compiled(x.to("tpu"), bad.to("tpu")).cpu()
        torch.testing.assert_close(compiled(x.to("tpu"), good.to("tpu")).cpu(), f(x, good))
        with pytest.raises(type(expected), match=message):  # eager mode: the same words
            f(x.to("tpu"), bad.to("tpu")).cpu()


@pytest.mark.parametrize("rows", [8, 6])
def test_a_compiled_graph_checks_constant_positions_once(rows):
    """Positions from ``torch.arange`` of constant length (a position embedding's) are checked when
    the graph is compiled, not at every call: in range, a call queues no check for the device; out
    of range, the call raises CPU's error as before."""
    from torch_tpu.runtime import checks

    def f(w, x):
        return _F.embedding(torch.arange(7, device=w.device), w) + x

    w, x = torch.randn(rows, 4), torch.randn(7, 4)
    compiled = torch.compile(f, backend="tpu", dynamic=False)
    torch._dynamo.reset()
    if rows == 6:
        expected = _raised(lambda d: f(w.to(d), x.to(d)), "cpu")
        with pytest.raises(type(expected), match=re.escape(str(expected))):
            compiled(w.to("tpu"), x.to("tpu")).cpu()
        return
    compiled(w.to("tpu"), x.to("tpu"))
    queued = checks.mark()
    torch.testing.assert_close(compiled(w.to("tpu"), x.to("tpu")).cpu(), f(w, x))
    assert checks.mark() == queued


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_compiled_graphs_index_checks_are_read_as_one_flag_and_the_failed_one_raises(mode):
    """A graph with several index checks on values it computes (a decoding step's cache writes and
    its token lookup) queues one flag per call for the host to read, not one per check; when the
    second check fails, its own error, in CPU's words, is the one raised."""
    from torch_tpu.runtime import checks

    def f(x, i, j):
        return x.index_select(0, (i * 3 + 1) // 3).sum() + _F.embedding((j * 3 + 1) // 3, x).sum()

    x, good, bad = torch.randn(4, 8), torch.tensor([2]), torch.tensor([4])
    compiled = torch.compile(f, backend="tpu", dynamic=False)
    torch._dynamo.reset()
    expected = _raised(lambda d: f(x.to(d), good.to(d), bad.to(d)), "cpu")
    with torch_tpu.set_eager_mode(mode):
        queued = checks.mark()
        torch.testing.assert_close(compiled(x.to("tpu"), good.to("tpu"), good.to("tpu")).cpu(), f(x, good, good))
        assert checks.mark() == queued + 1
        with pytest.raises(type(expected), match=re.escape(str(expected)) + r" \(found on the device after the op"):
            compiled(x.to("tpu"), good.to("tpu"), bad.to("tpu")).cpu()


def test_a_strict_ops_device_side_index_check_runs_in_the_ops_own_program(monkeypatch):
    """In strict mode an op whose index the device computed (a decoding loop's ``index_copy_`` at
    ``position + 1``) computes its bounds check in its own executable: one program run per call,
    not the op's and a check program's. The check is deferred as before: a bad index raises CPU's
    error at the next host read, and a good one gives CPU's result."""
    from torch_tpu.runtime import checks, executor
    from torch_tpu.tensor import value_checks

    runs = []
    run_now, execute = executor.run_now, executor.execute
    monkeypatch.setattr(executor, "run_now", lambda prog, inputs: runs.append(prog.name) or run_now(prog, inputs))
    monkeypatch.setattr(value_checks, "execute", lambda prog, *a: runs.append(prog.name) or execute(prog, *a))

    def step(d, at):
        out = torch.zeros(4, 8, dtype=torch.long, device=d)
        return out.index_copy_(1, torch.tensor([at - 1], device=d) + 1, torch.full((4, 1), 7, device=d))

    expected = _raised(lambda d: step(d, 8), "cpu")
    with torch_tpu.set_eager_mode("strict"):
        for _ in range(2):  # the first call plans and compiles; each runs one program
            good = step("tpu", 5)
            runs.clear()
            queued = checks.mark()
            good = step("tpu", 5)
            assert [n for n in runs if "index_copy" in n or "value check" in n] == [runs[-1]]
            assert "checking outside" in runs[-1] and checks.mark() == queued + 1
        torch.testing.assert_close(good.cpu(), step("cpu", 5))
        # the same op with an index the host has (checked there) runs the same program: no compile
        out, token = torch.zeros(4, 8, dtype=torch.long, device="tpu"), torch.full((4, 1), 7, device="tpu")
        compiled = torch_tpu.metrics()["compile_count"]
        torch.testing.assert_close(out.index_copy_(1, torch.tensor([5], device="tpu"), token).cpu(), step("cpu", 5))
        assert torch_tpu.metrics()["compile_count"] == compiled
        bad = step("tpu", 8)  # nothing raised at the op: the device has the index
        with pytest.raises(type(expected), match=re.escape(str(expected)) + r" \(found on the device after the op"):
            bad.cpu()



def test_a_decoding_loops_device_side_index_check_joins_the_ops_program(monkeypatch):
    """A decoding loop's first position comes from the host (checked there, so ``index_copy_``'s
    own program is compiled first) and every later one from the device (``position + 1``). The
    first of those compiles the joined program (running them apart would compile the check's own
    instead): one executable per call from then on, and nothing compiled in a second call. Where the
    check's own program was compiled before (another op's), the calls run the two apart, compiling
    nothing, until the call has repeated ``JOIN_AFTER`` times: a loop, which then joins them. The
    results are CPU's, and a bad position still raises CPU's error at the next read."""
    from torch_tpu.runtime import executor
    from torch_tpu.tensor import value_checks

    runs = []
    run_now, execute = executor.run_now, executor.execute
    monkeypatch.setattr(executor, "run_now", lambda prog, inputs: runs.append(prog.name) or run_now(prog, inputs))
    monkeypatch.setattr(value_checks, "execute", lambda prog, *a: runs.append(prog.name) or execute(prog, *a))

    def loop(d: str, steps: int, width: int) -> tuple[torch.Tensor, list[list[str]]]:
        out = torch.zeros(3, width, dtype=torch.long, device=d)
        position = torch.tensor([width - steps], device=d)  # uploaded: the host has it
        per_call = []
        for i in range(steps):
            runs.clear()
            out.index_copy_(1, position, torch.full((3, 1), i, device=d))
            per_call.append([n for n in runs if "index_copy" in n or "value check" in n])
            position = position + 1  # computed on the device
        return out, per_call

    with torch_tpu.set_eager_mode("strict"):
        for call in range(2):
            compiled = torch_tpu.metrics()["compile_count"]
            got, per_call = loop("tpu", 8, 11)
            torch.testing.assert_close(got.cpu(), loop("cpu", 8, 11)[0])
            assert [len(names) for names in per_call] == [1] * 8, per_call
            assert all("checking outside(0, 11)" in names[0] for names in per_call[1:]), per_call
            if call:
                assert torch_tpu.metrics()["compile_count"] == compiled

        # the check's own program compiled first, by a check of another tensor with the same bounds;
        # the op's own program by a host-checked call
        ahead = torch.tensor([1], device="tpu") + 1
        width = 13
        value_checks.check_values(ahead, value_checks.outside, (0, width), IndexError)
        torch.zeros(3, width, dtype=torch.long, device="tpu").index_copy_(  # the op's own program, host-checked
            1, torch.tensor([0], device="tpu"), torch.full((3, 1), 1, device="tpu"))
        torch_tpu.sync()
        out = torch.zeros(3, width, dtype=torch.long, device="tpu")
        position, counts = torch.tensor([0], device="tpu") + 0, []
        for i in range(value_checks.JOIN_AFTER + 3):
            runs.clear()
            out.index_copy_(1, position % width, torch.full((3, 1), i, device="tpu"))
            counts.append(len([n for n in runs if "index_copy" in n or "value check" in n]))
            position = position + 1
        assert counts == [2] * value_checks.JOIN_AFTER + [1] * 3, counts
        want = torch.zeros(3, width, dtype=torch.long)
        for i in range(value_checks.JOIN_AFTER + 3):
            want[:, i % width] = i
        torch.testing.assert_close(out.cpu(), want)

        out = torch.zeros(3, 4, dtype=torch.long, device="tpu")
        bad = out.index_copy_(1, torch.tensor([1], device="tpu") + 3, torch.full((3, 1), 7, device="tpu"))
        expected = _raised(lambda d: torch.zeros(3, 4, dtype=torch.long, device=d).index_copy_(
            1, torch.tensor([4], device=d), torch.full((3, 1), 7, device=d)), "cpu")
        with pytest.raises(type(expected), match=re.escape(str(expected)) + r" \(found on the device after the op"):
            bad.cpu()

def _raised(f, device):
    try:
        f(device)
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return e
    raise AssertionError(f"no error on {device}")


_F = torch.nn.functional
_W = torch.randn(10, 3)


@pytest.mark.parametrize(
    "f",
    [
        lambda d: torch.ones(3, device=d).clamp(),  # torch's Python meta kernel raises ValueError
        lambda d: torch.nonzero(torch.ones(3, device=d), out=torch.empty(0, device=d)),
        lambda d: torch.masked_select(torch.ones(3, device=d), torch.ones(3, device=d) > 0,
                                      out=torch.empty(0, dtype=torch.long, device=d)),
        lambda d: torch.randn(5, 5, device=d)[torch.tensor([0, 1], device=d), torch.tensor([0, 1, 2], device=d)],
        lambda d: torch.arange(3, device=d)[torch.tensor([], device=d)],  # a float index
        lambda d: torch.empty(10, 0, device=d)[:, [0, 1]],
        lambda d: torch.rand((), device=d).index_put([], torch.tensor([1.0], device=d), True),
        lambda d: _F.embedding_bag(torch.tensor([1, 20], device=d), _W.to(d), torch.tensor([0], device=d)),
        lambda d: _F.embedding_bag(torch.tensor([1, 2], device=d), _W.to(d), torch.tensor([1], device=d)),
        lambda d: _F.embedding_bag(torch.tensor([1, 2], device=d), _W.to(d), torch.tensor([0, 3], device=d)),
        lambda d: _F.embedding_bag(torch.tensor([[-1, 1]], device=d), _W.to(d), padding_idx=0),
        lambda d: torch._embedding_bag(_W.to(d), torch.ones(2, 1, 3, dtype=torch.long, device=d),
                                       torch.zeros(2, dtype=torch.long, device=d)),
        lambda d: torch._embedding_bag(_W.to(d), torch.ones(2, dtype=torch.long, device=d),
                                       torch.zeros(1, 2, dtype=torch.long, device=d)),
        lambda d: _F.embedding(torch.zeros(2, 2, dtype=torch.long, device=d), torch.tensor(1.0, device=d)),
        lambda d: torch.zeros(3, device=d).masked_fill_(torch.ones(3, dtype=torch.uint8, device=d), 1.0),
        lambda d: torch.zeros(3, device=d).masked_fill(torch.ones(3, dtype=torch.int64, device=d), 1.0),
        lambda d: torch.zeros(3, device=d).masked_fill_(torch.ones(3, device=d) > 0, torch.ones(2, device=d)),
        lambda d: torch.zeros(3, device=d).masked_scatter_(torch.ones(3, dtype=torch.uint8, device=d),
                                                           torch.ones(3, device=d)),
        lambda d: torch.where(torch.ones(3, dtype=torch.int64, device=d), torch.zeros(3, device=d),
                              torch.ones(3, device=d)),
    ],
    ids=["clamp-no-bounds", "nonzero-out-float", "masked_select-out-dtype", "index-broadcast",
         "float-index", "index-size0-dim", "index_put-value-shape", "embedding_bag-range",
         "embedding_bag-offsets0", "embedding_bag-offsets-last", "embedding_bag-padded-range",
         "embedding_bag-input-dims", "embedding_bag-offsets-dims", "embedding-weight-dims",
         "masked_fill_-uint8-mask", "masked_fill-int64-mask", "masked_fill_-value-dims", "masked_scatter_-uint8-mask",
         "where-int64-condition"],
)
def test_lowering_and_kernel_errors_have_cpu_type_and_message(f):
    """CPU's type where a lowering, torch's Python meta kernel or JAX would raise another one
    (RuntimeError for embedding_bag, IndexError for indexing), and CPU's words in the message."""
    cpu, tpu = _raised(f, "cpu"), _raised(f, "tpu")
    assert type(tpu) is type(cpu), (type(tpu), tpu)
    first = str(cpu).split("\n")[0]
    assert first in str(tpu), (first, str(tpu))


def test_error_inside_a_lowering_keeps_its_type_and_names_the_op():
    """A JAX error while tracing a lowering is not re-raised as RuntimeError('tpu: ... failed')."""
    from torch_tpu.dispatch import op_kernel as _op_kernel
    from torch_tpu.ops import _registry

    def bad(self):
        raise IndexError("lowering's own check")

    kernel = _op_kernel._OpKernel(torch.ops.aten.neg.default, _registry.Lowering(bad), "functional")
    with pytest.raises(IndexError, match=r"^aten\.neg\.default\(float32\[3\]\): lowering's own check") as e:
        kernel(torch.ones(3, device="tpu")).cpu()
    assert isinstance(e.value.__cause__, IndexError)  # the lowering's traceback is kept


class _NotOurs(Exception):
    """An exception class of the caller's (a test harness's timeout raised by a signal handler)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def test_foreign_exceptions_pass_through_untouched():
    from torch_tpu.dispatch import op_kernel as _op_kernel
    from torch_tpu.ops import _registry

    raised = _NotOurs(7)

    def bad(self):
        raise raised

    kernel = _op_kernel._OpKernel(torch.ops.aten.neg.default, _registry.Lowering(bad), "functional")
    with pytest.raises(_NotOurs) as e:
        kernel(torch.ones(4, device="tpu")).cpu()
    assert e.value is raised and e.value.code == 7 and str(e.value) == "7"


def test_embedding_bag_device_check_names_the_position():
    """Indices computed on the device: the check runs with the step; the error is CPU's, raised at
    the next host read (at the op in debug mode)."""
    w = torch.randn(10, 3, device="tpu")
    idx = torch.arange(4, device="tpu") * 3 + 1  # 1 4 7 10: position 3 is out of range
    out = _F.embedding_bag(idx, w, torch.tensor([0], device="tpu"))
    with pytest.raises(RuntimeError, match=r"Index 3 of input takes value 10 which is not in the valid range"):
        out.cpu()


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_on_empty_input_like_cpu(mode):
    for idx, off in (([], [0, 0]), ([1, 2], [0, 0, 2])):
        outs = [
            _F.embedding_bag(torch.tensor(idx, dtype=torch.long, device=d), _W.to(d), torch.tensor(off, device=d),
                             mode=mode).cpu()
            for d in ("cpu", "tpu")
        ]
        torch.testing.assert_close(outs[1], outs[0])


def test_bool_index_put_accumulate_is_an_or():
    for d in ("cpu", "tpu"):
        t = torch.tensor([False, True, False], device=d)
        t.index_put_((torch.tensor([0, 0, 1], device=d),), torch.tensor([True, False, True], device=d),
                     accumulate=True)
        assert t.cpu().tolist() == [True, True, False]


def test_uint8_mask_warns_as_on_cpu():
    import warnings

    for d in ("cpu", "tpu"):
        v = torch.randn(5, 2, device=d)
        mask = torch.tensor([1, 0, 1, 1, 0], dtype=torch.uint8, device=d)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            v[mask]
            v[mask] = torch.ones(3, 2, device=d)  # (a number goes to masked_fill_ on CPU, which refuses)
        found = [x for x in w if "indexing with dtype torch.uint8 is now deprecated" in str(x.message)]
        assert len(found) == 2, (d, [str(x.message) for x in w])
        assert all(x.filename == __file__ for x in found)  # at the user's line


@pytest.mark.parametrize("op", [
    lambda x, out: torch.nonzero(x, out=out),
    lambda x, out: torch.masked_select(x, x > 0, out=out),
])
def test_out_on_the_cpu_is_refused_as_on_cuda(op):
    x = torch.randint(2, (3, 4), device="tpu")
    with pytest.raises(RuntimeError, match="on the same device"):
        op(x, torch.empty(0, dtype=torch.long))


def test_clamp_out_twin_keeps_the_bounds_check():
    x = torch.arange(6, device="tpu")
    out = torch.empty(0, dtype=torch.long, device="tpu")
    assert torch.clamp(x, 1, 3, out=out).cpu().tolist() == [1, 1, 2, 3, 3, 3]
    with pytest.raises(RuntimeError, match="At least one of 'min' or 'max' must not be None"):
        torch.clamp(x, out=out)


def _cpu_error(f):
    with pytest.raises(Exception) as err:
        f("cpu")
    return err


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("pool", ["AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool3d"])
def test_adaptive_pooling_refuses_integers_as_cpu(pool, dtype):
    """torch's meta kernels accept integer inputs; CPU's kernels raise NotImplementedError."""
    dims = 2 if pool.endswith("2d") else 3
    mod = getattr(torch.nn, pool)((2,) * dims)

    def run(device):
        return mod(torch.randint(0, 9, (3,) + (4,) * dims, device=device).to(dtype))

    cpu = _cpu_error(run)
    with pytest.raises(cpu.type, match="not implemented for"):
        run("tpu")


@pytest.mark.parametrize("kernel, out, what", [((), (3, 3), "kernel_size"), ((2, 2), (3,), "output_size")])
def test_fractional_pooling_size_checks_say_what_cpu_says(kernel, out, what):
    x = torch.randn(2, 7, 7)
    samples = torch.rand(1, 2, 2, dtype=x.dtype)
    with pytest.raises(RuntimeError, match=f"{what} must either be a single Int"):
        torch.ops.aten.fractional_max_pool2d(x, list(kernel), list(out), samples)
    with pytest.raises(RuntimeError, match=f"{what} must either be a single Int"):
        torch.ops.aten.fractional_max_pool2d(x.to("tpu"), list(kernel), list(out), samples.to("tpu"))


def test_fractional_pooling_3d_checks_the_samples():
    def run(device):
        mod = torch.nn.FractionalMaxPool3d([3, 2, 2], output_size=[1, 1, 1],
                                           _random_samples=torch.rand(0, 4, 3, device=device))
        return mod(torch.randn(1, 4, 6, 5, 5, device=device))

    cpu = _cpu_error(run)
    with pytest.raises(cpu.type, match="Expect _random_samples.size"):
        run("tpu")


def test_meta_messages_read_as_cpus():
    """A Python meta kernel's message built from an indented string comes out with single spaces."""
    x = torch.randn(1, 8, 5, 4, requires_grad=True)
    pattern = "Expected grad_output to have non-zero size for non-batch dimensions"
    for device in ("cpu", "tpu"):
        with pytest.raises(RuntimeError, match=pattern):
            torch.nn.functional.adaptive_avg_pool2d(x.detach().to(device).requires_grad_(), 0).sum().backward()


@pytest.mark.parametrize("f", [
    lambda x: torch.nn.FractionalMaxPool2d(3, output_ratio=(0.5, 0.5))(x),
    lambda x: torch.nn.functional.max_unpool2d(*torch.nn.functional.max_pool2d(x, 2, return_indices=True), 2),
    lambda x: torch.nn.functional.adaptive_max_pool2d(x, 3),
    lambda x: torch.nn.functional.avg_pool2d(x, 3, stride=2),
], ids=["fractional_max_pool2d", "max_unpool2d", "adaptive_max_pool2d", "avg_pool2d"])
def test_zero_batch_gives_empty_results_and_gradients(f):
    """Results with no elements need no kernel: window and modulo arithmetic never see a zero size."""
    x = torch.randn(0, 3, 10, 8)
    t = x.to("tpu").requires_grad_()
    expected, out = f(x), f(t)
    assert out.shape == expected.shape
    out.sum().backward()
    assert t.grad.shape == x.shape


@pytest.mark.parametrize("move", [
    lambda: torch.zeros(2, dtype=torch.float8_e5m2).to("tpu"),
    lambda: torch.zeros(2, dtype=torch.float8_e5m2, device="tpu"),
    lambda: torch.zeros(2, dtype=torch.float32, device="tpu").to(torch.float8_e5m2),
], ids=["upload", "factory", "cast"])
def test_a_dtype_the_device_lacks_is_named_however_it_arrives(move):
    """A dtype tpu does not hold (float8): a TypeError naming it, also for an upload, where numpy's
    own message ("Got unsupported ScalarType ...") named neither the dtype nor the device."""
    with pytest.raises(TypeError, match="torch.float8_e5m2 is not supported on the tpu device"):
        move()


def test_where_takes_a_uint8_condition_as_cpu():
    """CPU's where takes a uint8 condition (deprecated, with a warning) as the bool it holds."""
    import warnings

    cond = torch.tensor([1, 0, 2, 0], dtype=torch.uint8)
    x, y = torch.arange(4.0), -torch.arange(4.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        want = torch.where(cond, x, y)
        got = torch.where(cond.to("tpu"), x.to("tpu"), y.to("tpu"))
    assert torch.equal(got.cpu(), want)


_INTEGRAL_CALLS = {
    "softplus": (lambda t: torch.nn.functional.softplus(t), torch.int64),
    "hardshrink": (lambda t: torch.nn.functional.hardshrink(t), torch.int32),
    "lerp": (lambda t: t.lerp(t, 0.5), torch.int64),
    "addcmul": (lambda t: t.addcmul(t, t), torch.bool),
    "std": (lambda t: t.std(), torch.int16),
    "argmax": (lambda t: t.argmax(), torch.bool),
    "relu_": (lambda t: t.relu_(), torch.bool),
    "log_softmax": (lambda t: t.log_softmax(0), torch.uint8),
    "grid_sample": (lambda t: torch.nn.functional.grid_sample(  # served by a decomposition
        t.view(1, 1, 2, 2), torch.zeros(1, 1, 1, 2, device=t.device), align_corners=False), torch.int32),
    "uniform_": (lambda t: t.uniform_(), torch.int64),  # a random op
}


@pytest.mark.parametrize("name", sorted(_INTEGRAL_CALLS))
def test_an_integer_input_cpu_has_no_kernel_for_raises_as_on_cpu(name):
    """torch's meta kernels accept integer and bool inputs that XLA would compute and CPU's kernels
    refuse; tpu refuses them as CPU does, with CPU's exception type and words, and the op named."""
    f, dtype = _INTEGRAL_CALLS[name]
    x = torch.arange(4).to(dtype)
    with pytest.raises(Exception) as cpu_err:
        f(x.clone())
    with pytest.raises(cpu_err.type) as tpu_err:
        f(x.to("tpu"))
    assert str(cpu_err.value) in str(tpu_err.value)
    assert "aten." in str(tpu_err.value)


_INTEGER_ONLY_CALLS = {
    "<< (meta refuses)": (lambda t: t << 1, torch.float32),
    ">>= (meta refuses)": (lambda t: t.__irshift__(1), torch.float64),
    "bitwise_left_shift (XLA refuses)": (lambda t: torch.bitwise_left_shift(t, 1), torch.float32),
    "& a number (XLA refuses)": (lambda t: t & 1, torch.float32),
    "| a tensor (XLA refuses)": (lambda t: t | t, torch.float16),
    "bitwise_not (XLA refuses)": (lambda t: torch.bitwise_not(t), torch.float32),
    "gcd (a decomposition)": (lambda t: torch.gcd(t, t), torch.float32),
    "neg of bool": (lambda t: t.neg(), torch.bool),
}


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("name", sorted(_INTEGER_ONLY_CALLS))
def test_a_float_input_to_an_integer_only_op_raises_as_on_cpu(name, mode):
    """CPU's dtype switch refuses a float input to a bitwise op with NotImplementedError (torch
    2.11 on); the meta kernel's own check (a RuntimeError) or XLA's refusal (a TypeError) must not
    reach the user's except clause in its place."""
    f, dtype = _INTEGER_ONLY_CALLS[name]
    x = torch.arange(4).to(dtype)
    with pytest.raises(Exception) as cpu_err:
        f(x.clone())
    with torch_tpu.set_eager_mode(mode), pytest.raises(cpu_err.type) as tpu_err:
        f(x.to("tpu")).cpu()
    assert type(tpu_err.value) is type(cpu_err.value)


def test_asking_cpu_about_a_random_ops_dtype_leaves_cpus_generator_alone():
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    torch.zeros(5, dtype=torch.int64, device="tpu").random_(0, 7)  # CPU is asked whether it takes int64: it does
    torch.zeros(5, device="tpu").bernoulli_(0.5)
    assert torch.equal(torch.rand(4), want)


def test_integer_inputs_cpu_takes_still_compute():
    x = torch.arange(-3, 5, dtype=torch.int32)
    for f in (lambda t: t.abs(), lambda t: t.clamp(-1, 2), lambda t: t.cumsum(0), lambda t: t.sort().values,
              lambda t: (t * 3) // 2, lambda t: t.bool().logical_and(t.bool())):
        assert torch.equal(f(x.to("tpu")).cpu(), f(x))


@pytest.mark.parametrize("where", ["all", "after a slice"])
def test_one_value_through_a_uint8_mask_raises_as_on_cpu_and_more_values_write(where):
    """CPU writes one value through a mask with masked_fill_, which refuses uint8; more values take
    the deprecated uint8 mask (with its warning), as on CPU."""
    base, mask = torch.zeros(2, 4), torch.tensor([1, 0, 1, 0], dtype=torch.uint8)
    key = (slice(None), mask) if where == "after a slice" else mask.expand(2, 4)

    def on(dev):
        if isinstance(key, tuple):
            return tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in key)
        return key.to(dev)

    for dev in ("cpu", "tpu"):
        x, k = base.to(dev), on(dev)
        with pytest.raises(RuntimeError, match="masked_fill_ only supports boolean masks"):
            x[k] = 1.0
    cpu, tpu = base.clone(), base.to("tpu")
    vals = torch.tensor([2.0, 3.0, 4.0, 5.0]) if where == "all" else torch.tensor([2.0, 3.0])
    with pytest.warns(UserWarning, match="uint8 is now deprecated"):
        cpu[key] = vals
    with pytest.warns(UserWarning, match="uint8 is now deprecated"):
        tpu[on("tpu")] = vals.to("tpu")
    assert torch.equal(tpu.cpu(), cpu)


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_an_allocation_xla_cannot_make_raises_torchs_out_of_memory_error(mode):
    """CPU raises a RuntimeError for an allocation it cannot make, CUDA ``torch.OutOfMemoryError``
    (a RuntimeError): XLA's RESOURCE_EXHAUSTED is the latter, whichever sync point reports it, with
    the op named, and the device works on afterwards."""
    n = 2**40  # 4 TiB of float32: no machine here has it
    assert issubclass(cpu_error(torch.zeros, n), RuntimeError)
    with torch_tpu.set_eager_mode(mode):
        with pytest.raises(torch.OutOfMemoryError, match=r"^tpu out of memory\. .*RESOURCE_EXHAUSTED") as e:
            x = torch.zeros(n, device="tpu")  # kept: fused, a sum of zeros it drops would need no memory
            x.sum().item()
        assert len(e.value.args) == 1
        assert torch.tpu.OutOfMemoryError is torch.cuda.OutOfMemoryError
        assert_same(torch.arange(4, device="tpu") * 2, torch.arange(4) * 2)


def test_accelerates_batch_size_finder_steps_down_past_a_tpu_out_of_memory():
    """``accelerate.utils.find_executable_batch_size``, written for CUDA, halves the batch when the
    step raises an out-of-memory error it recognises; on tpu it must recognise XLA's."""
    memory = pytest.importorskip("accelerate.utils.memory")
    tried = []

    @memory.find_executable_batch_size(starting_batch_size=64)
    def step(batch_size):
        tried.append(batch_size)
        # more than 16 rows asks XLA for an allocation it cannot make
        x = torch.ones(2**40 if batch_size > 16 else batch_size, device="tpu")
        return float(x.sum())

    result = step()
    # accelerate's own schedule (it has multiplied by 0.9, and halved in other versions): every size
    # over 16 failed, the first at most 16 ran
    assert tried[0] == 64 and all(b > 16 for b in tried[:-1]) and tried[-1] <= 16
    assert result == float(tried[-1])


_FILLS = [(torch.int64, float("inf")), (torch.int64, float("nan")), (torch.int32, 2**31), (torch.uint8, 300),
          (torch.uint8, -1), (torch.uint8, -256), (torch.int8, 200), (torch.uint8, 2.5), (torch.float16, 1e10),
          (torch.float16, float("inf")), (torch.bfloat16, 1e300), (torch.float32, 1e300), (torch.bool, 5),
          (torch.float32, 1 + 1j), (torch.float64, 2j), (torch.int64, 2 + 0j), (torch.bool, 1j),
          (torch.complex64, 1 + 1j)]


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("shape", [(), (1,), (3,), (5000,)])
def test_fill_refuses_a_number_the_dtype_cannot_hold_as_cpu(shape, mode):
    """fill_, torch.full and friends: a number the dtype cannot hold (inf into int64, 300 into
    uint8) raises CPU's RuntimeError instead of being clamped or wrapped; numbers CPU accepts
    (-1 into uint8 wraps, a single element skips the check) give CPU's values. Small tensors take
    the kept-constant path, 5,000 elements the program."""
    for dtype, value in _FILLS:
        try:
            expected = torch.full(shape, value, dtype=dtype)
        except RuntimeError as e:
            with torch_tpu.set_eager_mode(mode), pytest.raises(RuntimeError, match=re.escape(str(e))):
                torch.empty(shape, dtype=dtype, device="tpu").fill_(value).cpu()
            continue
        with torch_tpu.set_eager_mode(mode):
            got = torch.full(shape, value, dtype=dtype, device="tpu").cpu()
        assert torch.equal(got, expected) or (got.isnan().all() and expected.isnan().all()), (dtype, value)


_INDEX_FILLS = {
    "complex number into float": lambda x, i, d: x.index_fill_(1, i, 1 + 1j),
    "complex number, functional": lambda x, i, d: x.index_fill(1, i, 2j),
    "complex 0-d tensor": lambda x, i, d: x.index_fill_(1, i, torch.tensor(1 + 1j, device=d)),
    "1-d value tensor": lambda x, i, d: x.index_fill_(1, i, torch.ones(1, device=d)),
    "int32 index": lambda x, i, d: x.index_fill_(1, i.int(), 1.0),
    "float index": lambda x, i, d: x.index_fill_(1, i.float(), 1.0),
    "2-d index": lambda x, i, d: x.index_fill_(1, i.view(1, 1), 1.0),
    "out of range, complex number": lambda x, i, d: x.index_fill_(1, i + 5, 1 + 1j),
    "out of range": lambda x, i, d: x.index_fill_(1, i + 5, 1.0),
    "complex number into complex": lambda x, i, d: x.to(torch.complex64).index_fill_(1, i, 1 + 1j),
    "into a 0-d tensor": lambda x, i, d: x[0, 0].index_fill(0, i, -1.0),
}


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("name", sorted(_INDEX_FILLS))
def test_index_fill_refuses_as_cpu(name, mode):
    """index_fill's own refusals, in CPU's order and words: a value tensor that is not 0-dim, an
    index that is not int64 (IndexError, not JAX's TypeError) or not a vector, a complex value for a
    real tensor (the program cast it, dropping the imaginary part), then the bounds."""
    f = _INDEX_FILLS[name]
    x = torch.arange(6.0).view(2, 3)
    i = torch.tensor([0])
    try:
        expected = f(x.clone(), i, "cpu")
    except Exception as e:  # noqa: BLE001 - whatever CPU raises, tpu raises the same
        with torch_tpu.set_eager_mode(mode), pytest.raises(type(e), match=re.escape(str(e))):
            f(x.to("tpu"), i.to("tpu"), "tpu").cpu()
        return
    with torch_tpu.set_eager_mode(mode):
        got = f(x.to("tpu"), i.to("tpu"), "tpu").cpu()
    assert torch.equal(got, expected)


def _overlap_operands(device: str) -> dict:
    torch.manual_seed(3)
    return {
        "x": torch.rand(1).to(device).expand(6),  # internal overlap: six elements, one memory location
        "y": torch.rand(6).to(device),
        "ind": torch.tensor([2, 1, 0]).to(device),
        "v": torch.rand(3).to(device),
        "m": torch.tensor([True, False, True, True, False, False]).to(device),
        "d": torch.randn(18, dtype=torch.float64).to(device),
    }


_OVERLAPS = {
    "copy_ into an expanded tensor": lambda o: o["x"].copy_(o["y"]),
    "copy_ partly over its source": lambda o: o["d"][0:9].copy_(o["d"][1:10]),
    "copy_ onto itself": lambda o: o["d"][0:9].copy_(o["d"][0:9]),
    "copy_ into its transpose": lambda o: o["d"][:9].view(3, 3).t().copy_(o["d"][:9].view(3, 3)),
    "copy_ from elsewhere in the storage": lambda o: o["d"][0:9].copy_(o["d"][9:18]),
    "index_add_ into an expanded tensor": lambda o: o["x"].index_add_(0, o["ind"], o["v"]),
    "index_add_ of its own slice": lambda o: o["y"].index_add_(0, o["ind"], o["y"][:3]),
    "index_add_ over its index": lambda o: o["ind"].index_add_(0, o["ind"], o["ind"].clone()),
    "index_add_ of itself": lambda o: o["ind"].index_add_(0, o["ind"].clone(), o["ind"]),
    "index_copy_ into an expanded tensor": lambda o: o["x"].index_copy_(0, o["ind"], o["v"]),
    "index_copy_ of its own slice": lambda o: o["y"].index_copy_(0, o["ind"], o["y"][:3]),
    "index_fill_ over its index": lambda o: o["ind"].index_fill_(0, o["ind"], 0),
    "<<= partly over itself": lambda o: o["ind"][:-1].__ilshift__(o["ind"][1:]),
    ">>= partly over itself": lambda o: o["ind"][:-1].__irshift__(o["ind"][1:]),
    "put_ into an expanded tensor": lambda o: o["x"].put_(o["ind"], o["v"]),
    "put_ of its own element": lambda o: o["y"].put_(o["ind"][0], o["y"][0]),
    "put_ over its index": lambda o: o["ind"].put_(o["ind"], o["ind"]),
    "index_put_ of its own element": lambda o: o["y"].index_put_((o["ind"],), o["y"][0]),
    "index_put_ over its index": lambda o: o["ind"].index_put_((o["ind"].clone(),), o["ind"]),
    "masked_fill_ over its mask": lambda o: o["m"][1:].masked_fill_(o["m"][:-1], False),
    "masked_scatter_ into an expanded tensor": lambda o: o["x"].masked_scatter_(o["m"], o["v"]),
    "scatter_ into an expanded tensor": lambda o: o["x"].scatter_(0, o["ind"], o["v"]),
    "scatter_ of itself": lambda o: o["v"].scatter_(0, o["ind"], o["v"]),
    "scatter_ over its index": lambda o: o["ind"].scatter_(0, o["ind"], o["ind"].clone()),
    "add_ of itself": lambda o: o["y"].add_(o["y"]),
    "add_ of a shifted self": lambda o: o["y"][1:].add_(o["y"][:-1]),
    "add out= over a shifted input": lambda o: torch.add(o["y"][:-1], 1, out=o["y"][1:]),
    "addcmul out= over an input": lambda o: torch.addcmul(o["d"][1:10], o["d"][9:18], o["d"][9:18], out=o["d"][0:9]),
    "lerp_ of a shifted self": lambda o: o["y"][:3].lerp_(o["y"][1:4], 0.5),
    "mul_ of interleaved halves": lambda o: o["y"][::2].mul_(o["y"][1::2]),
    "silu out= over its transposed input": lambda o: torch.ops.aten.silu.out(
        o["d"][:9].view(3, 3), out=o["d"][:9].view(3, 3).t()),
}


def _overlap_outcome(f, device: str) -> tuple:
    operands = _overlap_operands(device)
    try:
        f(operands)
    except RuntimeError as e:
        return "RuntimeError", str(e), {k: v.cpu() for k, v in operands.items()}
    return "ok", "", {k: v.cpu() for k, v in operands.items()}


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("name", sorted(_OVERLAPS))
def test_writes_over_their_own_inputs_refuse_as_cpu(name, mode):
    """CPU refuses an in-place or out= write into a tensor with internal overlap (an expand), or
    over memory an input partly shares (elementwise ops, copy_), or shares at all (the index and
    source of the indexed writes), in its words; the same memory with the same strides is fine. tpu
    computed all of these from the inputs as they were."""
    f = _OVERLAPS[name]
    kind, message, values = _overlap_outcome(f, "cpu")
    with torch_tpu.set_eager_mode(mode):
        got_kind, got_message, got_values = _overlap_outcome(f, "tpu")
    assert got_kind == kind, (got_message, message)
    assert message in got_message
    for k in values:
        torch.testing.assert_close(got_values[k], values[k], msg=k)


_EXPANDED_FILLS = {
    "index_fill_": lambda o: o["x"].index_fill_(0, o["ind"], 1.0),
    "index_put_": lambda o: o["x"].index_put_((o["ind"],), o["v"]),
    "masked_fill_": lambda o: o["x"].masked_fill_(o["m"], 0.0),
    "masked_fill_ of a tensor value": lambda o: o["x"].masked_fill_(o["m"], torch.tensor(0.0, device=o["x"].device)),
}


@pytest.mark.parametrize("name", sorted(_EXPANDED_FILLS))
def test_fills_of_expanded_tensors_warn_as_cpu(name):
    """CPU's deprecation warning for these fills into an expanded tensor (it writes them anyway)."""
    f = _EXPANDED_FILLS[name]
    with pytest.warns(UserWarning, match="on expanded tensors is deprecated") as cpu:
        f(_overlap_operands("cpu"))
    with pytest.warns(UserWarning, match="on expanded tensors is deprecated") as tpu:
        f(_overlap_operands("tpu"))
    wanted = {str(w.message).split(" (Triggered internally")[0] for w in cpu if "expanded" in str(w.message)}
    assert wanted <= {str(w.message) for w in tpu}


@pytest.mark.parametrize("mode", ["strict", "fused"])
@pytest.mark.parametrize("warn_only", [False, True])
def test_deterministic_algorithms_alert_as_on_cpu(warn_only, mode):
    """Under ``torch.use_deterministic_algorithms(True)``: ``put_`` without accumulation and
    ``max_unpool`` alert as on CPU (two values for one position, either may land); ``histc`` and
    ``median`` with indices do not, as on CPU (torch's meta kernels take a meta tensor for a CUDA
    one and raised CUDA's alerts)."""
    def calls(device):
        a = torch.arange(10.0, device=device)
        i = torch.tensor([0, 0], device=device)
        v = torch.tensor([5.0, 6.0], device=device)
        return {
            "put_": lambda: a.clone().put_(i, v),
            "put": lambda: a.put(i, v),
            "put_ accumulating": lambda: a.clone().put_(i, v, accumulate=True),
            "histc": lambda: torch.histc(a, bins=4),
            "median with indices": lambda: a.median(0),
            "take": lambda: torch.take(a, i),
            "max_unpool2d": lambda: torch.nn.functional.max_unpool2d(
                a[:4].view(1, 1, 2, 2), torch.zeros(1, 1, 2, 2, dtype=torch.long, device=device), 2),
            "max_unpool3d": lambda: torch.nn.functional.max_unpool3d(
                a[:8].view(1, 1, 2, 2, 2), torch.zeros(1, 1, 2, 2, 2, dtype=torch.long, device=device), 2),
        }

    def outcome(f):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                r = f()
                if isinstance(r, torch.Tensor):
                    r.cpu()
            except RuntimeError as e:
                return "raised" if "does not have a deterministic implementation" in str(e) else repr(e)
        return "warned" if any("deterministic implementation" in str(w.message) for w in seen) else "ran"

    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        want = {k: outcome(f) for k, f in calls("cpu").items()}
        with torch_tpu.set_eager_mode(mode):
            got = {k: outcome(f) for k, f in calls("tpu").items()}
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn_only)
    assert got == want
    assert want["put_"] == want["max_unpool3d"] == ("warned" if warn_only else "raised")


@pytest.mark.parametrize("shapes", [
    ((5, 5, 5, 5), (1, 1, 4, 4)),  # batch sizes differ
    ((1, 1, 3, 3), (1, 2, 2, 3)),  # a grid of 3-d points for a 2-d input
    ((1, 1, 3, 3), (1, 2, 2, 2, 2)),  # a 5-d grid
    ((1, 1, 0, 3), (1, 2, 2, 2)),  # an empty spatial dim
])
@pytest.mark.parametrize("call", ["grid_sampler_2d", "grid_sample"])
def test_grid_sampler_2d_shape_checks_say_what_cpu_says(call, shapes):
    """Eager mode serves grid_sampler_2d by torch's decomposition, whose asserts raised
    AssertionError or ValueError ("too many values to unpack"); CPU's RuntimeError and words come first."""
    def f(x, g):
        if call == "grid_sample":
            return torch.nn.functional.grid_sample(x, g, align_corners=True)
        return torch.grid_sampler_2d(x, g, 0, 0, True)

    x, g = torch.randn(shapes[0]), torch.rand(shapes[1]) * 2 - 1
    with pytest.raises(Exception) as cpu_err:
        f(x, g)
    with pytest.raises(type(cpu_err.value), match=re.escape(str(cpu_err.value))):
        f(x.to("tpu"), g.to("tpu")).cpu()


@pytest.mark.parametrize("n", [2, 3])
def test_fractional_pooling_samples_of_another_dtype_are_refused_as_on_cpu(n):
    """module_db builds float64 samples for every input dtype; CPU refuses them for float32."""
    def run(device):
        x = torch.randn(2, 4, *([6] * n), device=device)
        samples = torch.rand(2, 4, n, dtype=torch.float64, device=device)
        return getattr(torch.ops.aten, f"fractional_max_pool{n}d")(x, [2] * n, [3] * n, samples)

    cpu = _cpu_error(run)
    with pytest.raises(cpu.type, match="Expect _random_samples to have the same dtype as input"):
        run("tpu")


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("shape, dim", [((5, 0), 1), ((0, 5), 0), ((2, 0, 3), 1), ((0, 5), 1), ((2, 0, 3), 2)])
def test_unique_along_a_dim_of_an_empty_tensor_as_on_cpu(shape, dim, consecutive):
    """Nothing along dim: the input's own shape back; another dim empty: CPU's refusal."""
    fn = torch.unique_consecutive if consecutive else torch.unique

    def run(device):
        return fn(torch.empty(shape, device=device), dim=dim, return_inverse=True, return_counts=True)

    try:
        want = run("cpu")
    except RuntimeError as e:
        with pytest.raises(RuntimeError, match=str(e)):
            run("tpu")
        return
    assert [tuple(t.shape) for t in run("tpu")] == [tuple(t.shape) for t in want]
