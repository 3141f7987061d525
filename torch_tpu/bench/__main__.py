"""Benchmark commands.

    python -m torch_tpu.bench dispatch [--n 2000]
    python -m torch_tpu.bench train --workload mlp|gpt|gpt-issue|gpt-tiny
                                    --mode strict|fused|compile|graph|estimator|jax [--steps N] [--bf16] [--target v5e]
    python -m torch_tpu.bench train --workload gpt --compare
    python -m torch_tpu.bench estimator --workload gpt --mode compile [--devices 1,4]
    python -m torch_tpu.bench predict --workload mlp|gpt [--batches 20] [--mode fused]
    python -m torch_tpu.bench allreduce [--nproc 2] [--mb 1,64]     (see bench/distributed.py)
    python -m torch_tpu.bench ddp [--nproc 1,2,4]
    python -m torch_tpu.bench fsdp [--nproc 2]                  (DDP next to FSDP2, both paths)
    python -m torch_tpu.bench decode [--new 32] [--prompt 16] [--batch 4] [--modes cpu,fused,compile,...] [--rounds 1]
                                     [--loops generate,static,export] [--threads N] [--target v5e] [--json]
                                     (see bench/decode.py)

``estimator``: samples per second of ``TPUEstimator.fit`` on the workload's batch (fed through a
DataLoader), next to the same step written by hand in the same mode (``train``), for each device
count in ``--devices``. On XLA:CPU, counts above the host's devices use virtual CPU devices
(``--xla_force_host_platform_device_count``): the run re-executes itself with that flag.

``predict``: samples per second of ``TPUEstimator.predict`` over a loader with a ragged last
batch (the second pass, so compiles are excluded; the programs each pass compiled are shown),
next to the same model's forward as one jitted JAX function (``torch_tpu.export``'s program),
fed the same batches from the host and read back to the host, as ``predict`` does.

``train``: steps per second (best of three timed windows, compile excluded), the first-step
time, the part of it spent building XLA programs (``compile_s``: lowering and XLA's compile; the
rest is tracing, Dynamo's and AOTAutograd's under ``torch.compile``, and running), the process
CPU milliseconds per step (every thread, over the three windows) and ``host_ms_per_step``: the CPU
time of the main thread and of autograd's device thread alone, the host's share of a step (on
XLA:CPU the other threads are the device's). It prints one JSON line; ``--compare`` runs every
mode and CPU PyTorch eager in one process and prints a table. ``--mode graph`` warms the step up
eagerly, captures one step with ``torch.tpu.graph`` (the optimizer made capturable, as CUDA
graphs require) and replays it; its first-step time includes the warm-up and the capture.
``--mode estimator`` runs the same steps as ``TPUEstimator().fit`` in its default mode (each step
captured once and replayed, see ``torch_tpu.estimator.replay``) over a loader of the fixed batch,
each batch sent from the host as a loader's would be; its windows are timed at step ends.
``--mode jax`` is the ceiling: the same workload written in JAX (``bench/jax_step.py``: the same
weights, batch and optimizer arithmetic), one compiled step with its state donated, timed the
same way; with ``--target`` its program is compiled for the chip as the tpu modes' are.

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
from collections.abc import Callable
from typing import Any

import torch

import torch_tpu
from torch_tpu.bench import decode, distributed, jax_step, workloads
from torch_tpu.bench.clock import host_ns
from torch_tpu.core import dtypes as _dtypes
from torch_tpu.estimator import TPUEstimator
from torch_tpu.estimator.execution import compile_counters
from torch_tpu.runtime import target as _target


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
    from the persistent cache), for fused traces and compiled graphs and for per-op programs.
    ``metrics()`` counts them all (a fused trace's seconds are in ``cache_stats()`` too: adding
    both counted them twice)."""
    return torch_tpu.metrics()["compile_seconds"]


def _captured(step: Any) -> tuple[Any, torch.Tensor]:
    """The step as CUDA-graph code runs it: an eager warm-up step (its loss is returned: it stands
    for the first step, so every mode runs as many steps), one step captured, then replays."""
    for group in step.optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
    first = step()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = step()

    def replay() -> torch.Tensor:
        g.replay()
        return static_loss

    return replay, first


def _estimator_train(workload: str, steps: int, warmup: int, window: _target_window | None = None,
                     bf16: bool = False) -> dict:
    """``train`` for ``TPUEstimator().fit`` (default mode): as many steps as the other modes, from
    the same weights, over a loader of the fixed batch. A step-end callback that reads the loss at
    the windows' ends (so their queued work is done) times them, and it alone reads the loss. The
    first step's time is that of the first two: the fused warm-up step and the capture."""
    model, step, tokens = workloads.make(workload, "cpu")
    x, y = step.data
    total = warmup + 1 + 3 * steps
    ends = {2, warmup + 1, *(warmup + 1 + steps * k for k in range(1, 4))}
    marks: dict[int, tuple[float, float, int, float]] = {}

    def mark(est: Any, logs: dict) -> None:
        if logs["step"] in ends:
            logs["loss"]  # noqa: B018 - the host read that ends the window's queued work
            marks[logs["step"]] = (time.perf_counter(), time.process_time(), host_ns(), _compile_seconds())
            if window is not None and logs["step"] == warmup + 1:
                window.start()

    compiled0 = _compile_seconds()
    t0 = time.perf_counter()
    est = TPUEstimator(devices=1, verbose=False, precision="bf16" if bf16 else "fp32")
    history = est.fit(model.to(est), [(x, y)] * total, optimizer=step.make_optimizer, callbacks=[mark],
                      log_every=10**9)
    first, compile_s = marks[2][0] - t0, marks[2][3] - compiled0
    at = [marks[warmup + 1 + steps * k] for k in range(4)]
    best = max(steps / (at[k + 1][0] - at[k][0]) for k in range(3))
    cpu_ms = (at[3][1] - at[0][1]) / (3 * steps) * 1e3
    host_ms = (at[3][2] - at[0][2]) / (3 * steps) / 1e6
    row = {"workload": workload, "mode": "estimator", "steps_per_s": round(best, 3), "first_step_s": round(first, 3),
           "compile_s": round(compile_s, 3), "cpu_ms_per_step": round(cpu_ms, 2),
           "host_ms_per_step": round(host_ms, 3), "final_loss": round(history.loss[-1], 5),
           "execution": history.execution, "replayed_steps": history.replayed_steps,
           "platform": torch_tpu.platform(), "bf16": bf16}
    if window is not None:
        row["target"] = window.figures(3 * steps, host_ms)
    return row


def train(workload: str, mode: str, steps: int, warmup: int = 3, target: str | None = None, bf16: bool = False) -> dict:
    """Steps/s of ``workload`` in ``mode``; with ``target`` (a TPU chip), every program of the run is
    also compiled for it and the row gains a ``"target"`` object: the timed steps' projected device
    ms (XLA:TPU's estimate, else the roofline), the host ms measured here, the projected steps/s
    and MFU, the bound, the peak HBM (``torch_tpu.runtime.target``). ``bf16``: the forward under
    ``torch.autocast`` to bfloat16 (the estimator: ``precision="bf16"``), as mode_bench's flag."""
    if target is None:
        return _train(workload, mode, steps, warmup, None, bf16)
    with torch_tpu.set_target(target):
        return _train(workload, mode, steps, warmup, _target_window(), bf16)


class _target_window:  # noqa: N801 - a small record the timed loops fill
    """The target's call counts when the timed steps began."""

    def __init__(self) -> None:
        self.snap: dict[int, int] = {}

    def start(self) -> None:
        self.snap = _target.snapshot()

    def figures(self, steps: int, host_ms: float) -> dict:
        out = _target.since(self.snap, steps, host_ms / 1e3)
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in out.items()}


def _train(workload: str, mode: str, steps: int, warmup: int, window: _target_window | None, bf16: bool) -> dict:
    if mode == "estimator":
        return _estimator_train(workload, steps, warmup, window, bf16)

    if mode == "jax":
        step, compile_s = jax_step.stepper(workload, bf16, _watch_jax(workload))
        return _timed(workload, mode, lambda: (step, step()), steps, warmup, window, bf16, compile_s)
    previous = torch_tpu.get_eager_mode()
    if mode == "cpu":
        dev = "cpu"
    else:
        dev = "tpu"
        torch_tpu.set_eager_mode("strict" if mode in ("compile", "graph") else mode)
    try:
        model, step, tokens = workloads.make(workload, dev, bf16=bf16)
        if mode == "compile":
            torch._dynamo.reset()
            step = torch.compile(step, backend="tpu")
        first: Callable[[], tuple[Callable, Any]] = (lambda: _captured(step)) if mode == "graph" else (
            lambda: (step, step()))
        return _timed(workload, mode, first, steps, warmup, window, bf16)
    finally:
        torch_tpu.set_eager_mode(previous)


def _watch_jax(workload: str) -> Callable[[Callable, Callable, tuple], Callable]:
    """The JAX step's executable, compiled for the target chip as the tpu modes' programs are."""

    def watch(run: Callable, fn: Callable, donated: tuple) -> Callable:
        return _target.watch(run, kind="jax", name=f"jax {workload} step", fn=fn, ops=["jax step"],
                             site=lambda: None, donate=donated)

    return watch


def _timed(workload: str, mode: str, first_step: Callable[[], tuple[Callable, Any]], steps: int, warmup: int,
           window: _target_window | None, bf16: bool, compiled_ahead: float = 0.0) -> dict:
    """The row of one mode: ``first_step()`` runs the first step and returns the step to repeat and
    the first loss (graph mode: the eager step and the capture), then ``warmup`` more steps, then
    the best of three timed windows of ``steps`` steps, each ended by a host read of the loss.
    ``compiled_ahead``: the seconds of a compile made before the first step (JAX's), counted in
    the first step's time and in the compile seconds."""
    compiled0 = _compile_seconds()
    t0 = time.perf_counter()
    step, loss = first_step()
    jax_step.loss_value(loss)
    first = time.perf_counter() - t0 + compiled_ahead
    compile_s = _compile_seconds() - compiled0 + compiled_ahead
    for _ in range(warmup - 1):
        step()
    jax_step.loss_value(step())
    best = 0.0
    cpu0 = time.process_time()
    host0 = host_ns()
    if window is not None:
        window.start()
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(steps):
            loss = step()
        final = jax_step.loss_value(loss)  # a host read ends the window's queued work
        best = max(best, steps / (time.perf_counter() - t))
    # every thread of the process: XLA:CPU's and Python's compete for the same cores
    cpu_ms = (time.process_time() - cpu0) / (3 * steps) * 1e3
    host_ms = (host_ns() - host0) / (3 * steps) / 1e6
    row = {"workload": workload, "mode": mode, "steps_per_s": round(best, 3), "first_step_s": round(first, 3),
           "compile_s": round(compile_s, 3), "cpu_ms_per_step": round(cpu_ms, 2),
           "host_ms_per_step": round(host_ms, 3), "final_loss": round(final, 5),
           "platform": torch_tpu.platform(), "bf16": bf16}
    if window is not None:
        row["target"] = window.figures(3 * steps, host_ms)
    return row


def estimator(workload: str, mode: str, steps: int, devices: int, warmup: int = 3) -> dict:
    """Samples/s of ``fit`` over the ``3 * steps`` steps that follow ``warmup`` steps, then
    ``predict`` over the same loader (its second pass: samples/s and milliseconds per batch)."""
    from torch.utils.data import DataLoader, TensorDataset

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


def predict(workload: str, batches: int, mode: str) -> dict:
    """``predict``'s samples/s (best of 3 passes after a warm-up pass) next to the exported
    forward jitted by JAX over the same host batches, padded the same way."""
    import jax
    import numpy as np
    from torch.utils.data import DataLoader, TensorDataset

    model, step, _ = workloads.make(workload, "cpu")
    model.eval()
    x = step.data[0]
    rows = x.shape[0]
    n = batches * rows - rows // 2  # a ragged last batch of half the rows
    data = x.repeat(batches, *([1] * (x.dim() - 1)))[:n]
    loader = DataLoader(TensorDataset(data), batch_size=rows)
    est = TPUEstimator(devices=1, mode=mode, verbose=False)
    model = model.to(est)
    compiles = []
    best = 0.0
    for _ in range(4):
        c0 = compile_counters()[0]
        t0 = time.perf_counter()
        out = est.predict(model, loader)
        seconds = time.perf_counter() - t0
        compiles.append(compile_counters()[0] - c0)
        best = max(best, n / seconds)
    exported = torch_tpu.export(model, (x,))
    # the artifact's jitted program, weights placed on the device once (its __call__ converts
    # the weights on every call, which is for convenience, not speed)
    fn, weights = exported._jitted, [jax.device_put(_dtypes.cpu_to_numpy(w)) for w in exported._weights]
    host = [_dtypes.cpu_to_numpy(b[0]) for b in loader]
    host[-1] = np.concatenate([host[-1], np.repeat(host[-1][:1], rows - host[-1].shape[0], 0)])
    jax_best = 0.0
    for _ in range(4):
        t0 = time.perf_counter()
        res = [fn(weights, b) for b in host]
        outs = [np.asarray(r[0]) for r in res]
        jax_best = max(jax_best, n / (time.perf_counter() - t0))
    torch.testing.assert_close(torch.from_numpy(np.concatenate(outs)[:n]), out, rtol=1e-4, atol=1e-4)
    return {"workload": workload, "mode": mode, "batches": len(host), "batch_size": rows, "samples": n,
            "predict_samples_per_s": round(best, 1), "jax_samples_per_s": round(jax_best, 1),
            "ratio": round(best / jax_best, 3), "compiles_per_pass": compiles, "platform": torch_tpu.platform()}


def _estimator_table(workload: str, mode: str, steps: int, counts: list[int]) -> None:
    import jax

    have = len(jax.devices())
    if max(counts) > have and torch_tpu.platform() == "cpu" and "TORCH_TPU_BENCH_CHILD" not in os.environ:
        env = {**os.environ, "TORCH_TPU_BENCH_CHILD": "1",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(counts)}"}
        sys.exit(subprocess.call([sys.executable, "-m", "torch_tpu.bench", *sys.argv[1:]], env=env))
    hand = train(workload, "graph" if mode == "auto" else mode, steps)  # auto replays, as graph mode does
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
    return 128 if workload == "mlp" else workloads.SIZES[workload][5]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("allreduce", "ddp", "fsdp"):  # multi-process: bench/distributed.py
        distributed.main(sys.argv[1:])
        return
    p = argparse.ArgumentParser(prog="python -m torch_tpu.bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dispatch", help="per-op dispatch cost on 64x64 tensors")
    d.add_argument("--n", type=int, default=2000)
    t = sub.add_parser("train", help="training steps per second of a workload")
    t.add_argument("--workload", default="mlp", choices=["mlp", "gpt", "gpt-issue", "gpt-xl", "gpt-tiny"])
    t.add_argument("--mode", default="strict",
                   choices=["debug", "strict", "fused", "compile", "graph", "estimator", "jax", "cpu"])
    t.add_argument("--steps", type=int, default=10)
    t.add_argument("--compare", action="store_true", help="all modes and CPU eager, one process")
    t.add_argument("--bf16", action="store_true", help="the forward under torch.autocast to bfloat16")
    t.add_argument("--target", default=None,
                   help="a TPU chip (v4, v5e, v5p, v6e) or topology: each row gains its projected figures there")
    e = sub.add_parser("estimator", help="samples/s of TPUEstimator.fit next to the hand-written step")
    e.add_argument("--workload", default="gpt", choices=["mlp", "gpt", "gpt-issue", "gpt-xl"])
    e.add_argument("--mode", default="compile", choices=["strict", "fused", "compile", "auto"])
    e.add_argument("--steps", type=int, default=10)
    e.add_argument("--devices", default="1", help="comma-separated device counts, e.g. 1,4")
    r = sub.add_parser("predict", help="samples/s of TPUEstimator.predict next to a jitted JAX forward")
    r.add_argument("--workload", default="mlp", choices=["mlp", "gpt", "gpt-issue", "gpt-xl"])
    r.add_argument("--mode", default="fused", choices=["strict", "fused", "compile"])
    r.add_argument("--batches", type=int, default=20)
    g = sub.add_parser("decode", help="decoding tokens/s of a small Llama: generate() and a static loop")
    g.add_argument("--new", type=int, default=32)
    g.add_argument("--prompt", type=int, default=16)
    g.add_argument("--batch", type=int, default=4)
    g.add_argument("--modes", default="cpu,fused,compile,compile-fused,strict")
    g.add_argument("--loops", default="generate,static,export")
    g.add_argument("--threads", type=int, default=0, help="torch.set_num_threads for the run (0: torch's default)")
    g.add_argument("--target", default=None,
                   help="a TPU chip (v4, v5e, v5p, v6e) or topology: each tpu row gains its projected tokens/s there")
    g.add_argument("--json", action="store_true", help="also print each row as one JSON object")
    g.add_argument("--model", default="tiny", choices=["tiny", "llama-1b"],
                   help="tiny: 2 layers, d=128; llama-1b: Llama-3.2-1B's shapes, random weights (5 GB)")
    g.add_argument("--rounds", type=int, default=1,
                   help="measure each mode this many times, each beside a CPU run; report the median ratio")
    a = p.parse_args()
    if a.cmd == "predict":
        r = predict(a.workload, a.batches, a.mode)
        print(json.dumps(r))
        print(f"{'':10s} {'samples/s':>10s}\n{'predict':10s} {r['predict_samples_per_s']:10.1f}\n"
              f"{'jax':10s} {r['jax_samples_per_s']:10.1f}\npredict / jax: {r['ratio']:.3f}; "
              f"programs compiled per pass: {r['compiles_per_pass']}")
    if a.cmd == "decode":
        if a.threads:
            torch.set_num_threads(a.threads)
        print(f"torch threads: {torch.get_num_threads()}, load average: {os.getloadavg()[0]:.1f}")
        decode.table(a.modes.split(","), a.loops.split(","), rounds=a.rounds, new=a.new, prompt_len=a.prompt,
                     batch=a.batch, target=a.target, json_rows=a.json, model=a.model)
    if a.cmd == "estimator":
        _estimator_table(a.workload, a.mode, a.steps, [int(n) for n in a.devices.split(",")])
    if a.cmd == "train":
        modes = ["debug", "strict", "fused", "compile", "graph", "estimator", "jax", "cpu"] if a.compare else [a.mode]
        rows = [train(a.workload, m, a.steps, target=None if m == "cpu" else a.target, bf16=a.bf16) for m in modes]
        for r in rows:
            print(json.dumps(r))
        if a.target:
            print(f"projected on {a.target}:\n{'mode':10s} {'device ms':>10s} {'host ms':>9s} {'steps/s':>9s} "
                  f"{'MFU':>7s} {'bound':>6s} {'peak HBM MiB':>13s} {'failed':>6s}")
            for r in rows:
                t = r.get("target")
                if t:
                    print(f"{r['mode']:10s} {t['device_ms_per_step']:10.4f} {t['host_ms_per_step']:9.3f} "
                          f"{t['projected_steps_per_s']:9.1f} {t['projected_mfu']:7.2%} {t['bound']:>6s} "
                          f"{t['peak_hbm_bytes'] / 2**20:13.1f} {t['failed_programs']:6d}")
        if a.compare:
            print(f"{'mode':8s} {'steps/s':>9s} {'first step s':>13s} {'compile s':>10s} {'CPU ms/step':>12s} "
                  f"{'host ms/step':>13s}")
            for r in rows:
                print(f"{r['mode']:8s} {r['steps_per_s']:9.2f} {r['first_step_s']:13.2f} {r['compile_s']:10.2f} "
                      f"{r['cpu_ms_per_step']:12.2f} {r['host_ms_per_step']:13.3f}")
    if a.cmd == "dispatch":
        r = dispatch(a.n)
        print(json.dumps(r))
        print(f"{'op':8s} {'tpu us':>8s} {'cpu us':>8s}")
        for name, v in r["ops"].items():
            print(f"{name:8s} {v['tpu']:8.1f} {v['cpu']:8.1f}")


if __name__ == "__main__":
    main()
