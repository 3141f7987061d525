"""Checkpoints that survive a crash mid-save.

A checkpoint is a directory ``step-<N>/`` holding ``model.safetensors`` (the weights) and
``state.pt`` (optimizer, scheduler, RNG states, step, epoch, data position, history). It is written
under a temporary name and renamed when complete; the file ``latest`` (itself replaced atomically)
names the newest one. A process killed mid-save leaves ``latest`` pointing at the previous
checkpoint, which is untouched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from torch_tpu.estimator.data import map_tensors

LATEST = "latest"


def _cpu(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().cpu().clone())


def _write_text_atomic(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(directory: str, model: torch.nn.Module, state: dict[str, Any], step: int, keep: int = 2) -> str:
    """Writes checkpoint ``step-<step>`` atomically, points ``latest`` at it and keeps the ``keep`` newest."""
    os.makedirs(directory, exist_ok=True)
    name = f"step-{step:08d}"
    final = os.path.join(directory, name)
    tmp = tempfile.mkdtemp(dir=directory, prefix=f".tmp-{name}-")
    try:
        # Each tensor copied separately: tied weights would otherwise share storage, which
        # safetensors refuses; loading assigns both names.
        weights = {k: v.detach().cpu().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(weights, os.path.join(tmp, "model.safetensors"))
        torch.save(_cpu(state), os.path.join(tmp, "state.pt"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_text_atomic(os.path.join(directory, LATEST), name + "\n")
    ckpts = sorted(d for d in os.listdir(directory) if d.startswith("step-"))
    for old in ckpts[:-keep] if keep > 0 else []:
        if old != name:
            shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    return final


def latest(directory: str) -> str | None:
    """The newest complete checkpoint in ``directory``, or None."""
    pointer = os.path.join(directory, LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(directory, f.read().strip())
    return path if os.path.isfile(os.path.join(path, "state.pt")) else None


def load(path: str, model: torch.nn.Module) -> dict[str, Any]:
    """Loads the weights into ``model`` (on its device) and returns the rest of the state (on CPU)."""
    weights = load_file(os.path.join(path, "model.safetensors"))
    model.load_state_dict(weights)
    return torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
