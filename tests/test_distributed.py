"""The ``tpu`` c10d backend with real processes on localhost: the XLA-collective path (the default
when the group is created before the first tpu tensor) and the gloo host path.

Each test starts a small world of spawned processes (TORCH_TPU_PLATFORM=cpu), each under a hard
timeout; the workers write their results to files that the test then checks. Several checks share
one world because starting a process (torch + jax) costs seconds.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import socket
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

STEPS, BATCH, D_IN, D_HID = 5, 16, 8, 32


# ------------------------------------------------------------------------------ the launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, n: int, port: int, scenario: str, outdir: str, timeout_s: float) -> None:
    os.environ["TORCH_TPU_PLATFORM"] = "cpu"
    scenario, _, path = scenario.partition(":")  # "name:host" forces the gloo host path
    if path:
        os.environ["TORCH_TPU_DIST_PATH"] = path
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    import torch_tpu  # noqa: F401
    import torch_tpu.distributed  # noqa: F401  (registers the "tpu" c10d backend)

    try:
        result = {"ok": True, "value": _SCENARIOS[scenario](rank, n, port, timeout_s)}
    except BaseException as e:  # noqa: BLE001 (reported to the parent)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # skip the interpreter teardown (seconds with jax) once the result is written


def _launch(scenario: str, n: int, tmp_path, timeout_s: float = 120.0, wait_for=None) -> dict:
    """Runs ``scenario`` on ``n`` spawned ranks; returns {rank: result} for the ranks in ``wait_for``
    (all by default) and kills every process that is still running after them or after the deadline.
    The deadline catches a hang: on a loaded 2-core machine (load average 9) two ranks' start-up and
    collectives took about 40 s, and 60 s was once too little there."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, n, port, scenario, str(tmp_path), timeout_s)) for r in range(n)]
    for p in procs:
        p.start()
    wait_for = range(n) if wait_for is None else wait_for
    deadline = time.monotonic() + timeout_s
    try:
        for r in wait_for:
            procs[r].join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    out = {}
    for r in wait_for:
        path = tmp_path / f"{r}.pkl"
        assert path.exists(), f"rank {r} of {scenario} wrote no result (hung past {timeout_s}s or crashed)"
        out[r] = pickle.loads(path.read_bytes())
        assert out[r]["ok"], f"rank {r}: {out[r]['error']}\n{out[r]['trace']}"
    return {r: o["value"] for r, o in out.items()}


def _init(rank: int, n: int, port: int, backend: str | None = "tpu", timeout_s: float = 30.0) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=n,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# ------------------------------------------------------------------------------ scenarios
def _collectives(rank: int, n: int, port: int, timeout_s: float) -> dict:
    import torch.distributed as dist

    from torch_tpu.distributed.c10d import TPUProcessGroup

    _init(rank, n, port, backend=None)  # no backend: "tpu" is the default for the tpu device
    r: dict = {"group": type(dist.group.WORLD).__name__, "is_tpu_group": isinstance(dist.group.WORLD, TPUProcessGroup),
               "path": getattr(dist.group.WORLD, "path", None)}
    x = torch.arange(4.0, device="tpu") + rank
    for op in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        y = x.clone()
        dist.all_reduce(y, op=getattr(dist.ReduceOp, op))
        r[op] = (y.device.type, y.cpu())
    y = x.clone()
    dist.broadcast(y, src=n - 1)
    r["broadcast"] = y.cpu()
    outs = [torch.empty(4, device="tpu") for _ in range(n)]
    dist.all_gather(outs, x)
    r["all_gather"] = [o.cpu() for o in outs]
    out = torch.empty(4 * n, device="tpu")
    dist.all_gather_into_tensor(out, x)
    r["all_gather_into_tensor"] = out.cpu()
    out = torch.empty(4 // n, device="tpu")
    dist.reduce_scatter_tensor(out, x)
    r["reduce_scatter_tensor"] = out.cpu()
    out = torch.empty(4, device="tpu")
    dist.all_to_all_single(out, x)
    r["all_to_all_single"] = out.cpu()
    dist.barrier()
    # crossing isend/irecv pairs: both ranks post the send first, which must not deadlock
    peer = (rank + 1) % n
    got = torch.empty(4, device="tpu")
    ws = [dist.isend(x * 10, peer), dist.irecv(got, (rank - 1) % n)]
    for w in ws:
        w.wait()
    r["sendrecv"] = got.cpu()
    y = x.clone()
    work = dist.all_reduce(y, async_op=True)
    work.wait()
    r["async"] = y.cpu()
    # a view (every other element) is reduced in place
    z = torch.zeros(8, device="tpu")
    z[::2] = x
    dist.all_reduce(z[::2])
    r["view"] = z.cpu()
    # divergent ranks: only rank 0 reads values on the host, then everyone meets again
    if rank == 0:
        r["item"] = [float((x * i).sum().item()) for i in range(3)]
    y = x.clone()
    dist.all_reduce(y)
    r["after_item"] = y.cpu()
    # a mismatched collective raises on every rank, and the group stays usable
    try:
        dist.all_reduce(torch.ones(4 + 2 * rank, device="tpu"))
        r["mismatch"] = None
    except RuntimeError as e:
        r["mismatch"] = str(e)
    try:
        dist.all_reduce(torch.ones(4, device="tpu", dtype=torch.float32 if rank == 0 else torch.float64))
        r["dtype_mismatch"] = None
    except RuntimeError as e:
        r["dtype_mismatch"] = str(e)
    y = x.clone()
    dist.all_reduce(y)
    r["after_mismatch"] = y.cpu()
    objs: list = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    r["objects"] = objs
    return r


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.Tanh(), torch.nn.Linear(D_HID, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, D_IN, generator=g), torch.randn(STEPS, BATCH, 1, generator=g)


def _train(model: torch.nn.Module, xs, ys, device: str, reduce_loss=None) -> tuple[list[float], dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        loss = loss.detach()
        if reduce_loss is not None:
            reduce_loss(loss)
        losses.append(float(loss.cpu()))
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _ddp(rank: int, n: int, port: int, timeout_s: float) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    _init(rank, n, port)
    model = DistributedDataParallel(_model().to("tpu"))
    xs, ys = _data()
    per = BATCH // n
    xs, ys = xs[:, rank * per : (rank + 1) * per], ys[:, rank * per : (rank + 1) * per]
    losses, state = _train(model, xs, ys, "tpu", lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG))
    return {"losses": losses, "state": {k.removeprefix("module."): v for k, v in state.items()},
            "path": dist.group.WORLD.path}


def _fault(rank: int, n: int, port: int, timeout_s: float) -> dict:
    """Rank 2 dies and rank 1 hangs (sleeps) after the first collective; rank 0 must fail, naming them."""
    import torch.distributed as dist

    _init(rank, n, port, timeout_s=4.0)
    x = torch.ones(4, device="tpu")
    dist.all_reduce(x)
    if rank == 2:
        os._exit(1)
    if rank == 1:
        time.sleep(60)  # killed by the parent
    t0 = time.monotonic()
    try:
        dist.all_reduce(x)
        return {"error": None}
    except RuntimeError as e:
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - t0}


def _dtensor(rank: int, n: int, port: int, timeout_s: float) -> dict:
    """DeviceMesh("tpu") and DTensor placements."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    _init(rank, n, port)
    mesh = init_device_mesh("tpu", (n,))
    full = torch.arange(24.0).reshape(4, 6)
    rows = distribute_tensor(full.to("tpu"), mesh, [Shard(0)])
    r: dict = {"mesh": (mesh.device_type, tuple(mesh.shape)), "rows": rows.to_local().cpu()}
    cols = rows.redistribute(mesh, [Shard(1)])
    r["cols"] = cols.to_local().cpu()
    r["replicated"] = cols.redistribute(mesh, [Replicate()]).to_local().cpu()
    r["matmul"] = (rows @ distribute_tensor(torch.ones(6, 2, device="tpu"), mesh, [Replicate()])).full_tensor().cpu()
    r["sum"] = (rows * 2).sum().full_tensor().cpu()
    return r


class _Block(torch.nn.Module):
    """A small pre-norm transformer block: attention and an MLP, each with a residual."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.GELU(), torch.nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(self.norm2(x))


def _blocks_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(D_IN), _Block(D_IN), torch.nn.Linear(D_IN, 1))


def _seq_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(FSDP_STEPS, BATCH, 4, D_IN, generator=g), torch.randn(FSDP_STEPS, BATCH, 4, 1, generator=g)


FSDP_STEPS = 2
FSDP_CASES = {  # name: (reshard_after_forward, explicit mesh, bf16 mixed precision, optimizer)
    "default_mesh": (True, False, False, "sgd"),
    "no_reshard": (False, True, False, "adam"),
    "bf16": (True, True, True, "adam"),
}


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # eps well above rounding: the key bias's gradient is zero up to rounding, which Adam would scale up to lr
    return torch.optim.Adam(params, lr=0.01, eps=1e-4)


def _fsdp_train(case: str, device: str, rank: int, n: int, steps: int = FSDP_STEPS) -> tuple:
    """Trains the blocks model under FSDP2 on ``device`` (this rank's share of each batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard, explicit_mesh, bf16, opt_kind = FSDP_CASES[case]
    kw: dict = {"reshard_after_forward": reshard}
    if explicit_mesh or device == "cpu":
        kw["mesh"] = init_device_mesh(device, (n,))
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _blocks_model().to(device)
    for block in model[:2]:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = _optimizer(opt_kind, model.parameters())
    xs, ys = _seq_data()
    per = BATCH // n
    info: dict = {}
    for x, y in zip(xs[:steps, rank * per : (rank + 1) * per], ys[:steps, rank * per : (rank + 1) * per]):
        out = model(x.to(device))
        info["out_dtype"] = out.dtype
        loss = torch.nn.functional.mse_loss(out.float(), y.to(device))
        loss.backward()
        info["grad_dtype"] = model[0].qkv.weight.grad.dtype
        opt.step()
        opt.zero_grad()
    return model, opt, info


def _full_state(model: torch.nn.Module) -> dict:
    return {k: v.full_tensor().detach().cpu() for k, v in model.state_dict().items()}


def _fsdp(rank: int, n: int, port: int, timeout_s: float) -> dict:
    """FSDP2 (fully_shard) on tpu: training under each case, the collectives' path, and a DCP round trip."""
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    from torch_tpu.distributed.c10d import TPUProcessGroup

    _init(rank, n, port)
    counts: dict = {}
    run_xla = TPUProcessGroup._xla

    def counting_xla(self, op, kind, outs, ins, arg=None):  # noqa: ANN001, ANN202
        work = run_xla(self, op, kind, outs, ins, arg)
        key = f"{'xla' if work is not None else 'host'}:{op}"
        counts[key] = counts.get(key, 0) + 1
        return work

    TPUProcessGroup._xla = counting_xla
    r: dict = {"path": dist.group.WORLD.path}
    models = {}
    for case in FSDP_CASES:
        counts.clear()
        model, opt, info = _fsdp_train(case, "tpu", rank, n)
        r[case] = {"counts": dict(counts), "state": _full_state(model), **info,
                   "sharded": {k: (type(v).__name__, tuple(v.to_local().shape), v.device.type)
                               for k, v in model.state_dict().items()}}
        models[case] = (model, opt)
    TPUProcessGroup._xla = run_xla
    # the same bf16 training with FSDP2 on CPU tensors (gloo), in this world: the mixed-precision reference
    r["bf16_cpu"] = _full_state(_fsdp_train("bf16", "cpu", rank, n)[0])
    # DCP: save the trained sharded model and its optimizer, load them into a differently initialised copy
    model, opt = models["no_reshard"]
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path[0])
    torch.manual_seed(1 + rank)
    fresh, fresh_opt, _ = _fsdp_train("no_reshard", "tpu", rank, n, steps=0)  # get_state_dict makes its state
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)  # the trained copy must not already match
    r["dcp_before"] = all(torch.equal(a, b) for a, b in zip(_full_state(fresh).values(), _full_state(model).values()))
    msd2, osd2 = get_state_dict(fresh, fresh_opt)
    loaded = {"model": msd2, "optim": osd2}
    dcp.load(loaded, checkpoint_id=path[0])
    set_state_dict(fresh, fresh_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    r["dcp_local_equal"] = all(
        torch.equal(a.to_local().cpu(), b.to_local().cpu()) for a, b in zip(model.parameters(), fresh.parameters())
    )
    local = lambda t: (t.to_local() if isinstance(t, DTensor) else t).cpu()  # noqa: E731
    r["dcp_optim_equal"] = all(
        torch.equal(local(a), local(b))
        for sa, sb in zip(opt.state.values(), fresh_opt.state.values()) for a, b in zip(sa.values(), sb.values())
    )
    xs, ys = _seq_data()  # one more step on both: the loaded optimizer state carries on identically
    per = BATCH // n
    for m, o in ((model, opt), (fresh, fresh_opt)):
        torch.nn.functional.mse_loss(m(xs[0, rank * per : (rank + 1) * per].to("tpu")),
                                     ys[0, rank * per : (rank + 1) * per].to("tpu")).backward()
        o.step()
    r["dcp_after_step"] = all(
        torch.equal(a, b) for a, b in zip(_full_state(fresh).values(), _full_state(model).values())
    )
    return r


def _fsdp_on_a_target(rank: int, n: int, port: int, timeout_s: float) -> dict:
    """Two FSDP2 steps with a TPU target set after the group (whose XLA collectives start JAX's
    distributed runtime first): each rank's report, with the collectives compiled over n chips."""
    import torch_tpu

    _init(rank, n, port)
    with torch_tpu.set_target("v5e"):
        model, _, _ = _fsdp_train("default_mesh", "tpu", rank, n)
        state = _full_state(model)
        r = torch_tpu.target_report()
    return {"state": state, "failed": r["failures"], "per_program": r["per_program"]}


_SCENARIOS = {"collectives": _collectives, "ddp": _ddp, "fault": _fault, "dtensor": _dtensor, "fsdp": _fsdp,
              "fsdp_target": _fsdp_on_a_target}


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("path", ["xla", "gloo-host"])
def test_collectives_two_processes(tmp_path, path):
    res = _launch("collectives" + (":host" if path == "gloo-host" else ""), 2, tmp_path)
    a, b = torch.arange(4.0), torch.arange(4.0) + 1
    for rank, r in res.items():
        assert r["is_tpu_group"], r["group"]
        assert r["path"] == path, r["path"]
        for op, want in [("SUM", a + b), ("AVG", (a + b) / 2), ("MAX", b), ("MIN", a), ("PRODUCT", a * b)]:
            assert r[op][0] == "tpu"
            torch.testing.assert_close(r[op][1], want)
        torch.testing.assert_close(r["broadcast"], b)
        torch.testing.assert_close(r["all_gather"], [a, b])
        torch.testing.assert_close(r["all_gather_into_tensor"], torch.cat([a, b]))
        torch.testing.assert_close(r["reduce_scatter_tensor"], (a + b)[rank * 2 : rank * 2 + 2])
        mine = slice(rank * 2, rank * 2 + 2)
        torch.testing.assert_close(r["all_to_all_single"], torch.cat([a[mine], b[mine]]))
        torch.testing.assert_close(r["sendrecv"], (b if rank == 0 else a) * 10)
        torch.testing.assert_close(r["async"], a + b)
        torch.testing.assert_close(r["view"][::2], a + b)
        torch.testing.assert_close(r["view"][1::2], torch.zeros(4))
        torch.testing.assert_close(r["after_item"], a + b)
        assert "mismatched collective" in r["mismatch"], r["mismatch"]
        assert "rank 0: allreduce(float32[4])" in r["mismatch"] and "rank 1: allreduce(float32[6])" in r["mismatch"]
        assert "float64[4]" in r["dtype_mismatch"]
        torch.testing.assert_close(r["after_mismatch"], a + b)
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
    assert res[0]["item"] == [0.0, 6.0, 12.0]


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_matches_single_process(tmp_path, n):
    # the deadline only catches a hang: on a loaded 2-core machine four ranks took over 80 s to start
    res = _launch("ddp", n, tmp_path, timeout_s=60.0 * n)
    xs, ys = _data()
    want_losses, want_state = _train(_model(), xs, ys, "cpu")
    for rank, r in res.items():
        assert r["path"] == "xla", r["path"]  # DDP's bucket all-reduces are XLA collectives
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want_losses), rtol=1e-4, atol=1e-6)
        assert r["state"].keys() == want_state.keys()
        for k, v in want_state.items():
            torch.testing.assert_close(r["state"][k], v, rtol=1e-4, atol=1e-6, msg=f"rank {rank} {k}")


def test_device_mesh_and_dtensor_placements(tmp_path):
    res = _launch("dtensor", 2, tmp_path)
    full = torch.arange(24.0).reshape(4, 6)
    for rank, r in res.items():
        assert r["mesh"] == ("tpu", (2,))
        torch.testing.assert_close(r["rows"], full[rank * 2 : rank * 2 + 2])
        torch.testing.assert_close(r["cols"], full[:, rank * 3 : rank * 3 + 3])
        torch.testing.assert_close(r["replicated"], full)
        torch.testing.assert_close(r["matmul"], full @ torch.ones(6, 2))
        torch.testing.assert_close(r["sum"], full.sum() * 2)


def test_fsdp2_fully_shard_matches_single_process_and_checkpoints(tmp_path):
    """FSDP2 on tpu over 2 processes: forward all-gathers and backward reduce-scatters are XLA collectives,
    and the sharded training ends with CPU's whole-batch weights (bf16 mixed precision: FSDP2's own on CPU);
    a DCP save/load of the sharded model and optimizer round-trips."""
    res = _launch("fsdp", 2, tmp_path, timeout_s=240.0)
    xs, ys = _seq_data()
    for rank, r in res.items():
        assert r["path"] == "xla", r["path"]
        for case, (reshard, _, bf16, opt_kind) in FSDP_CASES.items():
            got = r[case]
            # FSDP2's collectives ran as XLA collectives, none on the host: all-gathers before each
            # block's forward (again in backward when resharded after forward), and reduce-scatters
            # (three groups: the two blocks and the root, the head)
            counts = got["counts"]
            assert not [k for k in counts if k.startswith("host:")], counts
            assert counts.get("xla:_reduce_scatter_base") == FSDP_STEPS * 3, counts
            assert counts.get("xla:_allgather_base") == FSDP_STEPS * (6 if reshard else 3), counts
            kind, local_shape, device = got["sharded"]["0.qkv.weight"]
            assert (kind, local_shape, device) == ("DTensor", (3 * D_IN // 2, D_IN), "tpu"), got["sharded"]
            assert got["out_dtype"] == (torch.bfloat16 if bf16 else torch.float32)
            assert got["grad_dtype"] == torch.float32
            if bf16:
                want = r["bf16_cpu"]
                tol = {"rtol": 2e-2, "atol": 2e-2}
            else:
                model = _blocks_model()
                _train_on(model, _optimizer(opt_kind, model.parameters()), xs, ys)
                want = {k: v.detach() for k, v in model.state_dict().items()}
                tol = {"rtol": 1e-4, "atol": 1e-5}
            assert got["state"].keys() == want.keys()
            for k, v in want.items():
                where = f"rank {rank} {case} {k}"
                torch.testing.assert_close(got["state"][k], v, **tol, msg=lambda m, w=where: f"{w}: {m}")
        assert not r["dcp_before"]
        assert r["dcp_local_equal"] and r["dcp_optim_equal"] and r["dcp_after_step"], r


@pytest.mark.skipif(not importlib.util.find_spec("libtpu"), reason="a TPU target needs libtpu (pip install libtpu)")
def test_fsdp2_step_compiles_for_a_tpu_target_with_its_collectives_over_the_ranks_chips(tmp_path):
    """FSDP2 over 2 processes with a TPU target: each rank's programs compile for v5e, its all-gathers
    and reduce-scatters (XLA collectives) over 2 chips of the slice, the rest on one; the weights are
    CPU's, as without a target."""
    res = _launch("fsdp_target", 2, tmp_path, timeout_s=240.0)
    model = _blocks_model()
    _train_on(model, _optimizer("sgd", model.parameters()), *_seq_data())
    for rank, r in res.items():
        assert not r["failed"], r["failed"]
        collectives = [p for p in r["per_program"] if p["kind"] == "collective"]
        names = {p["program"] for p in collectives}
        assert any("allgather" in p for p in names) and any("reduce_scatter" in p for p in names), names
        assert {p["chips"] for p in collectives} == {2}, collectives
        assert {p["chips"] for p in r["per_program"] if p["kind"] != "collective"} == {1}
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v.detach(), rtol=1e-4, atol=1e-5, msg=f"rank {rank} {k}")


def _train_on(model: torch.nn.Module, opt: torch.optim.Optimizer, xs, ys) -> None:
    for x, y in zip(xs, ys):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_dead_and_hung_ranks_fail_fast_naming_them(tmp_path):
    # the parent's deadline covers three ranks starting Python, torch and JAX, which on a loaded
    # 2-core machine (CI runs four pytest processes at once) took past 40 s; the failing fast is
    # rank 0's own measure below (its group's timeout is 4 s)
    t0 = time.monotonic()
    res = _launch("fault", 3, tmp_path, timeout_s=120.0, wait_for=[0])
    err = res[0]["error"]
    assert err is not None and err.startswith("DistBackendError"), err
    assert "failed on rank 0" in err, err
    assert "[2] stopped responding" in err, err
    assert "[1] never reached" in err, err
    assert res[0]["seconds"] < 10, res[0]
    assert time.monotonic() - t0 < 120


_TORCHRUN_SCRIPT = r"""
import os, torch, torch.distributed as dist
import torch_tpu
dist.init_process_group("tpu")
rank, world = dist.get_rank(), dist.get_world_size()
x = torch.full((4,), float(rank + 1), device="tpu")
dist.all_reduce(x)
print(f"rank {rank}/{world} node {os.environ['GROUP_RANK']} path {dist.group.WORLD.path} sum {x.cpu().tolist()}")
dist.destroy_process_group()
"""


def test_multi_node_torchrun_on_localhost(tmp_path):
    """Two torchrun "nodes" (one process each) meeting through a c10d rendezvous endpoint, as a
    multi-host job does; the process group takes the XLA-collective path across them."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    port = _free_port()
    env = {**os.environ, "TORCH_TPU_PLATFORM": "cpu", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "test", str(script)]
    nodes = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    lines = sorted(line for out, _ in outs for line in out.splitlines() if line.startswith("rank "))
    assert all(p.returncode == 0 for p in nodes), [err[-2000:] for _, err in outs]
    assert len(lines) == 2, outs
    nodes_seen = {line.split()[3] for line in lines}
    assert nodes_seen == {"0", "1"}, lines
    for line in lines:
        assert "/2 " in line and "path xla" in line and "sum [3.0, 3.0, 3.0, 3.0]" in line, line


_PIPED_SCRIPT = r"""
import os, datetime, torch, torch.distributed as dist
import torch_tpu
dist.init_process_group("tpu", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
x = torch.arange(4.0, device="tpu")
dist.all_reduce(x)
for i in range(2000):  # more than a pipe's buffer, none of it flushed by hand
    print(f"line {i} {x.sum().item() if i == 1999 else ''}")
print("the last line")
"""  # no destroy_process_group: the interpreter's exit must still flush stdout

_PIPED_TEST = r"""
import datetime, socket, torch, torch.distributed as dist
import torch_tpu

def test_one_rank_all_reduce():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("tpu", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    x = torch.ones(4, device="tpu")
    dist.all_reduce(x)
    assert x.sum().item() == 4
    dist.destroy_process_group()
"""


def test_a_distributed_script_prints_its_last_line_through_a_pipe(tmp_path):
    """A distributed script's output through a pipe (block-buffered) reaches it whole at exit."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_PIPED_SCRIPT % _free_port())
    env = {**os.environ, "TORCH_TPU_PLATFORM": "cpu", "GLOO_SOCKET_IFNAME": "lo"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[-2:] == ["line 1999 6.0", "the last line"] and len(lines) == 2001, lines[-3:]


def test_pytest_quiet_prints_its_closing_line_after_a_distributed_test(tmp_path):
    """``pytest -q`` over a distributed test, through a pipe, ends with pytest's "N passed" line.
    It used not to: the project's own ``addopts`` held ``-q`` too, and pytest's ``-qq`` drops that
    line (nothing was lost at exit)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    test = tmp_path / "test_piped.py"
    test.write_text(_PIPED_TEST)
    env = {**os.environ, "TORCH_TPU_PLATFORM": "cpu", "GLOO_SOCKET_IFNAME": "lo"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(root / "pyproject.toml"),
                          "--rootdir", str(tmp_path), str(test)], env=env, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("1 passed in "), out.stdout[-1000:]
