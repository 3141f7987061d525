"""``torch_tpu.export``: a ``torch.export`` trace, lowered through the lowering table to one jax
function, then exported with ``jax.export`` for serving without torch.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Any

import jax
import numpy as np
import torch
from torch._decomp import core_aten_decompositions
from torch.export.graph_signature import InputKind

from torch_tpu import _dtypes
from torch_tpu.compile import serve
from torch_tpu.compile.backend import lower_graph


def _host(x: Any) -> Any:
    return x.detach().to("cpu") if isinstance(x, torch.Tensor) else x


def _spec(t: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(t.shape), _dtypes.to_jax(t.dtype))


class Exported:
    """The artifact: ``stablehlo_text()``, ``save(dir)``, and ``__call__`` on tpu tensors."""

    def __init__(self, fn: Any, weights: list[torch.Tensor], example: list[torch.Tensor], single: bool) -> None:
        self._fn = fn
        self._weights = weights
        self._example = example
        self._single = single
        self._jitted = jax.jit(fn)

    def _specs(self) -> tuple:
        return [_spec(w) for w in self._weights], *[_spec(x) for x in self._example]

    def stablehlo_text(self) -> str:
        """The program as StableHLO MLIR."""
        return self._jitted.lower(*self._specs()).as_text()

    def save(self, directory: str | os.PathLike) -> None:
        """Writes the serialized ``jax.export`` program, its weights, and a torch-free loader."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        exported = jax.export.export(self._jitted)(*self._specs())
        with open(os.path.join(directory, serve.EXPORT_FILE), "wb") as f:
            f.write(exported.serialize())
        meta = {
            "weights": [{"shape": list(w.shape), "dtype": str(w.dtype).removeprefix("torch.")} for w in self._weights],
            "inputs": [{"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")} for x in self._example],
            "single_output": self._single,
        }
        with open(os.path.join(directory, serve.WEIGHTS_FILE), "wb") as f:
            for w in self._weights:
                f.write(_dtypes.cpu_to_numpy(w).tobytes())
        with open(os.path.join(directory, serve.META_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        shutil.copyfile(serve.__file__, os.path.join(directory, "serve.py"))

    def __call__(self, *inputs: torch.Tensor) -> Any:
        arrays = [np.asarray(_dtypes.cpu_to_numpy(w)) for w in self._weights]
        outs = self._jitted(arrays, *[_dtypes.cpu_to_numpy(_host(x)) for x in inputs])
        res = [torch.from_numpy(np.array(o)) for o in outs]
        return res[0] if self._single else tuple(res)


def export(model: torch.nn.Module, example_args: tuple) -> Exported:
    """Traces ``model`` with ``torch.export`` (on CPU copies) and lowers it for serving."""
    cpu_model = copy.deepcopy(model).to("cpu").eval()
    args = tuple(_host(a) for a in example_args)
    ep = torch.export.export(cpu_model, args).run_decompositions(core_aten_decompositions())
    fn, n_random, out_metas = lower_graph(ep.graph_module)
    if n_random:
        raise NotImplementedError("torch_tpu.export: the model draws random numbers (dropout in training mode?)")
    state = {**ep.state_dict, **ep.constants}
    weights, slots = [], []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            slots.append(None)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            slots.append(len(weights))
            weights.append(state[spec.target].detach().contiguous())
        else:
            raise NotImplementedError(f"torch_tpu.export: input kind {spec.kind} is not supported")

    def program(weight_arrays: list, *inputs: Any) -> tuple:
        it = iter(inputs)
        full = [next(it) if s is None else weight_arrays[s] for s in slots]
        return fn([], *full)

    user_outputs = [s for s in ep.graph_signature.output_specs]
    return Exported(program, weights, [a for a in args if isinstance(a, torch.Tensor)], len(user_outputs) == 1)


def load(directory: str | os.PathLike) -> Any:
    """Loads a saved artifact; the returned function runs with JAX alone."""
    return serve.load(os.fspath(directory))
