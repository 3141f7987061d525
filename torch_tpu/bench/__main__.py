"""Benchmark commands.

    python -m torch_tpu.bench dispatch [--n 2000]
    python -m torch_tpu.bench train --workload mlp|gpt|gpt-issue --mode debug|strict|fused|compile [--steps N]
    python -m torch_tpu.bench train --workload gpt --compare
    python -m torch_tpu.bench estimator --workload gpt --mode compile [--devices 1,4]
    python -m torch_tpu.bench allreduce [--nproc 2] [--mb 1,64]     (see bench/distributed.py)
    python -m torch_tpu.bench ddp [--nproc 1,2,4]
    python -m torch_tpu.bench decode [--new 32] [--prompt 16] [--batch 4] [--modes cpu,fused,compile,strict]
                                     [--loops generate,static] [--threads N]
                                     (see bench/decode.py)

``estimator``: samples per second of ``TPUEstimator.fit`` on the workload's batch (fed through a
DataLoader), next to the same step written by hand in the same mode (``train``), for each device
count in ``--devices``. On XLA:CPU, counts above the host's devices use virtual CPU devices
(``--xla_force_host_platform_device_count``): the run re-executes itself with that flag.

``train``: steps per second (best of three timed windows, compile excluded), the first-step
time, the part of it spent building XLA programs (``compile_s``: lowering and XLA's compile; the
rest is tracing, Dynamo's and AOTAutograd's under ``torch.compile``, and running) and the process
CPU milliseconds per step (every thread, over the three windows), as one JSON
line; ``--compare`` runs every mode and CPU PyTorch eager in one process and
prints a table.

``dispatch``: median microseconds per op for small ops (add, mul, matmul on 64x64 and an
in-place add) on tpu in strict mode, next to CPU PyTorch in the same run. Each figure is the
median of 7 windows of ``n`` ops, each window ended by a device sync.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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


def _compile_seconds() -> float:
    """Seconds spent so far building XLA programs: lowering to JAX and XLA's compile (or its load
    from the persistent cache), for fused traces and compiled graphs and for per-op programs."""
    return torch_tpu.cache_stats()["compile_seconds"] + torch_tpu.metrics()["compile_seconds"]


def train(workload: str, mode: str, steps: int, warmup: int = 3) -> dict:
    from torch_tpu.bench import workloads

    previous = torch_tpu.get_eager_mode()
    if mode == "cpu":
        dev = "cpu"
    else:
        dev = "tpu"
        torch_tpu.set_eager_mode("strict" if mode == "compile" else mode)
    try:
        model, step, tokens = workloads.make(workload, dev)
        if mode == "compile":
            torch._dynamo.reset()
            step = torch.compile(step, backend="tpu")
        compiled0 = _compile_seconds()
        t0 = time.perf_counter()
        float(step().detach().to("cpu"))
        first = time.perf_counter() - t0
        compile_s = _compile_seconds() - compiled0
        for _ in range(warmup - 1):
            step()
        float(step().detach().to("cpu"))
        best = 0.0
        cpu0 = time.process_time()
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(steps):
                loss = step()
            final = float(loss.detach().to("cpu"))  # a host read ends the window's queued work
            best = max(best, steps / (time.perf_counter() - t))
        # every thread of the process: XLA:CPU's and Python's compete for the same cores
        cpu_ms = (time.process_time() - cpu0) / (3 * steps) * 1e3
    finally:
        torch_tpu.set_eager_mode(previous)
    return {"workload": workload, "mode": mode, "steps_per_s": round(best, 3), "first_step_s": round(first, 3),
            "compile_s": round(compile_s, 3), "cpu_ms_per_step": round(cpu_ms, 2), "final_loss": round(final, 5),
            "platform": torch_tpu.platform()}


def estimator(workload: str, mode: str, steps: int, devices: int, warmup: int = 3) -> dict:
    """Samples/s of ``fit`` over the ``3 * steps`` steps that follow ``warmup`` steps, then
    ``predict`` over the same loader (its second pass: samples/s and milliseconds per batch)."""
    from torch.utils.data import DataLoader, TensorDataset

    from torch_tpu.bench import workloads
    from torch_tpu.estimator import TPUEstimator

    model, step, _ = workloads.make(workload, "cpu")
    x, y = step.data
    n = warmup + 3 * steps
    loader = DataLoader(TensorDataset(x.repeat(n, *([1] * (x.dim() - 1))), y.repeat(n, *([1] * (y.dim() - 1)))),
                        batch_size=x.shape[0])
    est = TPUEstimator(devices=devices, mode=mode, verbose=False)
    history = est.fit(model, loader, optimizer=step.make_optimizer, log_every=10**9)
    # each step's samples/s is measured by fit between the ends of consecutive steps (the host
    # reads step N-1's loss while step N runs): add up the time of the steps after the warm-up
    timed = history.steps[warmup:]
    seconds = sum(x.shape[0] / s["samples_per_s"] for s in timed)
    samples = len(timed) * x.shape[0] / seconds
    est.predict(model, loader)  # compiles the inference program
    t0 = time.perf_counter()
    est.predict(model, loader)
    seconds = time.perf_counter() - t0
    predict = {"predict_samples_per_s": round(len(loader.dataset) / seconds, 1),
               "predict_ms_per_batch": round(seconds / len(loader) * 1e3, 2)}
    return {**predict, "workload": workload, "mode": mode, "devices": devices, "fit_samples_per_s": round(samples, 2),
            "programs_compiled": history.programs_compiled, "final_loss": round(history.loss[-1], 5),
            "platform": torch_tpu.platform()}


def _estimator_table(workload: str, mode: str, steps: int, counts: list[int]) -> None:
    import jax

    have = len(jax.devices())
    if max(counts) > have and torch_tpu.platform() == "cpu" and "TORCH_TPU_BENCH_CHILD" not in os.environ:
        env = {**os.environ, "TORCH_TPU_BENCH_CHILD": "1",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(counts)}"}
        sys.exit(subprocess.call([sys.executable, "-m", "torch_tpu.bench", *sys.argv[1:]], env=env))
    hand = train(workload, mode, steps)
    batch = workloads_batch(workload)
    print(json.dumps({**hand, "hand_samples_per_s": round(hand["steps_per_s"] * batch, 2)}))
    rows = [estimator(workload, mode, steps, n) for n in counts]
    for r in rows:
        print(json.dumps(r))
    print(f"{'devices':>7s} {'fit samples/s':>14s} {'vs hand loop':>13s} {'vs 1 device':>12s}")
    for r in rows:
        base = rows[0]["fit_samples_per_s"]
        print(f"{r['devices']:7d} {r['fit_samples_per_s']:14.1f} "
              f"{r['fit_samples_per_s'] / (hand['steps_per_s'] * batch):13.3f} {r['fit_samples_per_s'] / base:12.3f}")


def workloads_batch(workload: str) -> int:
    from torch_tpu.bench import workloads

    return 128 if workload == "mlp" else workloads.SIZES[workload][5]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("allreduce", "ddp"):  # multi-process: bench/distributed.py
        from torch_tpu.bench import distributed

        distributed.main(sys.argv[1:])
        return
    p = argparse.ArgumentParser(prog="python -m torch_tpu.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dispatch", help="per-op dispatch cost on 64x64 tensors")
    d.add_argument("--n", type=int, default=2000)
    t = sub.add_parser("train", help="training steps per second of a workload")
    t.add_argument("--workload", default="mlp", choices=["mlp", "gpt", "gpt-issue", "gpt-xl"])
    t.add_argument("--mode", default="strict", choices=["debug", "strict", "fused", "compile", "cpu"])
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--compare", action="store_true", help="all modes and CPU eager, one process")
    e = sub.add_parser("estimator", help="samples/s of TPUEstimator.fit next to the hand-written step")
    e.add_argument("--workload", default="gpt", choices=["mlp", "gpt", "gpt-issue", "gpt-xl"])
    e.add_argument("--mode", default="compile", choices=["strict", "fused", "compile"])
    e.add_argument("--steps", type=int, default=10)
    e.add_argument("--devices", default="1", help="comma-separated device counts, e.g. 1,4")
    g = sub.add_parser("decode", help="decoding tokens/s of a small Llama: generate() and a static loop")
    g.add_argument("--new", type=int, default=32)
    g.add_argument("--prompt", type=int, default=16)
    g.add_argument("--batch", type=int, default=4)
    g.add_argument("--modes", default="cpu,fused,compile,strict")
    g.add_argument("--loops", default="generate,static")
    g.add_argument("--threads", type=int, default=0, help="torch.set_num_threads for the run (0: torch's default)")
    a = p.parse_args()
    if a.cmd == "decode":
        from torch_tpu.bench import decode

        if a.threads:
            torch.set_num_threads(a.threads)
        print(f"torch threads: {torch.get_num_threads()}, load average: {os.getloadavg()[0]:.1f}")
        decode.table(a.modes.split(","), a.loops.split(","), new=a.new, prompt_len=a.prompt, batch=a.batch)
    if a.cmd == "estimator":
        _estimator_table(a.workload, a.mode, a.steps, [int(n) for n in a.devices.split(",")])
    if a.cmd == "train":
        modes = ["debug", "strict", "fused", "compile", "cpu"] if a.compare else [a.mode]
        rows = [train(a.workload, m, a.steps) for m in modes]
        for r in rows:
            print(json.dumps(r))
        if a.compare:
            print(f"{'mode':8s} {'steps/s':>9s} {'first step s':>13s} {'compile s':>10s} {'CPU ms/step':>12s}")
            for r in rows:
                print(f"{r['mode']:8s} {r['steps_per_s']:9.2f} {r['first_step_s']:13.2f} {r['compile_s']:10.2f} "
                      f"{r['cpu_ms_per_step']:12.2f}")
    if a.cmd == "dispatch":
        r = dispatch(a.n)
        print(json.dumps(r))
        print(f"{'op':8s} {'tpu us':>8s} {'cpu us':>8s}")
        for name, v in r["ops"].items():
            print(f"{name:8s} {v['tpu']:8.1f} {v['cpu']:8.1f}")


if __name__ == "__main__":
    main()
