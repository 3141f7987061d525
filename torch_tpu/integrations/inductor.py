"""Plain ``torch.compile(model)`` on tpu tensors: inductor's graphs go to the tpu backend.

Upstream inductor has a code generator for a device named "tpu": Pallas kernels, one per fused
region, whose generated code imports ``torch_tpu._internal.pallas`` (another project's runtime,
which this package does not have). Serving it would run each inductor kernel as a separate
``pallas_call`` next to Python wrapper code, with inductor's own fusion; torch_tpu's backend
compiles the whole AOTAutograd graph (forward, backward) into one XLA program and lets XLA fuse.
Measured on this machine (docs/integrations.md, "Plain torch.compile"), the routed program is
the faster one, and it is also the only one whose kernels run on every XLA platform (Mosaic
kernels need a TPU), so a tpu graph is routed here; ``_torch_tpu_autoload.route_inductor`` makes
the switch without importing this package for CPU graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_tpu.compile import tpu_backend


def compile_tpu_graph(gm: torch.fx.GraphModule, example_inputs: list, *args: Any, **kwargs: Any) -> Callable:
    """What inductor's ``compile_fx`` returns, for a graph on tpu: the tpu backend's program.

    Inductor's ``config_patches`` (what ``mode=`` and ``options=`` set: CUDA graphs, autotuning,
    Triton settings) have no meaning for an XLA program and are not applied; every mode compiles
    the same program, as with ``backend="tpu"``."""
    return tpu_backend(gm, example_inputs)
