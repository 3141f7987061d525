"""The ``tpu`` device, registered while ``import torch`` runs (PyTorch's out-of-tree backend autoload).

PyTorch calls every ``torch.backends`` entry point near the end of ``import torch`` (RFC
pytorch/pytorch#122468; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it off). Ours is :func:`autoload`.
It must be light and harmless in every process of an environment that has torch_tpu installed,
CPU-only scripts and test suites included, so it imports neither jax nor the ``torch_tpu``
package. It does only what has to exist before first use:

* PrivateUse1 renamed ``tpu``, so ``torch.device("tpu")`` parses;
* the device guard and hooks, so the autograd engine gives tpu a queue at the process's first
  backward (a device registered after that backward has none: the old import-order trap);
* ``torch.tpu``, a small module whose cheap functions (``is_available``) answer without JAX and
  whose other attributes come from ``torch_tpu.device.tpu_module`` once the package is imported;
* a dispatcher fallback for the tpu key: the first op on a tpu tensor imports ``torch_tpu`` (JAX
  starts then), removes this fallback and re-runs the op on the real kernels;
* the ``tpu`` c10d backend name and ``pin_memory`` for tpu (both import nothing heavy);
* post-import hooks: when accelerate or Lightning finish importing (if they ever do), the
  integration in ``torch_tpu.integrations`` installs itself, so neither is imported here.

The module lives outside the ``torch_tpu`` package because importing any submodule of a package
runs the package's ``__init__``, which imports jax and registers every kernel.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.abc
import importlib.util
import os
import sys
import threading
import types
from typing import Any

import torch

_registered = False
_autoloaded = False  # registered by import torch's autoload, so before any backward of the process
_initialized = False  # torch_tpu (the package) finished importing
_init_lock = threading.RLock()
_fallback_lib: list[torch.library.Library] = []
_pinning_lib: list[torch.library.Library] = []

# torch.tpu attributes answered here, without importing torch_tpu (so without JAX).
_LIGHT = ("is_available", "is_initialized", "_is_in_bad_fork", "current_device", "get_amp_supported_dtype",
          "is_bf16_supported", "take_lost_exception")


def autoload() -> None:
    """The ``torch.backends`` entry point: registers the device; JAX starts at first use."""
    global _autoloaded
    if not _registered:
        _autoloaded = True
    register()


def autoloaded() -> bool:
    """Whether the device was registered during ``import torch`` (then the autograd engine has a tpu queue)."""
    return _autoloaded


def initialized() -> bool:
    """Whether ``torch_tpu`` (its kernels, JAX) is loaded; the light hook alone leaves it False."""
    return _initialized


def remove_first_use_fallback() -> None:
    """Called by ``torch_tpu`` just before it registers its own fallback for the tpu key."""
    for lib in _fallback_lib:
        lib._destroy()
    _fallback_lib.clear()


def mark_initialized() -> None:
    """Called by ``torch_tpu`` at the end of its import."""
    global _initialized
    remove_first_use_fallback()
    _initialized = True


def ensure_initialized() -> None:
    """Imports ``torch_tpu`` (JAX, every kernel) unless it is loaded."""
    if _initialized:
        return
    with _init_lock:
        if not _initialized:
            import torch_tpu  # noqa: F401  (forced: this hook runs inside ``import torch``; JAX loads at first use)


# ------------------------------------------------------------------ cheap answers (no JAX)
def _requested_platform() -> str:
    """The XLA platform the user asked for, "" for JAX's default order (TPU, GPU, then CPU)."""
    p = os.environ.get("TORCH_TPU_PLATFORM", "").strip().lower()
    if p:
        return p
    jp = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    return jp.split(",")[0] if jp else ""


def _module_present(*names: str) -> bool:
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _tpu_device_present() -> bool:
    """A TPU chip's device file (as torch_tpu.core.devices.quiet_libtpu_without_a_tpu looks for)."""
    import glob

    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _platform_present(platform: str) -> bool:
    """Whether the PJRT plugin for ``platform`` is installed, found without loading it."""
    if platform in ("", "cpu"):
        return True  # XLA:CPU is built into jaxlib: JAX falls back to it when no accelerator is found
    if platform == "tpu":  # libtpu alone is no TPU: it is also installed to compile for one (runtime.target)
        return _module_present("libtpu", "jax_plugins.libtpu") and _tpu_device_present()
    if platform in ("gpu", "cuda"):
        return _module_present("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
                               "jax_plugins.xla_cuda12")
    if platform == "rocm":
        return _module_present("jax_rocm7_plugin", "jax_rocm60_plugin", "jax_plugins.xla_rocm7",
                               "jax_plugins.xla_rocm60")
    return False


def _jax_backends_started() -> bool:
    xb = sys.modules.get("jax._src.xla_bridge")
    return xb is not None and bool(getattr(xb, "_backends", None))


def is_available() -> bool:
    """Whether a tpu device can be used, answered without starting JAX.

    ``torch.accelerator.current_accelerator(check_available=True)`` calls this, and so does
    ``init_process_group()`` on torch >= 2.14, before the distributed path starts JAX's
    multi-controller runtime; creating a PJRT client here would make that impossible. So until JAX
    has started, the answer comes from the installed plugins; afterwards, from the devices."""
    if _jax_backends_started():
        device = sys.modules.get("torch_tpu.device.tpu_module")
        return device.device_count() > 0 if device is not None else True
    return _platform_present(_requested_platform())


def is_initialized() -> bool:
    return _initialized


def _is_in_bad_fork() -> bool:
    return False


def current_device() -> int:
    return 0  # tensors live on tpu:0 (see torch_tpu.device.tpu_module)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]


def is_bf16_supported() -> bool:
    return True


class _DeviceModule(types.ModuleType):
    """``torch.tpu``: the cheap functions above, then ``torch_tpu.device.tpu_module`` for everything else.

    An attribute is looked up in ``torch_tpu.device.tpu_module`` once and kept here, so later calls cost
    what a plain module attribute costs."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        ensure_initialized()
        device = sys.modules["torch_tpu.device.tpu_module"]
        try:
            value = getattr(device, name)
        except AttributeError:
            raise AttributeError(f"module 'torch.tpu' has no attribute {name!r}") from None
        setattr(self, name, value)
        return value

    def __dir__(self) -> list[str]:
        names = set(super().__dir__())
        if "torch_tpu.device.tpu_module" in sys.modules:
            names.update(n for n in vars(sys.modules["torch_tpu.device.tpu_module"]) if not n.startswith("_"))
        return sorted(names)


def _make_device_module() -> _DeviceModule:
    mod = _DeviceModule("torch.tpu", "The tpu device (torch_tpu), shaped like torch.cuda.")
    for name in _LIGHT:
        setattr(mod, name, globals()[name])
    return mod


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id: int) -> bool:
        return True

    def is_built(self) -> bool:
        return True


_PRIVATEUSE1 = torch._C._autograd.DeviceType.PrivateUse1
# Any C function called through ctypes.pythonapi: after the call ctypes raises the pending Python
# error, if one is set, which is how ``_Guard.type_`` takes it over.
_PROBE = ctypes.pythonapi.Py_GetRecursionLimit
_lost: list[BaseException] = []


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):  # noqa: ANN201
        """PyTorch's Python device guard asks this for the device type, also from ``noexcept``
        destructors (a stream guard in the autograd engine). When a ``__torch_dispatch__`` mode
        (fake tensors: AOTAutograd tracing a backward) raises inside a backward node, torch unwinds
        with the Python error still pending; calling Python then fails, and the failure inside a
        ``noexcept`` function is ``std::terminate``: the process aborted. The pending error is taken
        here instead and kept (:func:`take_lost_exception`); the engine then raises a
        ``SystemError`` that the caller can replace with it."""
        try:
            _PROBE()
        except BaseException as e:  # the pending error, now raised and caught: nothing pending
            _lost.append(e)
            del _lost[:-4]
        return _PRIVATEUSE1


def take_lost_exception() -> BaseException | None:
    """The last exception :meth:`_Guard.type_` took over from an unwinding backward, or None."""
    e = _lost[-1] if _lost else None
    _lost.clear()
    return e


# ------------------------------------------------------------------ first use
_in_first_use = threading.local()


def _first_use(op: torch._ops.OpOverload, keyset: Any, *args: Any, **kwargs: Any) -> Any:
    """The dispatcher fallback for the tpu key until torch_tpu is loaded: loads it, re-runs the op."""
    if getattr(_in_first_use, "active", False):
        raise RuntimeError(f"tpu: {op} ran on a tpu tensor while torch_tpu was still being imported")
    _in_first_use.active = True
    try:
        ensure_initialized()
    finally:
        _in_first_use.active = False
    return op.redispatch(keyset, *args, **kwargs)


def _register_pinning() -> None:
    """``Tensor.pin_memory()`` and ``DataLoader(pin_memory=True)`` for tpu, the current accelerator.

    Pinned (page-locked) host memory lets CUDA copy a batch asynchronously. PyTorch asks the
    backend's C++ hooks for a pinned allocator, which a Python backend cannot provide, so without
    this every ``pin_memory=True`` loader (a line many CUDA scripts carry) would raise, in every
    process where autoload made tpu the current accelerator. XLA copies host buffers into its own
    memory when they move to the device, so pinning for tpu returns an ordinary contiguous copy.
    Pinning for another device type goes on to PyTorch's own kernel."""
    lib = torch.library.Library("aten", "IMPL")
    composite = torch._C.DispatchKey.CompositeExplicitAutograd
    pin = torch.ops.aten._pin_memory.default

    def pin_memory(self: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        target = torch.device(device) if device is not None else torch.accelerator.current_accelerator()
        if target is not None and target.type == "tpu":
            return self.clone(memory_format=torch.contiguous_format)
        return pin._op_dk(composite, self, device)

    lib.impl("_pin_memory", pin_memory, "CPU")
    _pinning_lib.append(lib)


def _c10d_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
    """Builds the ``tpu`` c10d process group; its module is imported on first use."""
    ensure_initialized()
    from torch_tpu.distributed.c10d import TPUProcessGroup  # forced: c10d asks for it after import torch

    return TPUProcessGroup(store, rank, size, timeout)


# ------------------------------------------------------------------ torch.accelerator on tpu
# torch.accelerator function -> the torch.tpu function that answers it. PyTorch implements these
# in C++ through the device guard and a C++ caching allocator, neither of which a Python backend
# can supply (synchronize raises "Backend doesn't support ...", the memory functions fail an
# internal assert), so for tpu they are answered by torch.tpu.
_ACCELERATOR_ROUTES = {
    "synchronize": "synchronize",
    "empty_cache": "empty_cache",
    "memory_stats": "accelerator_memory_stats",
    "memory_allocated": "memory_allocated",
    "max_memory_allocated": "max_memory_allocated",
    "memory_reserved": "memory_reserved",
    "max_memory_reserved": "max_memory_reserved",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
    "reset_accumulated_memory_stats": "reset_accumulated_memory_stats",
    "get_memory_info": "mem_get_info",
}


def _tpu_is_the_accelerator() -> bool:
    acc = torch._C._accelerator_getAccelerator()
    return acc is not None and acc.type == "tpu"


def _route(original: Any, tpu_name: str) -> Any:
    def routed(*args: Any, **kwargs: Any) -> Any:
        if _tpu_is_the_accelerator():
            return getattr(torch.tpu, tpu_name)(*args, **kwargs)
        return original(*args, **kwargs)

    routed.__name__, routed.__qualname__, routed.__doc__ = original.__name__, original.__qualname__, original.__doc__
    routed.__wrapped__ = original  # type: ignore[attr-defined]
    routed._torch_tpu = True  # type: ignore[attr-defined]
    return routed


def _route_accelerator_api() -> None:
    modules = [m for m in (getattr(torch, "accelerator", None), sys.modules.get("torch.accelerator.memory")) if m]
    for mod in modules:
        for name, tpu_name in _ACCELERATOR_ROUTES.items():
            original = getattr(mod, name, None)
            if original is not None and not getattr(original, "_torch_tpu", False):
                setattr(mod, name, _route(original, tpu_name))


# ------------------------------------------------------------------ post-import hooks
# module -> "module:function" called with the module once it has finished executing
_POST_IMPORT = {
    "accelerate.state": "torch_tpu.integrations.accelerate:install",
    "lightning.pytorch.trainer.connectors.accelerator_connector": "torch_tpu.integrations.lightning:install",
    "pytorch_lightning.trainer.connectors.accelerator_connector": "torch_tpu.integrations.lightning:install",
    # light on purpose: every CPU torch.compile user imports inductor, and only tpu graphs need torch_tpu
    "torch._inductor.compile_fx": "_torch_tpu_autoload:route_inductor",
}


def _graph_on_tpu(gm: Any, example_inputs: Any) -> bool:
    """Whether a Dynamo graph touches tpu tensors: an input (parameters are inputs too) or a value
    made inside (``torch.ones(..., device="tpu")``)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.device.type == "tpu":
            return True
    graph = getattr(gm, "graph", None)
    for node in graph.nodes if graph is not None else ():
        v = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(v, torch.Tensor) and v.device.type == "tpu":
            return True
    return False


def route_inductor(compile_fx_module: types.ModuleType) -> None:
    """Plain ``torch.compile(model)`` (inductor) on tpu tensors compiles with the tpu backend.

    Upstream inductor registers, for a device named "tpu", a Pallas code generator whose kernels
    import another project's runtime; torch_tpu's own backend compiles the whole graph into one XLA
    program instead (see torch_tpu/integrations/inductor.py for the choice). Graphs without tpu
    tensors go to inductor untouched."""
    original = compile_fx_module.compile_fx
    if getattr(original, "_torch_tpu", False):
        return

    def compile_fx(model_: Any, example_inputs_: Any, *args: Any, **kwargs: Any) -> Any:
        if _graph_on_tpu(model_, example_inputs_):
            from torch_tpu.integrations.inductor import compile_tpu_graph  # forced: inductor loads after torch

            return compile_tpu_graph(model_, example_inputs_, *args, **kwargs)
        return original(model_, example_inputs_, *args, **kwargs)

    compile_fx._torch_tpu = True  # type: ignore[attr-defined]
    compile_fx.__doc__ = original.__doc__
    compile_fx.__wrapped__ = original  # type: ignore[attr-defined]
    compile_fx_module.compile_fx = compile_fx


def _run_hook(module: types.ModuleType) -> None:
    import warnings

    target = _POST_IMPORT[module.__name__]
    mod_name, func = target.split(":")
    try:
        getattr(importlib.import_module(mod_name), func)(module)
    except Exception as e:  # an integration must never break the user's import
        warnings.warn(f"torch_tpu: the {module.__name__.split('.')[0]} integration ({target}) failed: {e!r}",
                      RuntimeWarning, stacklevel=2)


class _HookedLoader(importlib.abc.Loader):
    """The module's own loader, then the hook; every other attribute is the original loader's."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _run_hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the few hooked names it wraps the loader the other finders give."""

    def __init__(self) -> None:
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _POST_IMPORT or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader)
        return spec


def _install_post_import_hooks() -> None:
    sys.meta_path.insert(0, _PostImportFinder())
    for name in _POST_IMPORT:  # imported before the device was registered (autoload off)
        if name in sys.modules:
            _run_hook(sys.modules[name])


def register() -> None:
    """Renames PrivateUse1 to ``tpu`` and installs ``torch.tpu``; idempotent."""
    global _registered
    if _registered:
        return
    with _init_lock:
        if _registered:
            return
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend("tpu", backend_module=_make_device_module(), hook=_Hooks(),
                                                device_guard=_Guard())
        if not _initialized:
            lib = torch.library.Library("_", "IMPL")
            lib.fallback(_first_use, "PrivateUse1", with_keyset=True)
            _fallback_lib.append(lib)
        _register_pinning()
        if torch.distributed.is_available():  # ``dist.init_process_group("tpu")``; tpu's default backend
            torch.distributed.Backend.register_backend("tpu", _c10d_group, devices=["tpu"])
        _route_accelerator_api()
        _registered = True
        _install_post_import_hooks()
