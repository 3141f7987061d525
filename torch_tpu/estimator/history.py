"""What a ``fit`` run measured: per-step and per-epoch values, throughput and compile time."""

from __future__ import annotations

import math
from typing import Any


class History:
    """The record of a :meth:`TPUEstimator.fit` run.

    ``steps``: one dict per optimizer step (``step``, ``epoch``, ``loss``, ``lr``, ``samples_per_s``).
    ``epochs``: one dict per epoch (``epoch``, ``loss``, ``samples_per_s``, ``seconds`` and any
    validation values as ``val_<name>``). ``compile_seconds`` and ``programs_compiled`` count
    the XLA compilations this run caused.

    ``execution``: how the last ``fit`` ran its steps: ``"replay"`` (``mode="auto"``: captured and
    replayed after the warm-up), ``"fused"`` (``mode="fused"``, or ``"auto"`` fallen back; then
    ``replay_fallback`` says why), ``"compile"`` or ``"strict"``. ``replayed_steps`` counts the
    steps that ran as a replay, ``graphs_captured`` the captures (one per shape bucket).
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.epochs: list[dict[str, Any]] = []
        self.compile_seconds: float = 0.0
        self.programs_compiled: int = 0
        self.stopped_early: bool = False
        self.execution: str = ""
        self.replay_fallback: str | None = None
        self.replayed_steps: int = 0
        self.graphs_captured: int = 0

    # ------------------------------------------------------------------ views
    @property
    def loss(self) -> list[float]:
        """The loss of every optimizer step."""
        return [s["loss"] for s in self.steps]

    @property
    def epoch_loss(self) -> list[float]:
        return [e["loss"] for e in self.epochs]

    @property
    def samples_per_s(self) -> float:
        """Throughput over every epoch, compile time included."""
        n = sum(e.get("samples", 0) for e in self.epochs)
        t = sum(e.get("seconds", 0.0) for e in self.epochs)
        return n / t if t > 0 else float("nan")

    def metric(self, name: str) -> list[Any]:
        """A per-epoch value by name, for example ``"val_accuracy"``."""
        return [e.get(name) for e in self.epochs]

    def to_dict(self) -> dict[str, Any]:
        """The raw values, JSON-serialisable."""
        return {
            "steps": [dict(s) for s in self.steps],
            "epochs": [dict(e) for e in self.epochs],
            "compile_seconds": self.compile_seconds,
            "programs_compiled": self.programs_compiled,
            "stopped_early": self.stopped_early,
            "execution": self.execution,
            "replay_fallback": self.replay_fallback,
            "replayed_steps": self.replayed_steps,
            "graphs_captured": self.graphs_captured,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> History:
        h = cls()
        h.steps = [dict(s) for s in d.get("steps", [])]
        h.epochs = [dict(e) for e in d.get("epochs", [])]
        h.compile_seconds = float(d.get("compile_seconds", 0.0))
        h.programs_compiled = int(d.get("programs_compiled", 0))
        h.stopped_early = bool(d.get("stopped_early", False))
        h.execution = str(d.get("execution", ""))
        h.replay_fallback = d.get("replay_fallback")
        h.replayed_steps = int(d.get("replayed_steps", 0))
        h.graphs_captured = int(d.get("graphs_captured", 0))
        return h

    def plot(self, path: str) -> str:
        """Saves a PNG of the step loss, the epoch losses and every per-epoch metric; returns ``path``."""
        from matplotlib.figure import Figure  # no pyplot: the user's backend and figures stay untouched

        skip = {"epoch", "loss", "samples", "seconds", "samples_per_s", "val_loss", "last_step"}
        names = sorted({k for e in self.epochs for k in e if k not in skip})
        panels = 1 + len(names)
        fig = Figure(figsize=(5 * panels, 3.6))
        axes = fig.subplots(1, panels, squeeze=False)
        ax = axes[0][0]
        ax.plot([s["step"] for s in self.steps], self.loss, lw=0.8, label="train (step)")
        if self.epochs:
            last_step = [e.get("last_step", i) for i, e in enumerate(self.epochs)]
            ax.plot(last_step, self.epoch_loss, "o-", label="train (epoch)")
            val = [(s, e["val_loss"]) for s, e in zip(last_step, self.epochs) if "val_loss" in e]
            if val:
                ax.plot(*zip(*val), "s-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
        for ax, name in zip(axes[0][1:], names):
            pts = [(e["epoch"], e[name]) for e in self.epochs
                   if isinstance(e.get(name), (int, float)) and math.isfinite(e[name])]
            if pts:
                ax.plot(*zip(*pts), "o-")
            ax.set_xlabel("epoch")
            ax.set_title(name)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        return path

    def __repr__(self) -> str:
        last = f", last loss {self.loss[-1]:.4g}" if self.steps else ""
        return f"History({len(self.steps)} steps, {len(self.epochs)} epochs{last})"
