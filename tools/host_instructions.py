"""Instructions executed per training step or per decoding call: host cost measured in a way that
does not move with the machine's load (a figure, not a test).

    python tools/host_instructions.py --workload gpt-tiny --mode fused [--steps 10]
    python tools/host_instructions.py --workload gpt-tiny --mode estimator --steps 50
    python tools/host_instructions.py --decode --mode compile-fused [--calls 2]

On a shared 2-core machine the wall and CPU times of a small step move by up to 2x between
identical runs, more than a change to the per-op path makes (5-15%). Instruction counts do not:
this runs the measured calls under valgrind's callgrind and counts only inside the one
``functools.reduce`` call that makes them (``--toggle-collect``), so imports, warm-up and compiles
are left out. The count includes XLA's own work for the programs launched in that window, which
is the same for two versions of the code that launch the same programs: compare versions of the
code on one mode, not modes. Needs valgrind (Debian's package); everything runs about 50 times
slower under it, so a run takes minutes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import warnings

_INSIDE = "_TORCH_TPU_UNDER_CALLGRIND"


def _measure(args: argparse.Namespace) -> None:
    """Under callgrind: warms the workload up, then makes the measured calls inside one reduce."""
    import torch

    import torch_tpu

    warnings.simplefilter("ignore")
    if args.decode:
        from torch_tpu.bench.decode import tiny_llama

        model = tiny_llama(2, 128).to("tpu")
        prompt = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1)).to("tpu")
        if args.mode.startswith("compile"):
            model.forward = torch.compile(model.forward, backend="tpu")
        torch_tpu.set_eager_mode("fused" if args.mode.endswith("fused") else "strict")

        def call(*_: object) -> None:
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                               pad_token_id=0, cache_implementation="static").cpu()

        count = args.calls
    elif args.mode == "estimator":
        _measure_estimator(args)
        return
    else:
        from torch_tpu.bench import workloads

        torch_tpu.set_eager_mode("strict" if args.mode == "compile" else args.mode)
        _, step, _ = workloads.make(args.workload, "tpu")
        if args.mode == "compile":
            step = torch.compile(step, backend="tpu")

        def call(*_: object) -> None:
            step()

        count = args.steps
    for _ in range(args.warmup):
        call()
    torch_tpu.sync()
    functools.reduce(call, range(count), None)
    torch_tpu.sync()


def _measure_estimator(args: argparse.Namespace) -> None:
    """``TPUEstimator().fit`` over two epochs of the workload's batch (CPU tensors, as a loader
    gives them): the first warms up and captures the step, the second (measured) replays it, so
    the count is the steady loop's: upload, replay, bookkeeping, loss reads, plus one epoch's
    start and end, which ``--steps`` amortises."""
    import torch

    import torch_tpu
    from torch_tpu.bench import workloads
    from torch_tpu.estimator import loop

    model, step, _ = workloads.make(args.workload, "cpu")
    x, y = (t.to("cpu") for t in step.data)
    epoch = loop.TrainLoop._epoch

    def measured_epoch(self: loop.TrainLoop) -> None:
        if self.run_state.epoch == 0:
            epoch(self)
        else:
            functools.reduce(lambda *_: epoch(self), range(1), None)

    loop.TrainLoop._epoch = measured_epoch
    est = torch_tpu.TPUEstimator(verbose=False)
    est.fit(model.to(est), [(x, y)] * args.steps, epochs=2,
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01))
    torch_tpu.sync()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="gpt-tiny", choices=["mlp", "gpt", "gpt-issue", "gpt-tiny"])
    parser.add_argument("--mode", default="fused",
                        help="fused | strict | compile | estimator, or for --decode also compile-fused")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--decode", action="store_true", help="generate() with a static cache, not a training step")
    parser.add_argument("--calls", type=int, default=2, help="with --decode: generate() calls measured")
    parser.add_argument("--tokens", type=int, default=32, help="with --decode: new tokens per call")
    args = parser.parse_args()
    if os.environ.get(_INSIDE):
        _measure(args)
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("host_instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = [valgrind, "--tool=callgrind", "--toggle-collect=functools_reduce", f"--callgrind-out-file={out}",
               sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        run = subprocess.run(cmd, env={**os.environ, _INSIDE: "1"}, capture_output=True, text=True)
        found = re.search(r"^summary:\s*(\d+)", open(out).read(), re.M) if os.path.exists(out) else None
        if run.returncode != 0 or found is None:
            print(run.stderr[-4000:], file=sys.stderr)
            return run.returncode or 1
    total = int(found.group(1))
    per, unit = (args.calls, "call") if args.decode else (args.steps, "step")
    what = {"decode": f"generate() of {args.tokens} tokens"} if args.decode else {"workload": args.workload}
    print(json.dumps({**what, "mode": args.mode, f"{unit}s": per, "instructions": total,
                      f"instructions_per_{unit}": total // per}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
