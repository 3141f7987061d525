"""``torch.tpu.make_graphed_callables``: a module's or function's forward and backward as two
captured graphs, replayed under autograd (CUDA's ``make_graphed_callables``).

Each callable is warmed up eagerly, then its forward is captured into one graph and the backward
of its outputs (with static gradient buffers) into another. The returned callable is an autograd
function: its forward copies the arguments into the sample (static) inputs and replays the
forward graph; its backward copies the incoming gradients into the static gradient buffers and
replays the backward graph, returning the static gradients of the inputs and parameters, which
autograd then accumulates as usual. As with CUDA, outputs alias the graph's static outputs, so
the next call overwrites them, and a module uses its graphs only in the training mode it was
captured in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_tpu.device.graphs import TPUGraph, graph


def make_graphed_callables(callables: Any, sample_args: Any, num_warmup_iters: int = 3,
                           allow_unused_input: bool = False, pool: Any = None) -> Any:
    """CUDA's ``make_graphed_callables``: each callable (a module or function) becomes one whose
    forward and backward are captured graphs, replayed per call."""
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    if len(callables) != len(sample_args):
        raise ValueError("make_graphed_callables: one tuple of sample arguments per callable is needed")
    made = [_graphed(fn, tuple(args), num_warmup_iters, allow_unused_input, pool)
            for fn, args in zip(callables, sample_args)]
    return made[0] if single else tuple(made)


def _check_args(args: tuple) -> None:
    for a in args:
        if not isinstance(a, torch.Tensor) or a.device.type != "tpu":
            raise TypeError("make_graphed_callables: sample arguments must be tpu tensors, got "
                            f"{type(a).__name__}{'' if not isinstance(a, torch.Tensor) else ' on ' + str(a.device)}")


def _grads(outputs: list, grad_outputs: list, inputs: list, allow_unused: bool) -> tuple:
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    if not pairs or not inputs:
        return (None,) * len(inputs)
    return torch.autograd.grad([o for o, _ in pairs], inputs, grad_outputs=[g for _, g in pairs],
                               only_inputs=True, allow_unused=allow_unused)


def _graphed(fn: Any, args: tuple, warmup: int, allow_unused: bool, pool: Any) -> Any:
    _check_args(args)
    module = fn if isinstance(fn, torch.nn.Module) else None
    params = tuple(p for p in module.parameters() if p.requires_grad) if module is not None else ()
    static_inputs = args + params
    diff_inputs = [t for t in static_inputs if t.requires_grad]
    call = module.forward if module is not None else fn
    for _ in range(warmup):  # eagerly: optimizer-free, so the weights do not change
        outs = pytree.tree_leaves(call(*args))
        _grads(outs, [torch.ones_like(o) for o in outs], diff_inputs, allow_unused)
    outs = None
    forward_graph, backward_graph = TPUGraph(), TPUGraph()
    with graph(forward_graph, pool=pool):
        static_outputs = call(*args)
    flat_outputs, spec = pytree.tree_flatten(static_outputs)
    static_grad_outputs = [torch.zeros_like(o) if o.requires_grad else None for o in flat_outputs]
    with graph(backward_graph, pool=pool):
        grads = _grads(flat_outputs, static_grad_outputs, diff_inputs, allow_unused)
    grads_iter = iter(grads)
    static_grad_inputs = [next(grads_iter) if t.requires_grad else None for t in static_inputs]

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> tuple:
            for static, given in zip(static_inputs, inputs):
                if static is not given:
                    static.copy_(given)
            forward_graph.replay()
            return tuple(o.detach() for o in flat_outputs)

        @staticmethod
        def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
            with torch.no_grad():
                for static, given in zip(static_grad_outputs, grad_outputs):
                    if static is not None:
                        static.copy_(given) if given is not None else static.zero_()
            backward_graph.replay()
            return tuple(g.detach() if g is not None else None for g in static_grad_inputs)

    def graphed(*user_args: torch.Tensor) -> Any:
        flat = Graphed.apply(*user_args, *params)
        return pytree.tree_unflatten(list(flat), spec)

    if module is None:
        return graphed
    training = module.training
    original = module.forward

    def forward(*user_args: Any, **kwargs: Any) -> Any:
        if module.training == training and not kwargs:
            return graphed(*user_args)
        return original(*user_args, **kwargs)

    module.forward = forward
    return module
