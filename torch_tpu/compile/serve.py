"""Load and run a saved ``torch_tpu.export`` artifact with JAX alone: this module imports neither
torch nor torch_tpu, and ``Exported.save`` copies it into the artifact directory, so a server
needs only ``jax`` (and ``ml_dtypes`` for bfloat16 weights).

    from serve import load        # inside the artifact directory, or torch_tpu.load(dir)
    run = load("artifact_dir")
    outputs = run(*numpy_or_jax_inputs)

An artifact with state (a decoding step and its KV cache: buffers the model updates) keeps the
state's current values inside ``run``: each call passes them and keeps the new ones, as the
module's buffers would change; ``run.reset()`` puts back the values saved at export.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

EXPORT_FILE = "model.jaxexport"
META_FILE = "meta.json"
WEIGHTS_FILE = "weights.bin"
STATE_FILE = "state.bin"  # the state buffers' values at export, in the same layout


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def read_weights(directory: str, meta: dict, kind: str = "weights") -> list[np.ndarray]:
    """The weights (or with ``kind="state"`` the state's values), stored as raw little-endian
    bytes one after another (bfloat16 included)."""
    entries = meta.get(kind, [])
    if not entries:
        return []
    with open(os.path.join(directory, WEIGHTS_FILE if kind == "weights" else STATE_FILE), "rb") as f:
        blob = f.read()
    out, at = [], 0
    for w in entries:
        dt = _np_dtype(w["dtype"])
        n = int(np.prod(w["shape"], dtype=np.int64)) * dt.itemsize
        out.append(np.frombuffer(blob[at:at + n], dtype=dt).reshape(w["shape"]).copy())
        at += n
    return out


def load(directory: str) -> Callable[..., Any]:
    """A function of the model's inputs that runs the exported program."""
    with open(os.path.join(directory, META_FILE)) as f:
        meta = json.load(f)
    described = meta["weights"] + meta["inputs"] + meta.get("state", [])
    if any(x["dtype"] in ("int64", "float64", "uint64", "complex128") for x in described):
        jax.config.update("jax_enable_x64", True)  # the program was exported with 64-bit types
    with open(os.path.join(directory, EXPORT_FILE), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    weights = [jax.numpy.asarray(w) for w in read_weights(directory, meta)]
    initial = read_weights(directory, meta, "state")
    if not initial:
        def run(*inputs: Any) -> Any:
            outs = exported.call(weights, *inputs)
            return outs[0] if meta["single_output"] else tuple(outs)
    else:
        # the state's buffers are run's own: donated, so each step updates them in place
        step = jax.jit(exported.call, donate_argnums=(1,))
        state: list = []

        def run(*inputs: Any) -> Any:
            if not state:
                state.extend(jax.numpy.array(s) for s in initial)
            new, outs = step(weights, list(state), *inputs)
            state[:] = new
            return outs[0] if meta["single_output"] else tuple(outs)

        run.reset = state.clear  # the next call starts from the values at export

    run.meta = meta
    return run
