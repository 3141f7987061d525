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
import torch.utils._pytree as pytree
from torch._decomp import core_aten_decompositions
from torch.export.graph_signature import ConstantArgument, InputKind

from torch_tpu import _dtypes
from torch_tpu.compile import serve
from torch_tpu.compile.backend import lower_graph


def _host(x: Any) -> Any:
    return x.detach().to("cpu") if isinstance(x, torch.Tensor) else x


def _spec(t: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(t.shape), _dtypes.to_jax(t.dtype))


class Exported:
    """The artifact: ``stablehlo_text()``, ``save(dir)``, and ``__call__`` on CPU or tpu tensors,
    which takes the model's arguments and returns its outputs in the model's structure (a dict
    stays a dict). The saved program, run by JAX alone, takes and returns flat tuples."""

    def __init__(self, fn: Any, weights: list[torch.Tensor], example: list[torch.Tensor], constants: list,
                 call_spec: Any) -> None:
        self._fn = fn
        self._weights = weights
        self._example = example
        self._call_spec = call_spec
        self._single = call_spec.out_spec.num_leaves == 1
        self._constants = constants
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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs, constants = _split_inputs(args, kwargs, self._call_spec.in_spec)
        for i, (x, e) in enumerate(zip(inputs, self._example)):
            if tuple(x.shape) != tuple(e.shape) or x.dtype != e.dtype:
                raise ValueError(
                    f"torch_tpu.export: input tensor {i} is {str(x.dtype).removeprefix('torch.')}{list(x.shape)}, but "
                    f"the program was exported for {str(e.dtype).removeprefix('torch.')}{list(e.shape)}: export it "
                    "again with an example of this shape"
                )
        if constants != self._constants:
            raise ValueError(
                f"torch_tpu.export: the non-tensor arguments are {constants}, but the program was exported "
                f"with {self._constants} built in: export it again with these values"
            )
        arrays = [np.asarray(_dtypes.cpu_to_numpy(w)) for w in self._weights]
        outs = self._jitted(arrays, *[_dtypes.cpu_to_numpy(x) for x in inputs])
        res = [_dtypes.numpy_to_cpu(np.asarray(o), _dtypes.to_torch(o.dtype)) for o in outs]
        return pytree.tree_unflatten(res, self._call_spec.out_spec)


def _split_inputs(args: tuple, kwargs: dict, in_spec: Any) -> tuple[list[torch.Tensor], list]:
    """The model's arguments in the order of the exported program's inputs (``torch.export``
    flattens keyword arguments in the order of its trace): the tensors, on the host, and the other
    values, which ``torch.export`` builds into the program."""
    from torch.fx._pytree import tree_flatten_spec

    flat = tree_flatten_spec((args, kwargs), in_spec)
    return [_host(x) for x in flat if isinstance(x, torch.Tensor)], [x for x in flat if not isinstance(x, torch.Tensor)]


def export(model: torch.nn.Module, example_args: tuple, example_kwargs: dict | None = None) -> Exported:
    """Traces ``model`` with ``torch.export`` (on CPU copies, in eval mode) on the example
    arguments, and lowers it for serving."""
    cpu_model = copy.deepcopy(model).to("cpu").eval()
    args = tuple(_host(a) for a in example_args)
    kwargs = {k: _host(v) for k, v in (example_kwargs or {}).items()}
    ep = torch.export.export(cpu_model, args, kwargs).run_decompositions(core_aten_decompositions())
    fn, n_random, out_metas = lower_graph(ep.graph_module)
    if n_random:
        raise NotImplementedError("torch_tpu.export: the model draws random numbers (dropout in training mode?)")
    state = {**ep.state_dict, **ep.constants}
    weights, slots = [], []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            slots.append(("value", spec.arg.value))  # a number the program is specialized on
        elif spec.kind == InputKind.USER_INPUT:
            slots.append(None)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            slots.append(len(weights))
            weights.append(state[spec.target].detach().contiguous())
        else:
            raise NotImplementedError(f"torch_tpu.export: input kind {spec.kind} is not supported")

    def program(weight_arrays: list, *inputs: Any) -> tuple:
        it = iter(inputs)
        full = [next(it) if s is None else s[1] if type(s) is tuple else weight_arrays[s] for s in slots]
        return fn([], *full)

    return Exported(program, weights, *_split_inputs(args, kwargs, ep.call_spec.in_spec), ep.call_spec)


def load(directory: str | os.PathLike) -> Any:
    """Loads a saved artifact; the returned function runs with JAX alone."""
    return serve.load(os.fspath(directory))
