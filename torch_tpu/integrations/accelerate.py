"""Hugging Face accelerate (and ``transformers.Trainer``, which runs on it) picks tpu.

accelerate 1.15 chooses a single-process device in ``PartialState.default_device`` from a fixed
list (MPS, MLU, ..., CUDA, XPU, Neuron, else CPU) that no out-of-tree device can join; a
PrivateUse1 device is reported as cpu, so ``Accelerator.prepare`` moves a model to CPU while
Trainer (which asks ``torch.accelerator``) sends batches to tpu. Its one public way in,
``ACCELERATE_TORCH_DEVICE``, is an environment variable that also overrides ``cpu=True``.

So, when accelerate's state module loads, ``default_device`` is wrapped: where accelerate found no
device of its own (cpu) and tpu is the current accelerator, it answers tpu. ``cpu=True``
(``TrainingArguments(use_cpu=True)``), ``ACCELERATE_TORCH_DEVICE``, torch_xla's own path and
every device accelerate knows keep working as before.
"""

from __future__ import annotations

import types

import torch


def _tpu_is_current() -> bool:
    acc = torch.accelerator.current_accelerator(check_available=True)
    return acc is not None and acc.type == "tpu"


def install(state: types.ModuleType) -> None:
    """Wraps ``accelerate.state.PartialState.default_device`` (idempotent)."""
    cls = state.PartialState
    original = cls.__dict__["default_device"]
    if getattr(original.fget, "_torch_tpu", False):
        return

    def default_device(self: object) -> torch.device:
        device = original.fget(self)
        if device.type == "cpu" and _tpu_is_current():
            return torch.device("tpu")
        return device

    default_device._torch_tpu = True  # type: ignore[attr-defined]
    default_device.__doc__ = original.__doc__
    cls.default_device = property(default_device)
