"""Load and run a saved ``torch_tpu.export`` artifact with JAX alone: this module imports neither
torch nor torch_tpu, and ``Exported.save`` copies it into the artifact directory, so a server
needs only ``jax`` (and ``ml_dtypes`` for bfloat16 weights).

    from serve import load        # inside the artifact directory, or torch_tpu.load(dir)
    run = load("artifact_dir")
    outputs = run(*numpy_or_jax_inputs)
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


def _np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def read_weights(directory: str, meta: dict) -> list[np.ndarray]:
    """The weights, stored as raw little-endian bytes one after another (bfloat16 included)."""
    with open(os.path.join(directory, WEIGHTS_FILE), "rb") as f:
        blob = f.read()
    out, at = [], 0
    for w in meta["weights"]:
        dt = _np_dtype(w["dtype"])
        n = int(np.prod(w["shape"], dtype=np.int64)) * dt.itemsize
        out.append(np.frombuffer(blob[at:at + n], dtype=dt).reshape(w["shape"]).copy())
        at += n
    return out


def load(directory: str) -> Callable[..., Any]:
    """A function of the model's inputs that runs the exported program."""
    with open(os.path.join(directory, META_FILE)) as f:
        meta = json.load(f)
    if any(x["dtype"] in ("int64", "float64", "uint64", "complex128") for x in meta["weights"] + meta["inputs"]):
        jax.config.update("jax_enable_x64", True)  # the program was exported with 64-bit types
    with open(os.path.join(directory, EXPORT_FILE), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    weights = [jax.numpy.asarray(w) for w in read_weights(directory, meta)]

    def run(*inputs: Any) -> Any:
        outs = exported.call(weights, *inputs)
        return outs[0] if meta["single_output"] else tuple(outs)

    run.meta = meta
    return run
