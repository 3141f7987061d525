"""torch_tpu's optional C++ extension: what PyTorch's Python backend hooks cannot express.

Today that is seven things. ``torch.Generator(device="tpu")``: torch makes a PrivateUse1 generator
only through a factory registered from C++ (``csrc/generator.cpp``). Nested tensors: torch's
device-generic nested-tensor kernels registered for ``NestedTensorPrivateUse1``, which Python cannot
write since it cannot reach a ``NestedTensorImpl``'s buffer (``csrc/nested.cpp``, ``nested``).
``torch.accelerator.Graph`` (torch >= 2.13): the graph implementation torch asks a registry for,
forwarding to ``torch.tpu``'s graphs (``csrc/graph.cpp``). The device's host allocator, which
``torch.accelerator.empty_host_cache`` asks for (``csrc/host_allocator.cpp``). And the device guard
(the device index and stream torch's C++ sets around kernels and backward nodes): torch's Python
registration answers each guard operation by calling Python, over a thousand times per small
training step; ``csrc/device_guard.cpp`` gives the same answers in C++. The sixth is speed alone: the
view kernels (``as_strided``, ``view``, ``_reshape_alias``, ``_unsafe_view``, ``unfold``), CPU's own,
so that a transpose or slice does not call into Python and back (``csrc/views.cpp``; about a third of
a small step's eager ops); their calls are counted there and folded into ``metrics()``. The seventh
too: the cache key of a foreach op's list of tpu tensors (``csrc/keys.cpp``, :func:`key_of_tensors`),
which the op path reads tensor by tensor in Python otherwise.

**When it is built.** At the first ``import torch_tpu`` that finds no build for the installed torch
(a one-line message says so while it compiles, about a minute), into a per-user cache with one
folder per torch version, Python version and source hash (:func:`build_dir`), as
``torch.utils.cpp_extension.load`` does. Not at install: an extension is tied to the exact torch it
was compiled against, and pip builds a package in an isolated environment with a torch of its own
choosing (a CUDA build of several GB), not the user's; building at first import serves every torch
the package accepts from one pure-Python wheel, editable installs and ``pip install git+...``
included. ``make``'s set-up step builds it ahead (:func:`main`), so tests never wait on it.

**Without it** (no C++ compiler, a failed build, or ``TORCH_TPU_NO_EXTENSION=1``) everything else
works, and the import says once what is lost, unless it was turned off on purpose: a tpu generator
cannot be made (torch raises its own error), and a CPU ``torch.Generator`` seeds tpu random ops
instead (``rng``); an op on a nested tpu tensor raises NotImplementedError saying the extension is
missing; ``torch.accelerator.Graph`` raises torch's "not supported on device type: tpu"
(``torch.tpu.graph`` works); on torch 2.13 ``torch.accelerator.empty_host_cache()`` crashes once a tpu
tensor exists (torch's null pointer); and device guards and views call Python (slower; the same
answers).
A failed build is remembered in its folder (``build-failed.txt``), so later imports do not retry it;
deleting the folder retries.

This module imports nothing of the package: run as a script (``python extension.py build DIR``) it is
the build itself, in a child process, so that the importing process loads only the result.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

_NAME = "torch_tpu_C"
_PACKAGE = Path(__file__).resolve().parent.parent  # torch_tpu/: the sources in csrc/
_SOURCES = [_PACKAGE / "csrc" / name
            for name in ("generator.cpp", "graph.cpp", "host_allocator.cpp", "nested.cpp", "device_guard.cpp",
                         "views.cpp", "keys.cpp")]
_CFLAGS = ["-O2"]
_FAILED = "build-failed.txt"
_OFF = "TORCH_TPU_NO_EXTENSION"
LOST = ("torch.Generator(device='tpu'), nested tpu tensors and torch.accelerator.Graph are unavailable, "
        "and tpu device guards and views call Python (slower)")
_loaded: list[ModuleType | None] = []
_views: list[str] = []  # the view overloads the extension serves (register_views)
_views_module: list[ModuleType] = []  # the extension, once its views are registered
_keys: list[Any] = []  # the extension's key_of_tensors, once set_key_types has run
_why: list[str] = []


class ExtensionWarning(UserWarning):
    """The C++ extension is not available in this process; the message says why and what is lost."""


def turned_off() -> bool:
    """``TORCH_TPU_NO_EXTENSION=1``: neither built nor loaded, as on a machine without a compiler."""
    return os.environ.get("TORCH_TPU_NO_EXTENSION", "").strip().lower() in ("1", "true", "yes")


def cache_root() -> Path:
    """The per-user folder of builds: ``TORCH_TPU_EXTENSION_DIR``, else ``~/.cache/torch_tpu/extension``.
    Not under ``TORCH_TPU_CACHE_DIR``: a process given a fresh program cache must not build the
    extension again (a minute)."""
    if os.environ.get("TORCH_TPU_EXTENSION_DIR"):
        return Path(os.environ["TORCH_TPU_EXTENSION_DIR"]).expanduser()
    return Path(os.path.expanduser("~")) / ".cache" / "torch_tpu" / "extension"


def _source_hash() -> str:
    digest = hashlib.sha256(" ".join(_CFLAGS).encode())
    for source in _SOURCES:
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:12]


def build_dir() -> Path:
    """Where the extension for this torch, this Python and these sources lives: built against one
    torch, it loads only there, and an upgraded package's new sources build anew."""
    tag = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{_source_hash()}"
    return cache_root() / tag


def _ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel's binary sits in the venv's bin,
    which is on PATH only in an activated venv."""
    try:
        import ninja  # the PyPI wheel: a dependency of the package
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def cannot_build() -> str | None:
    """Why a build cannot even start here (no compiler, no ninja, no Python headers), or None."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH; set CXX to one)"
    _ninja_on_path()
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    include = sysconfig.get_paths().get("include", "")
    if not os.path.exists(os.path.join(include, "Python.h")):
        return f"no Python headers ({include}/Python.h; install the python3-dev package)"
    return None


def build(verbose: bool = False) -> Path:
    """Compiles the extension into :func:`build_dir` with ``torch.utils.cpp_extension``, in a child
    process; raises RuntimeError with the reason (the compiler's last lines) where it cannot."""
    where = build_dir()
    reason = cannot_build()
    if reason is not None:
        raise RuntimeError(reason)
    where.mkdir(parents=True, exist_ok=True)
    (where / _FAILED).unlink(missing_ok=True)
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # the child needs torch's headers, not torch_tpu
    done = subprocess.run([sys.executable, "-P", __file__, "build", str(where)], env=env, text=True,
                          stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT)
    if done.returncode != 0 or _library(where) is None:
        tail = "\n".join((done.stdout or "").strip().splitlines()[-15:])
        (where / _FAILED).write_text(f"the build failed (exit status {done.returncode}):\n{tail}\n")
        raise RuntimeError(f"the build failed in {where} (exit status {done.returncode}); see {where / _FAILED}")
    return where


def _compile_here(where: Path) -> None:
    """The child process's work: torch's JIT builder, with its file lock against concurrent builds.

    The sources compile as one translation unit (a file in the build folder that includes each of
    them): every source includes torch's headers, whose parsing is most of a source's compile time,
    so one unit parses them once: 85 CPU seconds instead of 345 for six units (this machine,
    2026-12-07), for the user whose first import builds it and for CI, which builds it four times."""
    from torch.utils.cpp_extension import load as cpp_load

    unit = where / f"{_NAME}.cpp"
    text = "".join(f'#include "{s}"\n' for s in _SOURCES)
    if not unit.exists() or unit.read_text() != text:
        unit.write_text(text)
    cpp_load(name=_NAME, sources=[str(unit)], build_directory=str(where), extra_cflags=_CFLAGS,
             is_python_module=False, verbose=True)


def _library(where: Path) -> Path | None:
    found = sorted(where.glob(f"{_NAME}*.so")) + sorted(where.glob(f"{_NAME}*.pyd"))
    return found[0] if found else None


def _find_or_build() -> Path | None:
    """The built library, building it now where none is and a build can run; else None, with the
    reason appended to ``_why``."""
    where = build_dir()
    path = _library(where)
    if path is not None:
        return path
    failed = where / _FAILED
    if failed.exists():
        _why.append(f"an earlier build failed ({failed}; delete {where} to retry)")
        return None
    reason = cannot_build()
    if reason is not None:
        _why.append(reason)
        return None
    print(f"torch_tpu: building the C++ extension for torch {torch.__version__} in {where} "
          "(once per torch and Python version, about a minute)...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        build()
    except Exception as e:  # noqa: BLE001 - reported, and the package runs without it
        _why.append(str(e))
        return None
    print(f"torch_tpu: C++ extension built in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return _library(where)


def load() -> ModuleType | None:
    """The extension, loaded once and its generator registered, built first where it is missing;
    None where it cannot be (:func:`why_not` says why, and a warning said it once at import)."""
    if _loaded:
        return _loaded[0]
    module = None
    if turned_off():
        _why.append(f"turned off ({_OFF}=1)")
        path = None
    else:
        path = _find_or_build()
    if path is not None:
        try:
            spec = importlib.util.spec_from_file_location(_NAME, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.register_generator()
            # TORCH_TPU_PYTHON_DEVICE_GUARD=1 keeps torch's Python guard
            if os.environ.get("TORCH_TPU_PYTHON_DEVICE_GUARD") != "1":
                module.register_device_guard()
            # TORCH_TPU_PYTHON_VIEWS=1 keeps the Python view kernels (dispatch/hand_kernels.py)
            if os.environ.get("TORCH_TPU_PYTHON_VIEWS") != "1":
                module.register_views()
                _views.extend(module.view_op_names())
                _views_module.append(module)
        except Exception as e:  # noqa: BLE001 - any failure leaves the package as it is without it
            module = None
            _why.append(f"{path} did not load: {type(e).__name__}: {e}")
    if module is None and not turned_off():
        warnings.warn(f"torch_tpu: the C++ extension is not available: {why_not()}. Without it {LOST}; "
                      f"{_OFF}=1 silences this.", ExtensionWarning, stacklevel=2)
    # torch's own note, at every tpu generator made through the registration above: the extension
    # takes it out of a Python caller's warning buffer (csrc/generator.cpp); this filter is for where
    # it cannot (another ABI)
    warnings.filterwarnings("ignore", message=r"GetGeneratorForPrivateuse1\(\) is deprecated",
                            category=DeprecationWarning)
    _loaded.append(module)
    return module


def views_in_cpp() -> list[str]:
    """The view overloads (``"aten.as_strided.default"``, ...) whose tpu kernels are the extension's
    (``csrc/views.cpp``); empty without it, or with ``TORCH_TPU_PYTHON_VIEWS=1``."""
    load()
    return _views


def set_as_strided_fallback(kernel: object) -> None:
    """Gives the C++ ``as_strided`` the Python kernel it calls for a view it cannot show to lie
    inside its source: the bounds check needs the storage's logical size, which Python holds."""
    if _views_module:
        _views_module[0].set_as_strided_fallback(kernel)


def take_view_counts() -> dict[str, int]:
    """The calls of the C++ view kernels since the last take, by overload (the counters restart)."""
    if not _views_module:
        return {}
    return {name: n for name, n in zip(_views, _views_module[0].take_view_counts()) if n}


def key_of_tensors() -> Callable[[list, bool], Any] | None:
    """The C++ key of a list of tpu tensors (``csrc/keys.cpp``: ``(keys, arrays)``, or None where a
    tensor is not a plain tpu tensor over its whole storage), once :func:`set_key_types` has named
    the types it checks; None without the extension."""
    return _keys[0] if _keys else None


def set_key_types(lazy: type) -> None:
    """Tells the C++ key the trace's placeholder type (``runtime.fused.Lazy``), which a storage may
    hold in place of its array; from then on :func:`key_of_tensors` serves."""
    module = load()
    if module is not None and not _keys and hasattr(module, "key_of_tensors"):
        module.set_key_types(torch.Tensor, torch.nn.Parameter, lazy)
        _keys.append(module.key_of_tensors)


def available() -> bool:
    """Whether the extension is loaded in this process (``torch.Generator(device="tpu")`` can be made)."""
    return load() is not None


def why_not() -> str:
    return _why[-1] if _why else ""


def main() -> int:
    """The set-up step: builds the extension ahead of the first import; a failure is reported, not
    fatal (see the module)."""
    if _library(build_dir()) is not None:
        print(f"torch_tpu: C++ extension already built in {build_dir()}")
        return 0
    try:
        where = build()
    except Exception as e:  # noqa: BLE001 - no compiler, or a torch whose headers lack the registration
        print(f"torch_tpu: the C++ extension was not built ({e}); without it {LOST}; everything else works",
              file=sys.stderr)
        return 0
    print(f"torch_tpu: C++ extension built in {where}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "build":
        _compile_here(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
