"""Live device buffers and process RSS over many training steps (a figure, not a test).

    python tools/memory_check.py --mode fused --steps 500 --workload gpt

``--mode compile`` runs the step under ``torch.compile(backend="tpu")`` (in strict mode), whose
graphs are deferred into one program per step like fused mode's trace. ``--mode graph`` captures
one step with ``torch.tpu.graph`` (after an eager warm-up step) and replays it.
"""

from __future__ import annotations

import argparse
import json
import resource

import jax

import torch_tpu
from torch_tpu.bench import workloads


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="fused")
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--workload", default="gpt")
    a = p.parse_args()
    torch_tpu.set_eager_mode("strict" if a.mode in ("compile", "graph") else a.mode)
    _, step, _ = workloads.make(a.workload, "tpu")
    if a.mode == "compile":
        import torch

        step = torch.compile(step, backend="tpu")
    if a.mode == "graph":
        from torch_tpu.bench.__main__ import _captured

        step, _ = _captured(step)
    samples = []
    for i in range(1, a.steps + 1):
        loss = step()
        if i % max(a.steps // 10, 1) == 0 or i == 3:
            float(loss.detach().cpu())
            samples.append({"step": i, "live_arrays": len(jax.live_arrays()), "rss_mib": round(rss_mib(), 1)})
    print(json.dumps({"workload": a.workload, "mode": a.mode, "samples": samples}))


if __name__ == "__main__":
    main()
