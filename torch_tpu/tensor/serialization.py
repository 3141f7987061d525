"""How a tpu tensor reaches the host: repr, pickling, ``torch.save``/``torch.load``.

PyTorch's Python code special-cases devices by name in these places (``xla``, ``lazy``...), and
otherwise assumes a storage whose bytes it can read. A tpu storage holds a jax array, not bytes,
so the tpu device takes the lazy devices' branch: one copy to the host, then the CPU code path.
``copy.deepcopy`` is torch's own: it copies storages (``storage_api``), so views and storages
deep-copied together still share, as on CPU.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import numpy as np
import torch

from torch_tpu.tensor.transfer import storage_from_bytes

_installed = False


def _is_tpu(t: torch.Tensor) -> bool:
    return type(t) is not None and isinstance(t, torch.Tensor) and t.device.type == "tpu"


def _holds_data(t: torch.Tensor) -> bool:
    """Whether ``t`` has device data to print: not a fake tensor of a trace (AOTAutograd logs its
    graphs' example inputs when debug logging is on), whose repr is torch's own."""
    try:
        return hasattr(t.untyped_storage(), "_jx")
    except Exception:  # wrapper subclasses without a storage
        return False


def _install_repr() -> None:
    from torch import _tensor_str

    original = _tensor_str._str

    def _str(self: torch.Tensor, *, tensor_contents: str | None = None) -> str:
        if (tensor_contents is None and _is_tpu(self) and self.numel() > 0 and self.layout == torch.strided
                and _holds_data(self)):
            host = self.detach().to("cpu")  # one transfer; formatting then runs on CPU
            with torch.no_grad():
                tensor_contents = _tensor_str._tensor_str(host, len("tensor("))
        return original(self, tensor_contents=tensor_contents)

    _tensor_str._str = _str


def _install_pickling() -> None:
    original = torch.Tensor._reduce_ex_internal

    shallow_copy = copy.copy.__code__

    def _reduce_ex_internal(self: torch.Tensor, proto: int) -> Any:
        # copy.copy(t) calls Tensor.__reduce_ex__ itself and rebuilds from the same storage (a
        # shallow copy shares the data, as CPU's does); a pickler goes through the CPU
        if _is_tpu(self) and sys._getframe(2).f_code is not shallow_copy:
            if torch.serialization._serialization_tls.skip_data:
                raise RuntimeError("Cannot serialize tpu tensors under the skip_data context manager")
            return (
                torch._utils._rebuild_device_tensor_from_cpu_tensor,
                (self.detach().to("cpu"), self.dtype, str(self.device), self.requires_grad),
            )
        return original(self, proto)

    torch.Tensor._reduce_ex_internal = _reduce_ex_internal

    def tag(obj: Any) -> str | None:
        return None  # tpu storages are never pickled: their tensors go through the CPU above

    def restore(obj: Any, location: str) -> Any:
        """``map_location="tpu"`` for data saved from another device: bytes to a tpu storage."""
        if not location.startswith("tpu"):
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            obj = obj._untyped_storage
        if obj.device.type != "cpu":
            obj = obj.cpu()
        data = np.frombuffer(bytes(obj), dtype=np.uint8) if obj.nbytes() else np.zeros(0, np.uint8)
        return storage_from_bytes(data)

    torch.serialization.register_package(5, tag, restore)


def _install_map() -> None:
    """``Tensor.map_``/``map2_`` call a Python function per element, which torch runs on CPU
    tensors only: a tpu tensor is mapped on a host copy and written back (one round trip)."""
    cpu_map, cpu_map2 = torch.Tensor.map_, torch.Tensor.map2_

    def map_(self: torch.Tensor, other: torch.Tensor, callable: Any) -> torch.Tensor:
        if not (_is_tpu(self) or _is_tpu(other)):
            return cpu_map(self, other, callable)
        host = self.detach().cpu()
        cpu_map(host, other.detach().cpu(), callable)
        with torch.no_grad():
            self.copy_(host)
        return self

    def map2_(self: torch.Tensor, x: torch.Tensor, y: torch.Tensor, callable: Any) -> torch.Tensor:
        if not (_is_tpu(self) or _is_tpu(x) or _is_tpu(y)):
            return cpu_map2(self, x, y, callable)
        host = self.detach().cpu()
        cpu_map2(host, x.detach().cpu(), y.detach().cpu(), callable)
        with torch.no_grad():
            self.copy_(host)
        return self

    map_.__doc__, map2_.__doc__ = cpu_map.__doc__, cpu_map2.__doc__
    torch.Tensor.map_, torch.Tensor.map2_ = map_, map2_


def install() -> None:
    global _installed
    if not _installed:
        _install_repr()
        _install_pickling()
        _install_map()
        _installed = True
