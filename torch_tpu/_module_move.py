"""``model.to("tpu")`` keeps the same Parameter objects, as it does for CUDA.

``Module._apply`` updates a parameter in place (``param.data = new``) only when PyTorch's
shallow-copy check admits the pair, and that check admits only the built-in dense backends. For a
move between CPU and tpu it would make new Parameters instead, untying shared weights and
orphaning optimizers built before the move. For exactly those moves, the parameter is swapped
with its converted value (``torch.utils.swap_tensors``, which ``_apply`` already uses for tensor
subclasses); every other conversion behaves as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.modules.module as module_module

_cross_device: set[int] = set()
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    compatible = torch._has_compatible_shallow_copy_type
    is_wrapper_subclass = module_module.is_traceable_wrapper_subclass

    def has_compatible_shallow_copy_type(input: torch.Tensor, from_: torch.Tensor) -> bool:
        # the signature matches torch's, which Dynamo's polyfill checks
        if (input.device.type == "tpu") != (from_.device.type == "tpu"):
            _cross_device.add(id(from_))  # _apply asks next whether to swap this converted value
            return False
        return compatible(input, from_)

    def swap_instead(t: Any) -> bool:
        if id(t) in _cross_device:
            _cross_device.discard(id(t))
            return True
        return is_wrapper_subclass(t)

    torch._has_compatible_shallow_copy_type = has_compatible_shallow_copy_type
    module_module.is_traceable_wrapper_subclass = swap_instead
