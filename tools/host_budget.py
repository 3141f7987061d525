"""How much host CPU a training step may spend and still reach a given fraction of the JAX ceiling
on this machine (a figure, not a test).

    python tools/host_budget.py --workload gpt [--bench-dir ../shared/bench]

XLA:CPU runs a program on every core, so on a small machine each millisecond of Python per step
(PyTorch's dispatcher, autograd and Dynamo's runtime, then ours) takes CPU away from the program
instead of hiding behind it. This measures that exchange rate and applies it:

1. The JAX ceiling (``jax_ceiling.py`` of the shared benchmark) with 0 to 4 ms of busy Python
   added after each step call: the wall milliseconds each host millisecond costs (a line fitted
   through the step times).
2. The host CPU per step (the main thread and autograd's, from ``/proc/self/task``) of the JAX
   ceiling, of each tpu mode, and of ``torch.compile`` with a backend whose graphs do no work:
   the floor that PyTorch's own runtime (Dynamo's guards, AOTAutograd's wrappers, the autograd
   engine) sets for any compiled backend.
3. Per mode: the ratio to the ceiling that the line predicts from its host CPU, next to the
   measured ratio, and the host CPU a target ratio allows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import torch_tpu

_TICK = os.sysconf("SC_CLK_TCK")


def host_cpu_seconds() -> float:
    """CPU seconds used so far by the threads that run Python and PyTorch: the main thread and
    autograd's device threads (``pt_autograd_*``). XLA's compute pool (``tf_XLAEigen``) and the
    unnamed threads of the PJRT client, which run the programs, are the device's side."""
    total = 0.0
    main = str(os.getpid())
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if tid != main and not name.startswith("pt_autograd"):
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    return total


def _busy(ms: float) -> None:
    end = time.thread_time() + ms / 1e3
    while time.thread_time() < end:
        pass


def measure(step: Callable[[], Any], read: Callable[[Any], float], extra_ms: float = 0.0,
            windows: int = 5, steps: int = 40) -> dict:
    """Steps/s (best window, as ``mode_bench.py`` reports) and host CPU ms per step (all windows)."""
    for _ in range(5):
        out = step()
    read(out)
    best, cpu0, n = 0.0, host_cpu_seconds(), 0
    for _ in range(windows):
        t = time.perf_counter()
        for _ in range(steps):
            out = step()
            if extra_ms:
                _busy(extra_ms)
        read(out)  # a host read ends the window's queued work
        best = max(best, steps / (time.perf_counter() - t))
        n += steps
    return {"steps_per_s": round(best, 2), "host_ms": round((host_cpu_seconds() - cpu0) / n * 1e3, 3)}


def _null_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A backend whose compiled graphs return the outputs of their first run without computing.

    Each call hands back fresh contiguous tensors over the first run's device arrays, as our
    backend hands back its outputs: returning the first run's tensors themselves would keep every gradient
    referenced between steps, and the autograd engine would then clone each one into ``.grad``
    (an eager device op per parameter and step, which no real backend pays)."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from torch_tpu.tensor.storage import is_tpu, new_tensor, read

    def compiler(graph: torch.fx.GraphModule, _: list) -> Callable:
        cached: list | None = None

        def run(args: list) -> Any:
            nonlocal cached
            if cached is None:  # the first run computes (a graph may return nothing: the optimizer's)
                cached = [(tuple(o.shape), o.dtype, read(o)) if isinstance(o, torch.Tensor) and is_tpu(o)
                          else (None, None, o) for o in graph(*args)]
            args.clear()
            return [o if shape is None else new_tensor(shape, dtype, o) for shape, dtype, o in cached]

        run._boxed_call = True
        return run

    return aot_module_simplified(gm, example_inputs, fw_compiler=compiler, bw_compiler=compiler,
                                 keep_inference_input_mutations=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="gpt")
    p.add_argument("--bench-dir", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "bench"))
    p.add_argument("--modes", default="compile,fused")
    p.add_argument("--targets", default="compile=0.9,fused=0.8")
    a = p.parse_args()
    sys.path.insert(0, os.path.abspath(a.bench_dir))
    import jax_ceiling  # noqa: PLC0415 (the shared benchmark's, found through --bench-dir)
    import workloads  # noqa: PLC0415

    from torch_tpu.compile import backend

    tpu = torch.device("tpu")
    to_float = lambda loss: float(loss.detach().to("cpu"))  # noqa: E731
    model, _, step, _ = workloads.make(a.workload, torch.device("cpu"))
    x, y = step.data
    jax_step = jax_ceiling.build(a.workload, model, x, y)
    curve = {ms: measure(jax_step, float, extra_ms=ms) for ms in (0, 1, 2, 3, 4)}
    # least squares through (added host ms, wall ms per step)
    xs = list(curve)
    ys = [1e3 / curve[ms]["steps_per_s"] for ms in xs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((u - mx) * (v - my) for u, v in zip(xs, ys)) / sum((u - mx) ** 2 for u in xs)
    base = curve[0]
    print(json.dumps({"workload": a.workload, "jax_with_added_host_ms": curve,
                      "wall_ms_per_host_ms": round(slope, 3)}))

    backend.skip_our_frames()  # the no-op backend's first run computes on tpu
    _, _, null_step, _ = workloads.make(a.workload, tpu)
    floor = measure(torch.compile(null_step, backend=_null_backend), lambda _: None)
    print(json.dumps({"torch.compile with a no-op backend (PyTorch's runtime alone)": floor}))

    targets = dict(t.split("=") for t in a.targets.split(",") if t)
    rows = []
    for mode in a.modes.split(","):
        torch_tpu.set_eager_mode("strict" if mode == "compile" else mode)
        _, _, s, _ = workloads.make(a.workload, tpu)
        if mode == "compile":
            torch._dynamo.reset()
            s = torch.compile(s, backend="tpu")
        m = measure(s, to_float)
        torch_tpu.set_eager_mode("strict")
        jax_wall = 1e3 / base["steps_per_s"]
        predicted = jax_wall / (jax_wall + slope * (m["host_ms"] - base["host_ms"]))
        row = {"mode": mode, **m, "ratio": round(m["steps_per_s"] / base["steps_per_s"], 3),
               "predicted_ratio": round(predicted, 3)}
        if mode in targets:
            r = float(targets[mode])
            row[f"host_ms_allowed_for_{r}x"] = round(base["host_ms"] + (1 / r - 1) * jax_wall / slope, 2)
        rows.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
