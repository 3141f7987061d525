"""Checkpoints that survive a crash mid-save.

A checkpoint is a directory ``step-<N>/`` holding ``model.safetensors`` (the weights) and
``state.pt`` (optimizer, scheduler, RNG states, step, epoch, data position, history). It is written
under a temporary name and renamed when complete; the file ``latest`` (itself replaced atomically)
names the newest one. A process killed mid-save leaves ``latest`` pointing at the previous
checkpoint, which is untouched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from torch_tpu.estimator.data import map_tensors
from torch_tpu.estimator.history import History

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


# ---------------------------------------------------------------------- a fit run's checkpoints
@dataclass
class RunState:
    """Where a fit run stands: what a checkpoint records (the step, and the data position: the
    epoch, the batches of it consumed, and the CPU RNG as the epoch began, from which the
    loader's shuffle draws), and whether Ctrl-C was pressed."""

    history: History = field(default_factory=History)
    step: int = 0
    epoch: int = 0
    batch: int = 0
    epoch_rng: Any = None
    interrupted: bool = False


class Checkpointer:
    """Resume, save and Ctrl-C for one ``fit`` run. Without a directory, every method is a no-op.

    Resuming restores the weights, optimizer, scheduler and run state at once, and the data
    position when the first epoch begins: the CPU RNG (so the loader shuffles the same way), then,
    once the consumed batches are skipped, the tpu RNG.
    """

    def __init__(self, directory: str | None, keep: int, resume: bool) -> None:
        self.directory, self.keep, self.resume_enabled = directory, keep, resume
        self._resumed: dict[str, Any] | None = None

    def resume(self, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, run: RunState) -> str | None:
        """Loads the newest checkpoint into ``model``, ``opt``, ``sched`` and ``run``; its path, or None."""
        if not (self.directory and self.resume_enabled):
            return None
        path = latest(self.directory)
        if path is None:
            return None
        state = load(path, model)
        opt.load_state_dict(state["optimizer"])
        if sched is not None and state.get("scheduler") is not None:
            sched.load_state_dict(state["scheduler"])
        run.history = History.from_dict(state["history"])
        run.step, run.epoch, run.batch = state["step"], state["epoch"], state["batch"]
        self._resumed = state
        return path

    def restore_loader_rng(self) -> None:
        """Before the first epoch's loader is iterated: the CPU RNG as the checkpoint recorded it."""
        if self._resumed is not None:
            st = self._resumed
            torch.set_rng_state(st["epoch_rng"] if st["batch"] else st["cpu_rng"])

    def restore_device_rng(self) -> None:
        """Once the consumed batches are skipped: the tpu RNG (dropout continues where it was)."""
        if self._resumed is not None:
            torch.tpu.set_rng_state(self._resumed["tpu_rng"])
            self._resumed = None

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, run: RunState) -> None:
        if not self.directory:
            return
        state = {
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict() if sched is not None else None,
            "cpu_rng": torch.get_rng_state(),
            "tpu_rng": torch.tpu.get_rng_state(),
            "epoch_rng": run.epoch_rng,
            "step": run.step,
            "epoch": run.epoch,
            "batch": run.batch,
            "history": run.history.to_dict(),
        }
        save(self.directory, model, state, run.step, keep=self.keep)

    @contextlib.contextmanager
    def interrupts(self, run: RunState, save_now: Callable[[], None], say: Callable[[str], None]) -> Iterator[None]:
        """Ctrl-C mid-step would leave half-updated weights: the first one is noted in
        ``run.interrupted`` (the loop stops between steps), a second one stops at once. Either
        way a checkpoint is saved and the KeyboardInterrupt re-raised."""
        old_handler = None
        if self.directory and threading.current_thread() is threading.main_thread():
            def on_sigint(signum: int, frame: Any) -> None:
                if run.interrupted:
                    raise KeyboardInterrupt
                run.interrupted = True

            old_handler = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        except KeyboardInterrupt:
            if self.directory:
                save_now()
                say(f"interrupted: saved a checkpoint at step {run.step} in {self.directory}")
            raise
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
