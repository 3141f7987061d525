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
from torch.export import ExportedProgram
from torch.export.graph_signature import ConstantArgument, InputKind, OutputKind

from torch_tpu.compile import serve
from torch_tpu.compile.backend import lower_graph
from torch_tpu.core import dtypes as _dtypes
from torch_tpu.runtime import target as _target


def _host(x: Any) -> Any:
    return x.detach().to("cpu") if isinstance(x, torch.Tensor) else x


def _spec(t: torch.Tensor) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(t.shape), _dtypes.to_jax(t.dtype))


class Exported:
    """The artifact: ``stablehlo_text()``, ``save(dir)``, and ``__call__`` on CPU or tpu tensors,
    which takes the model's arguments and returns its outputs in the model's structure (a dict
    stays a dict). The saved program, run by JAX alone, takes and returns flat tuples.

    A model that updates buffers in its forward (a decoding step writing its static KV cache)
    has *state*: those buffers. The artifact keeps their current values and passes them to each
    call, whose program returns their new values (donated, so XLA updates them in place), as the
    module's own buffers would change; ``reset_state()`` puts back the values at export."""

    def __init__(self, fn: Any, weights: list[torch.Tensor], example: list[torch.Tensor], constants: list,
                 call_spec: Any, state: list[torch.Tensor], state_names: list[str]) -> None:
        self._fn = fn
        self._weights = weights
        self._example = example
        self._call_spec = call_spec
        self._single = call_spec.out_spec.num_leaves == 1
        self._constants = constants
        self._state = state
        self.state_names = state_names
        self._jitted = jax.jit(fn)
        # the state's arrays are the artifact's own: each call's new values may reuse their buffers
        self._run = jax.jit(fn, donate_argnums=(1,)) if state else self._jitted
        # with a TPU target set (torch_tpu.set_target), the artifact's program is compiled for it too
        self._run = _target.watch(self._run, kind="export", name="exported program", fn=fn, ops=["torch_tpu.export"],
                                  site=lambda: None, donate=(1,) if state else ())
        self._weight_arrays: list | None = None
        self._state_arrays: list | None = None

    def _specs(self) -> tuple:
        weights = [_spec(w) for w in self._weights]
        inputs = [_spec(x) for x in self._example]
        if self._state:
            return weights, [_spec(s) for s in self._state], *inputs
        return weights, *inputs

    def stablehlo_text(self) -> str:
        """The program as StableHLO MLIR."""
        return self._jitted.lower(*self._specs()).as_text()

    def reset_state(self) -> None:
        """The state buffers back to their values at export (a new decoding's empty cache)."""
        self._state_arrays = None

    def state(self) -> dict[str, torch.Tensor]:
        """The state buffers' current values, by the module's buffer names, as CPU tensors."""
        arrays = self._state_arrays
        if arrays is None:
            return {n: s.clone() for n, s in zip(self.state_names, self._state)}
        return {n: _dtypes.numpy_to_cpu(np.asarray(a), s.dtype)
                for n, a, s in zip(self.state_names, arrays, self._state)}

    def save(self, directory: str | os.PathLike) -> None:
        """Writes the serialized ``jax.export`` program, its weights (and the state's values at
        export), and a torch-free loader."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        exported = jax.export.export(self._jitted)(*self._specs())
        with open(os.path.join(directory, serve.EXPORT_FILE), "wb") as f:
            f.write(exported.serialize())

        def described(tensors: list[torch.Tensor]) -> list[dict]:
            return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in tensors]

        meta = {
            "weights": described(self._weights),
            "inputs": described(self._example),
            "single_output": self._single,
            "state": [{**d, "name": n} for d, n in zip(described(self._state), self.state_names)],
        }
        for name, tensors in ((serve.WEIGHTS_FILE, self._weights), (serve.STATE_FILE, self._state)):
            if name == serve.STATE_FILE and not tensors:
                continue  # a model without state: no state file
            with open(os.path.join(directory, name), "wb") as f:
                for t in tensors:
                    f.write(_dtypes.cpu_to_numpy(t).tobytes())
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
        if self._weight_arrays is None:  # put on the device once, not at every call
            self._weight_arrays = [jax.device_put(_dtypes.cpu_to_numpy(w)) for w in self._weights]
        arrays = [_dtypes.cpu_to_numpy(x) for x in inputs]
        if self._state:
            if self._state_arrays is None:
                self._state_arrays = [jax.device_put(_dtypes.cpu_to_numpy(s).copy()) for s in self._state]
            self._state_arrays, outs = self._run(self._weight_arrays, self._state_arrays, *arrays)
            self._state_arrays = list(self._state_arrays)
        else:
            outs = self._run(self._weight_arrays, *arrays)
        res = [_dtypes.numpy_to_cpu(np.asarray(o), _dtypes.to_torch(o.dtype)) for o in outs]
        return pytree.tree_unflatten(res, self._call_spec.out_spec)


def _split_inputs(args: tuple, kwargs: dict, in_spec: Any) -> tuple[list[torch.Tensor], list]:
    """The model's arguments in the order of the exported program's inputs (``torch.export``
    flattens keyword arguments in the order of its trace): the tensors, on the host, and the other
    values, which ``torch.export`` builds into the program."""
    from torch.fx._pytree import tree_flatten_spec

    flat = tree_flatten_spec((args, kwargs), in_spec)
    return [_host(x) for x in flat if isinstance(x, torch.Tensor)], [x for x in flat if not isinstance(x, torch.Tensor)]


def export(model: torch.nn.Module | ExportedProgram, example_args: tuple = (),
           example_kwargs: dict | None = None, strict: bool = False) -> Exported:
    """Traces ``model`` with ``torch.export`` (on CPU copies, in eval mode) on the example
    arguments, and lowers it for serving. ``model`` may also be a ``torch.export.ExportedProgram``
    already made (transformers' ``convert_and_export_with_cache``, say), whose example inputs are
    then its own. ``strict`` is ``torch.export``'s: a module that reaches its buffers through
    other objects (a ``StaticCache`` registered as buffers) needs the strict (Dynamo) trace,
    which sees that the object's tensors are the buffers."""
    if isinstance(model, ExportedProgram):
        if example_args or example_kwargs:
            raise ValueError("torch_tpu.export: an ExportedProgram carries its own example inputs; pass none")
        ep = model
        args, kwargs = pytree.tree_map(_host, ep.example_inputs)
    else:
        cpu_model = copy.deepcopy(model).to("cpu").eval()
        args = tuple(_host(a) for a in example_args)
        kwargs = {k: _host(v) for k, v in (example_kwargs or {}).items()}
        ep = torch.export.export(cpu_model, args, kwargs, strict=strict)
    ep = ep.run_decompositions(core_aten_decompositions())
    fn, n_random, out_metas = lower_graph(ep.graph_module)
    if n_random:
        raise NotImplementedError("torch_tpu.export: the model draws random numbers (dropout in training mode?)")
    state_dict = {**ep.state_dict, **ep.constants}
    signature = ep.graph_signature
    outs = signature.output_specs
    for spec in outs:
        if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION):
            raise NotImplementedError(
                f"torch_tpu.export: the model's outputs include a {spec.kind.name} ({spec.target or spec.arg}); only "
                "its own outputs and updates of its buffers are supported: a forward that changes one of its inputs "
                "in place needs that tensor registered as a buffer")
    mutated = [spec.target for spec in outs if spec.kind == OutputKind.BUFFER_MUTATION]
    state_at = {name: j for j, name in enumerate(mutated)}
    weights, state, slots = [], [None] * len(mutated), []
    for spec in signature.input_specs:
        if spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, ConstantArgument):
            slots.append(("value", spec.arg.value))  # a number the program is specialized on
        elif spec.kind == InputKind.USER_INPUT:
            slots.append(None)
        elif spec.kind == InputKind.BUFFER and spec.target in state_at:
            j = state_at[spec.target]
            slots.append(("state", j))
            state[j] = _host(state_dict[spec.target]).contiguous().clone()
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            slots.append(len(weights))
            weights.append(_host(state_dict[spec.target]).contiguous())
        else:
            raise NotImplementedError(f"torch_tpu.export: input kind {spec.kind} is not supported")
    n_state = len(mutated)
    user = [i for i, spec in enumerate(outs) if spec.kind == OutputKind.USER_OUTPUT]
    updates = [i for i, spec in enumerate(outs) if spec.kind == OutputKind.BUFFER_MUTATION]

    def values(weight_arrays: list, state_arrays: list, inputs: tuple) -> list:
        it = iter(inputs)
        full = []
        for s in slots:
            if s is None:
                full.append(next(it))
            elif type(s) is int:
                full.append(weight_arrays[s])
            elif s[0] == "state":
                full.append(state_arrays[s[1]])
            else:
                full.append(s[1])
        return fn([], *full)

    if n_state:
        def program(weight_arrays: list, state_arrays: list, *inputs: Any) -> tuple:
            out = values(weight_arrays, state_arrays, inputs)
            return tuple(out[i] for i in updates), tuple(out[i] for i in user)
    else:
        def program(weight_arrays: list, *inputs: Any) -> tuple:
            out = values(weight_arrays, [], inputs)
            return tuple(out[i] for i in user)

    return Exported(program, weights, *_split_inputs(args, kwargs, ep.call_spec.in_spec), ep.call_spec, state,
                    mutated)


def load(directory: str | os.PathLike) -> Any:
    """Loads a saved artifact; the returned function runs with JAX alone."""
    return serve.load(os.fspath(directory))
