"""The host path for small integer ops whose shapes are new at every call (torch_tpu.dispatch.host_placement),
against CPU: the same values, no compiles once an op line churns, and nothing else affected."""

from __future__ import annotations

import torch

import torch_tpu


def _grow(device, steps, dtype=torch.int64):
    """A sequence extended by a column per step, its last column read back, as a decoding loop does."""
    ids = torch.zeros(3, 3, dtype=dtype, device=device)  # 3 rows: shapes no other test compiles
    lasts, compiles = [], []
    for i in range(steps):
        new = (ids[:, -1:] + i + 1) % 7  # a view of a growing base, and a changing Python int
        ids = torch.cat([ids, new], dim=-1)
        lasts.append(ids[:, -1].clone())
        if device != "cpu":
            compiles.append(torch_tpu.metrics()["compile_count"])
    return ids, lasts, compiles


def test_a_growing_integer_sequence_stops_compiling_and_matches_cpu():
    before = dict(torch_tpu.metrics()["host_op_counts"])
    got, lasts, compiles = _grow("tpu", 12)
    want, want_lasts, _ = _grow("cpu", 12)
    assert torch.equal(got.cpu(), want)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(lasts, want_lasts))
    assert compiles[-1] - compiles[5] == 0, compiles
    after = torch_tpu.metrics()["host_op_counts"]
    assert after.get("aten.cat.default", 0) > before.get("aten.cat.default", 0)
    assert "host" in torch_tpu.metrics_report()


def test_floating_point_tensors_always_compile():
    before = sum(torch_tpu.metrics()["host_op_counts"].values())
    x = torch.zeros(2, 1, device="tpu")
    for _ in range(6):
        x = torch.cat([x, x[:, -1:] + 0.5], dim=-1)
    assert torch.allclose(x.cpu(), torch.arange(7).float().mul(0.5).expand(2, 7))
    assert sum(torch_tpu.metrics()["host_op_counts"].values()) == before


def test_one_line_at_a_few_shapes_stays_on_the_device():
    """A layer that runs one line at three shapes (three resolutions, say) keeps its programs."""
    before = sum(torch_tpu.metrics()["host_op_counts"].values())
    for _ in range(3):
        for n in (4, 8, 16):
            y = torch.arange(n, device="tpu") * 3 + 1
    assert torch.equal(y.cpu(), torch.arange(16) * 3 + 1)
    assert sum(torch_tpu.metrics()["host_op_counts"].values()) == before


def test_the_host_path_can_be_turned_off(monkeypatch):
    from torch_tpu.dispatch import host_placement as _host_placement

    monkeypatch.setattr(_host_placement, "CHURN_AFTER", 0)
    before = sum(torch_tpu.metrics()["host_op_counts"].values())
    got, _, compiles = _grow("tpu", 8)
    assert torch.equal(got.cpu(), _grow("cpu", 8)[0])
    assert compiles[-1] > compiles[4]  # every length compiles again
    assert sum(torch_tpu.metrics()["host_op_counts"].values()) == before


def _grow_from_views(device, dtype):
    """A growing sequence fed with strided views (a transpose's columns) of an uploaded tensor."""
    base = (torch.arange(15).reshape(3, 5) % 4).to(dtype).to(device)
    seq = base.t()[:, :1]
    for i in range(9):
        seq = torch.cat([seq, base.t()[:, i % 3:i % 3 + 1]], dim=1)
    return base, seq


def test_the_host_path_reads_strided_views_and_small_dtypes_like_cpu():
    """The host ops read their inputs' host copies in place (no copy): every view geometry and
    dtype gives CPU's values, and the inputs are left as they were."""
    for dtype in (torch.int32, torch.uint8, torch.bool):
        before = torch_tpu.metrics()["host_op_counts"].get("aten.cat.default", 0)
        base, got = _grow_from_views("tpu", dtype)
        want_base, want = _grow_from_views("cpu", dtype)
        assert got.dtype == dtype and torch.equal(got.cpu(), want), dtype
        assert torch.equal(base.cpu(), want_base), dtype
        assert torch_tpu.metrics()["host_op_counts"].get("aten.cat.default", 0) > before, dtype


def _bookkeeping(device, steps):
    """Positions extended as ``generate()`` extends them: ``last + 1`` between two ``cat``s, then
    ops of fixed shapes on the result (a comparison, a reduction, a cast). Returns the positions,
    each step's results, and on tpu the compile count after each step."""
    pos = torch.arange(4, device=device).view(1, 4).expand(2, 4).clone()
    seen, compiles = [], []
    for _ in range(steps):
        nxt = pos[:, -1:] + 1
        pos = torch.cat([pos, nxt], dim=-1)
        seen.append(((nxt * 2) % 5 == 1).any(-1).to(torch.int32))
        if device != "cpu":
            compiles.append(torch_tpu.metrics()["compile_count"])
    return pos, seen, compiles


def test_ops_on_host_results_stay_on_the_host_and_match_cpu():
    """An op whose tensor inputs are all host-path results runs on the host: ``pos[:, -1:] + 1`` has
    the same shape at every step, and compiled it would be a one-op program that the next host
    ``cat`` waits for. The values are CPU's, nothing compiles once the line churns, and a tensor
    that was uploaded (not computed on the host) or computed on the device still compiles."""
    before = dict(torch_tpu.metrics()["host_op_counts"])
    got, seen, compiles = _bookkeeping("tpu", 16)
    want, want_seen, _ = _bookkeeping("cpu", 16)
    assert torch.equal(got.cpu(), want)
    assert all(a.dtype == b.dtype and torch.equal(a.cpu(), b) for a, b in zip(seen, want_seen))
    assert compiles[-1] == compiles[5], compiles  # the first steps, before cat churns, compile
    after = torch_tpu.metrics()["host_op_counts"]
    for op in ("aten.add.Tensor", "aten.remainder.Scalar", "aten.eq.Scalar", "aten.any.dim"):
        assert after.get(op, 0) >= before.get(op, 0) + 10, op

    uploaded = torch.tensor([[3], [4]], device="tpu")  # from a loader: its ops keep their programs
    on_device = torch.ones(2, 1, dtype=torch.int64, device="tpu") * 3
    for x in (uploaded, on_device):
        before = sum(torch_tpu.metrics()["host_op_counts"].values())
        assert torch.equal((x + 7).cpu(), x.cpu() + 7)
        assert sum(torch_tpu.metrics()["host_op_counts"].values()) == before


def test_a_loop_whose_lengths_were_compiled_before_still_moves_to_the_host():
    """Programs compiled before for the lengths a loop reaches first (by another line, or an earlier
    loop that stopped there) are cache hits for it: they still step its line's progression, so the
    loop's line churns as it would in a fresh process and nothing compiles past those lengths."""
    for n in (9, 6, 11, 7, 10, 8):  # one line, lengths in no progression: compiled, no churn
        a = torch.arange(n, device="tpu").view(1, n).expand(2, n).clone()
        torch.cat([a, a[:, -1:] + 1], dim=-1)
    got, seen, compiles = _bookkeeping("tpu", 16)
    want, want_seen, _ = _bookkeeping("cpu", 16)
    assert torch.equal(got.cpu(), want)
    assert all(a.dtype == b.dtype and torch.equal(a.cpu(), b) for a, b in zip(seen, want_seen))
    assert compiles[-1] == compiles[5], compiles


def _extend(ids, col):
    return torch.cat([ids, col], dim=-1)  # the one line every call below goes through


def test_a_churning_line_stays_on_the_host_and_its_results_stay_private():
    """Once ``cat`` churns at a line, later calls there run on the host at once, also with another
    element type, with CPU's values and nothing compiled. A host op's result is the CPU tensor that
    the next host ops read as it is: reading it back and changing that copy leaves it unchanged."""

    def grow(device, dtype, steps):
        ids = torch.zeros(2, 1, dtype=dtype, device=device)
        for i in range(steps):
            ids = _extend(ids, (ids[:, -1:] + i) % 5)
        return ids

    got, want = grow("tpu", torch.int64, 8), grow("cpu", torch.int64, 8)
    assert torch.equal(got.cpu(), want)
    copy = got.cpu()
    copy += 100
    assert torch.equal(got.cpu(), want)
    assert torch.equal(_extend(got, got[:, :1]).cpu(), _extend(want, want[:, :1]))

    compiles = torch_tpu.metrics()["compile_count"]
    hosted = torch_tpu.metrics()["host_op_counts"].get("aten.cat.default", 0)
    small = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device="tpu")
    col = torch.tensor([[5], [6]], dtype=torch.int32, device="tpu")
    assert torch.equal(_extend(small, col).cpu(), _extend(small.cpu(), col.cpu()))
    assert torch_tpu.metrics()["compile_count"] == compiles
    assert torch_tpu.metrics()["host_op_counts"]["aten.cat.default"] == hosted + 1


def _append_here(ids, col):
    return torch.cat([ids, col], dim=-1)  # a line that churns below


def _append_there(ids, col):
    return torch.cat([ids, col], dim=-1)  # another line, at one shape: it compiles


def test_a_churning_line_runs_on_the_host_where_another_line_compiled_the_signature():
    """Programs are per signature, host decisions per line. Once a line churns, a call there whose
    signature another line compiled (a decoding loop's position ids and its attention mask grow
    through ``cat``s of the same shapes) runs on the host as the line's other calls do, so a second
    decoding call takes the first's paths and compiles nothing new downstream."""
    col = torch.ones(5, 1, dtype=torch.int64, device="tpu") * 2  # computed on the device, 5 rows: no other test's
    for width in (3, 4, 5, 6):  # the line churns: its calls from the third on run on the host
        _append_here(torch.zeros(5, width, dtype=torch.int64, device="tpu") + 1, col)
    base = torch.zeros(5, 9, dtype=torch.int64, device="tpu") + 1  # on the device, not a host result
    compiles = torch_tpu.metrics()["compile_count"]
    there = _append_there(base, col)  # compiles cat of [5, 9] and [5, 1] at the other line
    assert torch_tpu.metrics()["compile_count"] == compiles + 1
    before = torch_tpu.metrics()["host_op_counts"].get("aten.cat.default", 0)
    here = _append_here(base, col)  # that program exists; the churning line runs on the host anyway
    assert torch_tpu.metrics()["host_op_counts"].get("aten.cat.default", 0) == before + 1
    expected = torch.cat([torch.ones(5, 9, dtype=torch.int64), torch.full((5, 1), 2)], -1)
    assert torch.equal(here.cpu(), expected) and torch.equal(there.cpu(), expected)
