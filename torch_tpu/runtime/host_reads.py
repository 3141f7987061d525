"""Where the host waits for device values: naming them, and ``torch.tpu.set_sync_debug_mode``.

On an accelerator a step's speed is the host's: every read of a device value on the host
(``.item()``, ``.cpu()``, ``print``, ``if tensor:``, an op whose output shape depends on values, an
op without a lowering that runs on CPU) waits until the device has computed it, and the host then
has nothing queued while it decides what comes next. Such reads hide in library code (a stopping
criterion, a logging callback), so CUDA has a switch that reports each one, and code written
for it (``torch.cuda.set_sync_debug_mode("error")`` around a loop that must not sync) ports here by
the device name:

* ``"default"`` or 0: nothing is reported;
* ``"warn"`` or 1: each synchronizing operation warns (``UserWarning``);
* ``"error"`` or 2: each raises ``RuntimeError``.

The words are CUDA's ("called a synchronizing tpu operation"), followed by what read the host and
the user's line. What counts is a read of device memory by the host: a value the host already
holds (the host copy an index tensor was uploaded from, the small integer ops of a decoding loop
that run on the host) is read without waiting and is not reported, nor are uploads, which never
wait for the device. ``torch.tpu.synchronize()`` is not reported either (it is the user's own
sync), as on CUDA.

Graph capture refuses the same reads (:mod:`.graphs`) and names them with :func:`what_read`.
"""

from __future__ import annotations

import sys
import warnings

from torch_tpu.runtime import fused

_MODES = {"default": 0, "warn": 1, "error": 2}
mode = 0  # read inline by the hot paths: ``if host_reads.mode: host_reads.synchronizing()``

_HOST_READS = {  # kernel function -> what the user wrote
    "_local_scalar_dense": "aten._local_scalar_dense (.item(), float(), int(), bool())",
    "_to_copy": "aten._to_copy to the host (.cpu(), .to('cpu'), print, .tolist())",
    "_copy_from": "aten._copy_from into a CPU tensor",
    "_equal": "aten.equal (torch.equal)",
    "_expand_masks": "a boolean mask index (x[mask], whose shape depends on the mask's values)",
    "_str": "print / repr",
    "cpu_fallback": "an op without a lowering, run on CPU (its inputs read to the host)",
    "synchronize": "a synchronisation (torch.tpu.synchronize, torch_tpu.sync)",
    "set_eager_mode": "torch_tpu.set_eager_mode",
}


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """``torch.cuda.set_sync_debug_mode`` for tpu: "default"/0, "warn"/1 or "error"/2 (see the module)."""
    global mode
    if isinstance(debug_mode, str):
        if debug_mode not in _MODES:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = _MODES[debug_mode]
    if type(debug_mode) is not int or not 0 <= debug_mode <= 2:
        raise RuntimeError(f"invalid value of debug_mode, expected one of 0, 1, 2, got {debug_mode!r}")
    mode = debug_mode


def get_sync_debug_mode() -> int:
    """The current sync debug mode: 0 (default), 1 (warn) or 2 (error)."""
    return mode


def site_text() -> str:
    """The user's source line, as ``file:line``."""
    site = fused.user_site()
    return f"{site[0]}:{site[1]}" if site else "<unknown>"


def what_read() -> str:
    """What read the host, from the innermost frame that says: a known kernel, or the op a
    dispatcher frame serves."""
    f = sys._getframe(1)
    while f is not None:
        what = _HOST_READS.get(f.f_code.co_name)
        if what is not None:
            return what
        op = f.f_locals.get("op") if f.f_code.co_name in ("run", "__call__", "_run_kernel") else None
        if op is not None and hasattr(op, "_schema"):
            return str(op)
        f = f.f_back
    return "a read of a value on the host"


def synchronizing(what: str | None = None) -> None:
    """Reports a read of device values on the host, by the sync debug mode (call it only when
    ``mode`` is set: the check costs the hot path nothing then)."""
    if not mode:
        return
    site = fused.user_site()
    where = f"{site[0]}:{site[1]}" if site else "<unknown>"
    text = f"called a synchronizing tpu operation: {what or what_read()}, at {where}"
    if mode == 2:
        raise RuntimeError(text)
    # attributed to the user's line, so the default filter shows each (message, line) once
    filename, lineno = site if site else ("<unknown>", 0)
    warnings.warn_explicit(text, UserWarning, filename, lineno, registry=_registry)


_registry: dict = {}
