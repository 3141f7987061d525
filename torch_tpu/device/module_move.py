"""``model.to("tpu")`` keeps the same Parameter objects, as it does for CUDA.

``Module._apply`` updates a parameter in place (``param.data = new``) only when PyTorch's
shallow-copy check admits the pair, and that check admits only the built-in dense backends. For a
move between CPU and tpu it would make new Parameters instead, untying shared weights and
orphaning optimizers built before the move. For exactly those moves, the parameter is swapped
with its converted value (``torch.utils.swap_tensors``, which ``_apply`` already uses for tensor
subclasses); every other conversion behaves as before.

A parameter that a live autograd graph still holds (a CPU forward whose backward has not run: the
graph saved the weight) has more C++ references than ``swap_tensors`` accepts, so ``_apply``
raised "Couldn't swap Conv2d.weight" where a move to CUDA (``param.data = new``) just works. For
such a move the two Parameters' contents are exchanged all the same: the graph keeps the CPU
weight it saved, and its gradient node is poisoned, so a backward through that old graph raises
(naming why) instead of accumulating into a tensor the module no longer holds.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.modules.module as module_module
from torch.nn.parameter import UninitializedTensorMixin

_cross_device: set[int] = set()
_installed = False


def _stale_graph_backward(grad_outputs: Any) -> None:
    raise RuntimeError("tpu: this parameter was moved between CPU and tpu (model.to) while an autograd graph built "
                       "before the move still held it, and backward ran through that old graph; run backward before "
                       "moving the module, or run the forward again after the move")


def _swap_held(t1: torch.Tensor, t2: torch.Tensor) -> None:
    """Exchanges two Parameters of one class whose first a live graph also references (see the
    module docstring): their Python attributes and the C++ tensors behind them."""
    if t1.requires_grad and t1.is_leaf:
        torch.autograd.graph.get_gradient_edge(t1).node.register_prehook(_stale_graph_backward)
    t1.__dict__, t2.__dict__ = t2.__dict__, t1.__dict__
    torch._C._swap_tensor_impl(t1, t2)


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    compatible = torch._has_compatible_shallow_copy_type
    is_wrapper_subclass = module_module.is_traceable_wrapper_subclass
    swap_tensors = torch.utils.swap_tensors
    held: set[int] = set()  # the converted values whose swap is for a move between CPU and tpu

    def has_compatible_shallow_copy_type(input: torch.Tensor, from_: torch.Tensor) -> bool:
        # the signature matches torch's, which Dynamo's polyfill checks
        if (input.device.type == "tpu") != (from_.device.type == "tpu"):
            _cross_device.add(id(from_))  # _apply asks next whether to swap this converted value
            return False
        return compatible(input, from_)

    def swap_instead(t: Any) -> bool:
        if id(t) in _cross_device:
            _cross_device.discard(id(t))
            held.add(id(t))
            return True
        return is_wrapper_subclass(t)

    def swap(t1: Any, t2: Any) -> None:
        moving = bool(held)  # _apply asked swap_instead about this move just before
        held.clear()
        if moving and isinstance(t1, UninitializedTensorMixin):
            # a lazy module's parameter stays uninitialised (swap_tensors would swap its class
            # away too, to a plain Parameter of shape [0]): only its empty data moves, so that
            # the first forward materialises it on the new device, as `param.data =` does for CUDA
            torch._C._swap_tensor_impl(t1, t2)
            return
        # _apply wraps the converted value in a new Parameter before swapping; more references
        # than a Python object and its gradient node: a live graph holds t1
        if (moving and type(t1) is type(t2) and t1._use_count() > 2 and not weakref.getweakrefs(t1)
                and not weakref.getweakrefs(t2) and t2._use_count() == 1):
            _swap_held(t1, t2)
            return
        swap_tensors(t1, t2)

    torch._has_compatible_shallow_copy_type = has_compatible_shallow_copy_type
    module_module.is_traceable_wrapper_subclass = swap_instead
    torch.utils.swap_tensors = swap
