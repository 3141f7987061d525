"""Compiles the OpInfo samples of every dtype for a TPU chip and lists what does not compile.

    python tools/target_sweep.py --target v5e                      # every op, the six dtypes, fwd + bwd
    python tools/target_sweep.py --dtypes int64,bool --every 3     # a sample of the ops
    python tools/target_sweep.py --every 3 --offset 1              # the next third
    python tools/target_sweep.py --only matmul,sort -v --json out.json

Why: the OpInfo gate runs float32 on XLA:CPU; a TPU compiles what XLA:CPU compiles only in part
(64-bit types are emulated, some primitives have no TPU lowering). For each op of PyTorch's
``op_db`` and each of ``--dtypes`` that CPU supports for it, up to ``--samples`` samples run on
tpu in strict mode with the target set (``torch_tpu.set_target``), forward and, for floating and
complex dtypes of differentiable ops, backward; every program they make is compiled by libtpu
for the chip (``torch_tpu.runtime.target``). A sample CPU rejects is skipped, and so is one that
fails on tpu itself (the OpInfo gate's business): what is listed is what compiles here and not
for a TPU, with the op, the dtype, the program and XLA:TPU's error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_tpu
from torch_tpu.runtime import target as _target
from torch_tpu.testing import opinfo

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64, "bool": torch.bool,
          "complex64": torch.complex64, "float64": torch.float64}


def _to_tpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        y = x.detach().to("tpu")
        return y.requires_grad_(x.requires_grad) if x.requires_grad else y
    return x


def _sample_runs(op: Any, dtype: torch.dtype, samples: int, backward: bool) -> tuple[int, int]:
    """Runs ``op``'s samples of ``dtype`` on tpu (forward, and backward where it applies): the
    samples run, and those that failed on tpu itself."""
    grad = backward and (dtype.is_floating_point or dtype.is_complex) and op.supports_autograd
    ran = failed = 0
    torch.manual_seed(0)
    try:
        gen = op.sample_inputs("cpu", dtype, requires_grad=grad)
    except Exception:  # the database has no samples of this dtype
        return 0, 0
    for i, s in enumerate(gen):
        if i >= samples:
            break
        try:
            op(s.input, *s.args, **s.kwargs)
        except Exception:
            continue  # CPU rejects it
        ran += 1
        try:
            inp, args, kwargs = tree_map(_to_tpu, (s.input, s.args, s.kwargs))
            out = s.output_process_fn_grad(op(inp, *args, **kwargs))
            leaves = [t for t in tree_flatten((inp, args, kwargs))[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
            if grad and leaves and outs:
                total = sum(o.abs().sum() if o.is_complex() else o.sum() for o in outs)
                torch.autograd.grad(total, leaves, allow_unused=True)
            torch_tpu.sync()
        except Exception:
            failed += 1
    return ran, failed


def sweep(ops: list, dtypes: list[str], samples: int, backward: bool, verbose: bool) -> dict:
    failures: list[dict] = []
    per_dtype: Counter = Counter()
    compiled: Counter = Counter()
    tpu_errors: Counter = Counter()
    for op in ops:
        name = opinfo.op_key(op)
        supported = op.supported_dtypes("cpu")
        for d in dtypes:
            dtype = DTYPES[d]
            if dtype not in supported:
                continue
            _target.reset()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ran, failed = _sample_runs(op, dtype, samples, backward)
            rep = _target.report(wait=True)
            per_dtype[d] += ran
            tpu_errors[d] += failed
            compiled[d] += rep["programs"]["compiled"]
            for f in rep["failures"]:
                error = str(f.get("error", "")).strip().splitlines()
                failures.append({"op": name, "dtype": d, "program": f.get("program"), "ops": f.get("ops"),
                                 "error": error[0][:300] if error else ""})
                if verbose:
                    print(f"FAIL {name} {d}: {f.get('program')}: {failures[-1]['error']}", flush=True)
    return {"samples_run": dict(per_dtype), "programs_compiled": dict(compiled),
            "samples_failed_on_tpu_itself": dict(tpu_errors), "failures": failures}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="v5e")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--every", type=int, default=1, help="every N-th op of op_db")
    p.add_argument("--offset", type=int, default=0, help="with --every N: start at this op (0..N-1)")
    p.add_argument("--only", help="comma-separated op names")
    p.add_argument("--forward-only", action="store_true")
    p.add_argument("--json", help="write the result here")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args()
    if not _target.available():
        sys.exit("target_sweep: libtpu is not installed: no TPU compiler")
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [o for o in op_db if not a.only or o.name in a.only.split(",") or opinfo.op_key(o) in a.only.split(",")]
    ops = ops[a.offset::a.every]
    dtypes = [d for d in a.dtypes.split(",") if d]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        sys.exit(f"target_sweep: unknown dtypes {unknown}; expected {', '.join(DTYPES)}")
    torch_tpu.set_eager_mode("strict")
    t0 = time.time()
    with torch_tpu.set_target(a.target):
        out = sweep(ops, dtypes, a.samples, not a.forward_only, a.verbose)
    out.update(target=a.target, ops=len(ops), seconds=round(time.time() - t0))
    by = Counter((f["dtype"]) for f in out["failures"])
    print(f"{len(ops)} ops, {a.target}, {out['seconds']} s")
    print(f"{'dtype':10s} {'samples':>8s} {'programs':>9s} {'failed':>7s}")
    for d in dtypes:
        print(f"{d:10s} {out['samples_run'].get(d, 0):8d} {out['programs_compiled'].get(d, 0):9d} {by.get(d, 0):7d}")
    for f in out["failures"]:
        print(f"FAIL {f['op']} {f['dtype']}: {f['program']}: {f['error']}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
