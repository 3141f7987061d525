"""The Python storage API (``UntypedStorage``/``TypedStorage``) for tpu storages, as on CPU.

Why: a tpu tensor's data is a jax array on its storage object (``storage``); the C++
``StorageImpl`` made by ``create_empty_tensor`` carries no bytes and, for speed, is not even told
its size when an op makes a result. PyTorch's storage methods read that C++ size, so a tpu
storage said ``nbytes() == 0``, ``t.storage()[i]`` raised IndexError, and constructing one
(``UntypedStorage(n, device="tpu")``, hence ``clone()`` and ``deepcopy``) crashed the process in
C++ (there is no allocator to call).

How: only when user code touches a storage through this API (never on an op's path), the C++
size is first brought up to the array's size, through the Meta ``set_`` kernel that grows a
storage's byte count without allocating (as ``resize_storage`` does). Reads and writes of the
bytes then take torch's own device path: a ``uint8`` tensor ``set_`` onto the storage, which tpu
reads and writes by reinterpreting the array's bits (``storage._alias_geometry``). A new storage
(``UntypedStorage(n | bytes, device="tpu")``) is the storage of a fresh ``uint8`` tpu tensor.
``Tensor.data_ptr`` and ``UntypedStorage.data_ptr`` first give a tpu storage its unique address
(``storage.give_address``), which code written for CUDA tells storages apart by.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from torch_tpu.tensor.storage import give_address, has_address, logical_nbytes, new_tensor, set_geometry
from torch_tpu.tensor.transfer import host_to_device

_installed = False
_cpp_nbytes = torch._C.StorageBase.nbytes
_cpp_storage_data_ptr = torch._C.StorageBase.data_ptr
_cpp_tensor_data_ptr = torch._C.TensorBase.data_ptr
_cpp_new = torch._C.StorageBase.__new__
_cpp_copy = torch._C.StorageBase.copy_
_cpp_fill = torch._C.StorageBase.fill_
_cpp_getitem = torch.UntypedStorage.__getitem__
_synced_clone: Any = None


def sync_nbytes(st: Any) -> Any:
    """Grows the C++ byte count of tpu storage ``st`` to its array's size (never shrinks it)."""
    need = logical_nbytes(st)
    if need > _cpp_nbytes(st):
        set_geometry(torch._C._acc.create_empty_tensor((0,), torch.uint8), st, 0, [need], [1])
    return st


def _storage_data_ptr(self: Any) -> int:
    """``UntypedStorage.data_ptr``: a tpu storage's unique address (``storage.give_address``)."""
    if self.device.type == "tpu" and not give_address(self) and not has_address(self):
        return 0  # torch < 2.13: no address to give (see give_address); an empty storage's is 0
    return _cpp_storage_data_ptr(self)


def _tensor_data_ptr(self: torch.Tensor) -> int:
    """``Tensor.data_ptr``: for a tpu tensor, its storage's unique address plus its offset in bytes,
    as on CPU. The C++ call comes first, so tensors without data (fake, functional) raise as ever."""
    p = _cpp_tensor_data_ptr(self)
    if self.is_cpu or self.device.type != "tpu" or not give_address(self.untyped_storage()):
        return p
    return _cpp_tensor_data_ptr(self)


def _is_tpu_storage(st: Any) -> bool:
    return st.device.type == "tpu"


def _wrap_synced(name: str) -> None:
    """Replaces ``UntypedStorage.<name>`` by one that first syncs a tpu storage's size."""
    original = getattr(torch.UntypedStorage, name)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.device.type == "tpu":
            sync_nbytes(self)
        return original(self, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = original.__doc__
    setattr(torch.UntypedStorage, name, method)


def new_storage(nbytes_or_data: Any = 0) -> torch.UntypedStorage:
    """A tpu ``UntypedStorage`` of ``n`` bytes (zeros; CPU's are uninitialised) or of these bytes."""
    if isinstance(nbytes_or_data, int):
        if nbytes_or_data < 0:
            raise RuntimeError(f"Storage size must be non-negative, but got {nbytes_or_data}")
        t = new_tensor((nbytes_or_data,), torch.uint8)
    else:
        data = np.asarray(list(nbytes_or_data), dtype=np.int64)
        if data.size and (data.min() < 0 or data.max() > 255):
            raise RuntimeError("Storage: the bytes of a new storage must be in [0, 255]")
        t = new_tensor((int(data.size),), torch.uint8, host_to_device(torch.from_numpy(data.astype(np.uint8))))
    st = t.untyped_storage()
    st._t = t  # the storage's Python attributes (its array) live while the storage does
    return sync_nbytes(st)


def _bytes_of(st: Any) -> torch.Tensor:
    """A flat uint8 tensor over storage ``st``'s bytes (a view: writes reach the storage)."""
    if st.device.type == "tpu":
        sync_nbytes(st)
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


def _copy_(self: Any, src: Any, non_blocking: bool = False) -> Any:
    """``UntypedStorage.copy_`` when either side is a tpu storage: torch's C++ copy refuses a
    storage whose C++ data pointer is null, which every tpu storage's is."""
    if self.device.type != "tpu" and src.device.type != "tpu":
        return _cpp_copy(self, src, non_blocking)
    n, m = self.nbytes(), src.nbytes()
    if n != m:
        raise RuntimeError(f"size does not match, self was {n} bytes but src was {m} bytes")
    if n:
        _bytes_of(self).copy_(_bytes_of(src), non_blocking)
    return self


def _fill_(self: Any, value: Any) -> Any:
    if self.device.type != "tpu":
        return _cpp_fill(self, value)
    _bytes_of(self).fill_(value)
    return self


def _clone(self: Any) -> Any:
    """``UntypedStorage.clone``: a tpu storage's copy keeps its element type (a typed tensor over
    it reads at full speed, with no byte reinterpretation); its array is copied, never shared (a
    fused program may donate the original's buffer)."""
    if self.device.type != "tpu" or getattr(self, "_dtype", None) is None or getattr(self, "_raw", None) is not None:
        return _synced_clone(self)
    whole = torch.empty(0, dtype=self._dtype, device=self.device).set_(self)
    t = whole.clone()
    st = t.untyped_storage()
    st._t = t
    return sync_nbytes(st)


def _getitem(self: Any, idx: Any) -> Any:
    """``storage[i]`` reads a byte; ``storage[a:b]`` of a tpu storage is a new storage holding a
    copy of those bytes (CPU's shares them: a tpu storage has no pointer to offset)."""
    if self.device.type != "tpu":
        return _cpp_getitem(self, idx)
    sync_nbytes(self)
    if not isinstance(idx, slice):
        return _cpp_getitem(self, idx)
    start, stop, step = idx.indices(self.nbytes())
    if step != 1:
        raise RuntimeError(f"Trying to slice with a step of {step}, but only a step of 1 is supported")
    t = _bytes_of(self)[start:max(start, stop)].clone()
    st = t.untyped_storage()
    st._t = t
    return sync_nbytes(st)


def _untyped_new(cls: type, *args: Any, device: Any = None, **kwargs: Any) -> Any:
    if device is not None and torch.device(device).type == "tpu" and not kwargs and len(args) <= 1:
        return new_storage(*args)
    if device is None:
        return _cpp_new(cls, *args, **kwargs)
    return _cpp_new(cls, *args, device=device, **kwargs)


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    global _synced_clone
    for name in ("nbytes", "size", "__len__", "__setitem__", "tolist", "clone", "cpu",
                 "_write_file", "__iter__"):
        _wrap_synced(name)
    _synced_clone = torch.UntypedStorage.clone
    torch.UntypedStorage.clone = _clone
    torch.UntypedStorage.copy_ = _copy_
    torch.UntypedStorage.fill_ = _fill_
    torch.UntypedStorage.__getitem__ = _getitem
    torch.UntypedStorage.__new__ = _untyped_new
    torch.UntypedStorage.data_ptr = _storage_data_ptr
    torch.Tensor.data_ptr = _tensor_data_ptr
    # storage.tpu() and storage.is_tpu, as storage.cuda() and is_cuda: torch's own methods for a
    # PrivateUse1 backend, over the storage constructor and copy_ above
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=False, for_module=False, for_packed_sequence=False, for_storage=True)
