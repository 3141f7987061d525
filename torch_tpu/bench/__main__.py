"""Benchmark commands.

    python -m torch_tpu.bench dispatch [--n 2000]

``dispatch``: median microseconds per op for small ops (add, mul, matmul on 64x64 and an
in-place add) on tpu in strict mode, next to CPU PyTorch in the same run. Each figure is the
median of 7 windows of ``n`` ops, each window ended by a device sync.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import torch_tpu


def _per_op_us(fn, x, y, n: int, sync) -> float:
    for _ in range(50):
        fn(x, y)
    sync()
    windows = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(x, y)
        sync()
        windows.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(windows)


OPS = {
    "add": lambda x, y: x + y,
    "mul": lambda x, y: x * y,
    "matmul": lambda x, y: x @ y,
    "add_": lambda x, y: x.add_(y),
}


def dispatch(n: int) -> dict:
    results: dict[str, dict[str, float]] = {}
    torch_tpu.set_eager_mode(torch_tpu.EagerMode.STRICT)
    for device in ("tpu", "cpu"):
        x = torch.randn(64, 64, device=device)
        y = torch.randn(64, 64, device=device)
        sync = torch.tpu.synchronize if device == "tpu" else (lambda: None)
        for name, fn in OPS.items():
            results.setdefault(name, {})[device] = round(_per_op_us(fn, x, y, n, sync), 2)
    return {"benchmark": "dispatch", "unit": "us/op (median)", "platform": torch_tpu.platform(),
            "shape": [64, 64], "ops": results}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m torch_tpu.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dispatch", help="per-op dispatch cost on 64x64 tensors")
    d.add_argument("--n", type=int, default=2000)
    a = p.parse_args()
    if a.cmd == "dispatch":
        r = dispatch(a.n)
        print(json.dumps(r))
        print(f"{'op':8s} {'tpu us':>8s} {'cpu us':>8s}")
        for name, v in r["ops"].items():
            print(f"{name:8s} {v['tpu']:8.1f} {v['cpu']:8.1f}")


if __name__ == "__main__":
    main()
