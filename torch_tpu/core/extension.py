"""torch_tpu's optional C++ extension: what PyTorch's Python backend hooks cannot express.

Today that is five things. ``torch.Generator(device="tpu")``: torch makes a PrivateUse1 generator
only through a factory registered from C++ (``csrc/generator.cpp``). Nested tensors: torch's
device-generic nested-tensor kernels registered for ``NestedTensorPrivateUse1``, which Python cannot
write since it cannot reach a ``NestedTensorImpl``'s buffer (``csrc/nested.cpp``, ``nested``).
``torch.accelerator.Graph`` (torch >= 2.13): the graph implementation torch asks a registry for,
forwarding to ``torch.tpu``'s graphs (``csrc/graph.cpp``). The device's host allocator, which
``torch.accelerator.empty_host_cache`` asks for (``csrc/host_allocator.cpp``). And the device guard
(the device index and stream torch's C++ sets around kernels and backward nodes): torch's Python
registration answers each guard operation by calling Python, over a thousand times per small
training step; ``csrc/device_guard.cpp`` gives the same answers in C++.
The set-up command builds the extension against the installed torch (:func:`main`, which ``make``
runs), into a folder per torch and Python version, since one source tree may serve several virtual environments.

Without it everything else works: a tpu generator then cannot be made (torch raises its own
NotImplementedError), and a CPU ``torch.Generator`` seeds tpu random ops instead (``rng``); an op on
a nested tpu tensor raises NotImplementedError saying the extension is missing; ``torch.accelerator.Graph``
raises torch's "not supported on device type: tpu" (``torch.tpu.graph`` works), on torch 2.13
``torch.accelerator.empty_host_cache()`` crashes once a tpu tensor exists (torch's null pointer),
and device guards call Python (slower; the same answers).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from pathlib import Path
from types import ModuleType

import torch

_NAME = "torch_tpu_C"
_PACKAGE = Path(__file__).resolve().parent.parent  # torch_tpu/: the sources in csrc/, the builds in _ext/
_SOURCES = [_PACKAGE / "csrc" / name
            for name in ("generator.cpp", "graph.cpp", "host_allocator.cpp", "nested.cpp", "device_guard.cpp")]
_loaded: list[ModuleType | None] = []
_why: list[str] = []


def build_dir() -> Path:
    """Where the extension for this torch and Python lives: built against one torch, it loads only there."""
    tag = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}"
    return _PACKAGE / "_ext" / tag


def build(verbose: bool = False) -> Path:
    """Compiles the extension with ``torch.utils.cpp_extension`` (a C++ compiler is needed)."""
    from torch.utils.cpp_extension import load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    load(name=_NAME, sources=[str(s) for s in _SOURCES], build_directory=str(where), extra_cflags=["-O2"],
         verbose=verbose)
    return where


def _library(where: Path) -> Path | None:
    found = sorted(where.glob(f"{_NAME}*.so")) + sorted(where.glob(f"{_NAME}*.pyd"))
    return found[0] if found else None


def load() -> ModuleType | None:
    """The extension, loaded once and its generator registered; None where it was not built (or
    does not load with this torch): :func:`why_not` says why."""
    if _loaded:
        return _loaded[0]
    module = None
    path = _library(build_dir())
    if path is None:
        _why.append(f"not built for this torch ({build_dir()}); torch_tpu.core.extension.main() builds it")
    else:
        try:
            spec = importlib.util.spec_from_file_location(_NAME, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.register_generator()
            # an older build lacks it; TORCH_TPU_PYTHON_DEVICE_GUARD=1 keeps torch's Python guard
            if hasattr(module, "register_device_guard") and os.environ.get("TORCH_TPU_PYTHON_DEVICE_GUARD") != "1":
                module.register_device_guard()
        except Exception as e:  # noqa: BLE001 - any failure leaves the package as it is without it
            module = None
            _why.append(f"{path} did not load: {type(e).__name__}: {e}")
    # torch's own note, at every tpu generator made through the registration above: the extension
    # takes it out of a Python caller's warning buffer (csrc/generator.cpp); this filter is for where
    # it cannot (another ABI)
    warnings.filterwarnings("ignore", message=r"GetGeneratorForPrivateuse1\(\) is deprecated",
                            category=DeprecationWarning)
    _loaded.append(module)
    return module


def available() -> bool:
    """Whether ``torch.Generator(device="tpu")`` can be made in this process."""
    return load() is not None


def why_not() -> str:
    return _why[-1] if _why else ""


def main() -> int:
    """The set-up step: builds the extension; a failure is reported, not fatal (see the module)."""
    try:
        where = build()
    except Exception as e:  # noqa: BLE001 - no compiler, or a torch whose headers lack the registration
        print(f"torch_tpu: the C++ extension was not built ({type(e).__name__}: {str(e)[:300]}); "
              "torch.Generator(device='tpu') and nested tpu tensors will be unavailable, everything else works",
              file=sys.stderr)
        return 0
    print(f"torch_tpu: C++ extension built in {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
