"""Where a run's tensors live: the device mesh, the model and optimizer state on it, and each
batch padded, sent and split over it.

With several devices the estimator runs data parallel over a 1-D ``"data"`` mesh: every batch is
split along its rows, and XLA reduces the gradients. ``"dp"`` replicates parameters; ``"fsdp"``
also splits parameters and optimizer state along their first dim (where it divides).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from torch_tpu import distributed
from torch_tpu.estimator.data import Batch, batch_size, map_tensors, pad_rows, pad_sequences, split

log = logging.getLogger("torch_tpu.estimator")

_UNSET = object()


class Placement:
    """The devices of one estimator and how tensors are placed on them."""

    def __init__(self, jax_devices: Sequence[Any], sharding: str, bucket_lengths: Sequence[int] | None,
                 device: torch.device) -> None:
        self.jax_devices = list(jax_devices)
        self.sharding = sharding
        self.bucket_lengths = sorted(bucket_lengths) if bucket_lengths else None
        self.device = device
        self._warned_uneven = False
        self._ones: dict[int, torch.Tensor] = {}
        self._mesh_obj: Any = None
        self._mesh_key: tuple | None = None

    # ------------------------------------------------------------------ the mesh
    def mesh(self, rows: int | None) -> Any:
        """A 1-D ``"data"`` mesh over the devices when there are several and the batch divides
        evenly among them; else None (one device)."""
        if len(self.jax_devices) < 2:
            return None
        if rows is not None and rows % len(self.jax_devices):
            if not self._warned_uneven:
                self._warned_uneven = True
                log.warning("batch size %d does not divide over %d devices: running on one device",
                            rows, len(self.jax_devices))
            return None
        key = tuple(id(d) for d in self.jax_devices)
        if self._mesh_key != key:
            self._mesh_obj = distributed.mesh(len(self.jax_devices), "data", devices=self.jax_devices)
            self._mesh_key = key
        return self._mesh_obj

    def place_model(self, model: nn.Module, mesh: Any) -> None:
        """Parameters and buffers on the mesh: replicated (``dp``) or split along dim 0 (``fsdp``)."""
        if mesh is None:
            return
        if self.sharding == "dp":
            distributed.replicate_module(model, mesh)
            return
        for t in (*model.parameters(), *model.buffers()):
            _shard_rows(t, mesh)

    def place_optimizer_state(self, opt: torch.optim.Optimizer, mesh: Any) -> None:
        """``fsdp``: the optimizer state (made on the first step) split like its parameters."""
        if mesh is None or self.sharding != "fsdp":
            return
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.device.type == "tpu" and v.dim():
                    _shard_rows(v, mesh)

    @staticmethod
    def shard_batch(b: Batch, mesh: Any) -> None:
        """Splits every batch tensor along its rows over the mesh: XLA then reduces the gradients."""
        if mesh is None:
            return
        n = mesh.devices.size

        def place(t: torch.Tensor) -> torch.Tensor:
            if t.dim() and t.shape[0] % n == 0:
                distributed.shard(t, mesh, ("data",))
            return t

        map_tensors((b.args, b.kwargs, b.target, b.mask), place)

    # ------------------------------------------------------------------ batches
    def prepare(self, raw: Any, full: int | None, padding: bool, mesh: Any, *, any_form: bool = False,
                with_mask: bool = True) -> Batch:
        """Pads a partial batch on the host, sends it to the device and splits it over the mesh.

        Training and evaluation pad only batches with a target (``any_form=False``), which the loss
        can mask; prediction pads every form and needs no mask."""
        n = batch_size(raw)
        if self.bucket_lengths:
            raw = pad_sequences(raw, self.bucket_lengths)
        padded = padding and full is not None and n < full and (
            any_form or (isinstance(raw, (tuple, list)) and len(raw) >= 2))
        b = split(pad_rows(raw, full) if padded else raw, self.device, with_target=True, n=full if padded else n)
        rows = full if padded else n
        b.size = n
        b.padded_to = full if padded else None
        if with_mask:
            if n == rows:  # a full batch: one mask of ones, sent once
                if self._ones.get(rows) is None:
                    self._ones[rows] = torch.ones(rows).to(self.device)
                b.mask = self._ones[rows]
            else:
                b.mask = (torch.arange(rows) < n).float().to(self.device, non_blocking=True)
        b.raw = raw  # the host batch without row padding, for error messages
        self.shard_batch(b, mesh)
        return b

    def feeder(self, model: nn.Module, full: int | None, padding: bool, **prepare: Any) -> Feeder:
        return Feeder(self, model, full, padding, prepare)


class Feeder:
    """Turns the raw batches of one run into device batches. The full batch size (the loader's,
    else the first batch's) and the mesh are fixed at the first batch, where the model is placed."""

    def __init__(self, placement: Placement, model: nn.Module, full: int | None, padding: bool,
                 prepare: dict[str, Any]) -> None:
        self.placement, self.model, self.full, self.padding = placement, model, full, padding
        self._prepare = prepare
        self._mesh: Any = _UNSET

    @property
    def mesh(self) -> Any:
        """The mesh of this run (None for one device); only meaningful after the first batch."""
        return None if self._mesh is _UNSET else self._mesh

    def __call__(self, raw: Any) -> Batch:
        if self.full is None:
            self.full = batch_size(raw)
        if self._mesh is _UNSET:
            self._mesh = self.placement.mesh(self.full)
            self.placement.place_model(self.model, self._mesh)
        return self.placement.prepare(raw, self.full, self.padding, self._mesh, **self._prepare)


def _shard_rows(t: torch.Tensor, mesh: Any) -> None:
    if t.dim() and t.shape[0] % mesh.devices.size == 0:
        distributed.shard(t, mesh, ("data",))
    else:
        distributed.replicate(t, mesh)
