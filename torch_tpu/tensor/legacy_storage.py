"""The legacy typed storage classes of the tpu device: ``torch.tpu.FloatStorage`` and its kin.

Why: ``torch.cuda`` has one class per dtype (``torch.cuda.FloatStorage`` ...), and torch finds a
tensor's ``storage_type()`` by looking the class up on the device's module
(``TypedStorage._get_legacy_storage_class``, which asks ``torch.<PrivateUse1 name>`` too).
Without them a tpu tensor's ``storage_type()`` was None, ``isinstance(t.storage(),
torch.tpu.FloatStorage)`` could not be asked, and checkpoint or legacy code that names the class
failed with an AttributeError.

How: each class is torch's own ``_LegacyStorage`` with its dtype, and says it lives in
``torch.tpu``: torch reads the device from the last part of a legacy class's module, so calling
``torch.tpu.FloatStorage(n)`` (or with a sequence) makes a tpu storage, and ``isinstance`` checks
device and dtype, as for CUDA's classes. Nothing here is on an op's path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import classproperty
from torch.storage import _LegacyStorage, _warn_typed_storage_removal

# The dtypes CUDA has legacy classes for (torch's quantized ones have none on a device).
_DTYPES = (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
    torch.float64, torch.bool, torch.bfloat16, torch.complex64, torch.complex128,
)


class _TPULegacyStorage(_LegacyStorage):
    """What a tpu storage cannot be made from: host memory it would have to share."""

    @classmethod
    def from_buffer(cls, *args: Any, **kwargs: Any) -> Any:
        _warn_typed_storage_removal()
        raise RuntimeError("from_buffer: Not available for tpu storage")

    @classmethod
    def _new_with_weak_ptr(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("_new_with_weak_ptr: Not available for tpu storage")

    @classmethod
    def _new_shared_filename(cls, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("_new_shared_filename: Not available for tpu storage")


def _storage_class(name: str, dtype: torch.dtype) -> type:
    def public_dtype(cls: type) -> torch.dtype:
        _warn_typed_storage_removal()
        return dtype

    return type(name, (_TPULegacyStorage,), {
        "__module__": "torch.tpu",
        "__qualname__": name,
        "dtype": classproperty(public_dtype),
        "_dtype": classproperty(lambda cls: dtype),
    })


def storage_classes() -> dict[str, type]:
    """One class per dtype, named as torch names CPU's and CUDA's (``FloatStorage`` ...)."""
    names = torch.storage._dtype_to_storage_type_map()
    classes = {names[dt]: _storage_class(names[dt], dt) for dt in _DTYPES}
    for cls in classes.values():
        torch._storage_classes.add(cls)
    return classes
