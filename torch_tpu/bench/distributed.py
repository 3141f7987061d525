"""Distributed benchmarks: all-reduce bandwidth and DDP steps/s, with spawned processes on localhost.

    python -m torch_tpu.bench allreduce [--nproc 2] [--mb 1,64]
    python -m torch_tpu.bench ddp [--nproc 1,2,4] [--steps 20]
    python -m torch_tpu.bench fsdp [--nproc 2] [--steps 20]

``allreduce``: seconds per all-reduce (median of 5 after a warm-up) and bus bandwidth in bytes/s
for tpu tensors on the XLA-collective path, on the gloo host path, and plain gloo on CPU tensors,
all in the same processes. ``ddp``: steps/s of DistributedDataParallel on the MLP workload
(784-1024-1024-10, SGD), global batch 128 split over the processes. ``fsdp``: the same model and
batch under DDP and under FSDP2 (``fully_shard`` on each Linear and the root), on the XLA-collective
path and on the gloo host path, with the collectives one step issues on each path.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

from torch_tpu.distributed.c10d import TPUProcessGroup


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, n: int, port: int, path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["TORCH_TPU_DIST_PATH"] = path
    import torch.distributed as dist


    dist.init_process_group("cpu:gloo,tpu:tpu", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=120))


def _allreduce_worker(rank: int, n: int, port: int, path: str, mbs: list[int], out: Any) -> None:
    import torch
    import torch.distributed as dist

    _init(rank, n, port, path)
    rows = []
    for mb in mbs:
        numel = mb * (1 << 20) // 4
        for device in ("tpu", "cpu"):
            x = torch.ones(numel, device=device)
            sync = (lambda t=x: float(t[0].cpu())) if device == "tpu" else (lambda: None)
            dist.all_reduce(x)
            sync()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                dist.all_reduce(x)
                sync()
                times.append(time.perf_counter() - t0)
            s = statistics.median(times)
            nbytes = numel * 4
            rows.append({"mb": mb, "tensors": device, "path": dist.group.WORLD.path if device == "tpu" else "gloo",
                         "ms": round(s * 1e3, 3), "bus_bytes_per_s": round(2 * (n - 1) / n * nbytes / s)})
    if rank == 0:
        _send(out, rows)
    dist.destroy_process_group()
    os._exit(0)


def _ddp_worker(rank: int, n: int, port: int, steps: int, out: Any) -> None:
    _train_worker(rank, n, port, steps, "ddp", "xla", out)


def _train_worker(rank: int, n: int, port: int, steps: int, wrap: str, path: str, out: Any) -> None:
    """Steps/s of the MLP on this rank's share of the batch, wrapped in DDP or FSDP2 (``wrap``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel


    if n > 1:
        _init(rank, n, port, path)
    counts: dict[str, int] = {}
    _count_collectives(TPUProcessGroup, counts)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    model = model.to("tpu")
    if n > 1 and wrap == "ddp":
        model = DistributedDataParallel(model)
    elif n > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(128 // n, 784, generator=g).to("tpu")
    y = torch.randint(0, 10, (128 // n,), generator=g).to("tpu")

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step()
    float(step().detach().cpu())
    counts.clear()
    step()
    per_step = dict(counts)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    float(loss.detach().cpu())
    rate = steps / (time.perf_counter() - t0)
    if rank == 0:
        import torch.distributed as dist

        _send(out, {"wrap": wrap if n > 1 else "none", "processes": n, "steps_per_s": round(rate, 2),
                    "path": dist.group.WORLD.path if dist.is_initialized() else "none",
                    "collectives_per_step": per_step})
    os._exit(0)


def _count_collectives(group_type: Any, counts: dict[str, int]) -> None:
    """Counts the group's collectives by path (``xla:`` or ``host:`` and c10d's name) in ``counts``."""
    run_xla, run_host = group_type._xla, group_type._run

    def xla(self: Any, op: str, *args: Any) -> Any:
        work = run_xla(self, op, *args)
        if work is not None:
            counts[f"xla:{op}"] = counts.get(f"xla:{op}", 0) + 1
        return work

    def host(self: Any, op: str, *args: Any, **kw: Any) -> Any:
        counts[f"host:{op}"] = counts.get(f"host:{op}", 0) + 1
        return run_host(self, op, *args, **kw)

    group_type._xla, group_type._run = xla, host


def _send(q: Any, value: Any) -> None:
    """Puts ``value`` on the queue and waits until it is written (the worker then exits at once)."""
    q.put(value)
    q.close()
    q.join_thread()


def _spawn(target: Any, n: int, *args: Any) -> Any:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    os.environ["TORCH_TPU_PLATFORM"] = os.environ.get("TORCH_TPU_PLATFORM", "cpu")
    procs = [ctx.Process(target=target, args=(r, n, port, *args, q)) for r in range(n)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def allreduce(nproc: int, mbs: list[int]) -> list[dict]:
    rows = []
    for path in ("xla", "host"):
        got = _spawn(_allreduce_worker, nproc, path, mbs)
        rows += [r for r in got if r["tensors"] == "tpu" or path == "xla"]  # plain gloo once
    return rows


def ddp(counts: list[int], steps: int) -> list[dict]:
    return [_spawn(_ddp_worker, n, steps) for n in counts]


def fsdp(nproc: int, steps: int) -> list[dict]:
    return [_spawn(_train_worker, nproc, steps, wrap, path) for path in ("xla", "host") for wrap in ("ddp", "fsdp")]


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser(prog="python -m torch_tpu.bench allreduce|ddp|fsdp")
    p.add_argument("cmd", choices=["allreduce", "ddp", "fsdp"])
    p.add_argument("--nproc", default=None)
    p.add_argument("--mb", default="1,64")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    if a.cmd == "allreduce":
        rows = allreduce(int(a.nproc or 2), [int(m) for m in a.mb.split(",")])
        for r in rows:
            print(json.dumps(r))
        print(f"{'MB':>4s} {'tensors':8s} {'path':10s} {'ms':>9s} {'GB/s (bus)':>11s}")
        for r in rows:
            print(f"{r['mb']:4d} {r['tensors']:8s} {r['path']:10s} {r['ms']:9.2f} {r['bus_bytes_per_s'] / 1e9:11.3f}")
    elif a.cmd == "fsdp":
        rows = fsdp(int(a.nproc or 2), a.steps)
        for r in rows:
            print(json.dumps(r))
        print(f"{'wrap':5s} {'path':10s} {'steps/s':>8s}  collectives per step")
        for r in rows:
            per = ", ".join(f"{k} x{v}" for k, v in sorted(r["collectives_per_step"].items()))
            print(f"{r['wrap']:5s} {r['path']:10s} {r['steps_per_s']:8.2f}  {per}")
    else:
        rows = ddp([int(n) for n in (a.nproc or "1,2,4").split(",")], a.steps)
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main(sys.argv[1:])
