"""Distributed tpu tensors. Imported on demand (``import torch_tpu.distributed``), never by
``import torch_tpu``.

Single-process SPMD (:mod:`torch_tpu.distributed.spmd`): build a device mesh, shard or replicate
tensors over it, and run ordinary PyTorch code; XLA partitions each program and adds the
collectives.
"""

from __future__ import annotations

from torch_tpu.distributed.c10d import TPUProcessGroup  # noqa: F401 (registers the "tpu" c10d backend)
from torch_tpu.distributed.spmd import mesh, replicate, replicate_module, shard, sharding_of

__all__ = ["mesh", "replicate", "replicate_module", "shard", "sharding_of"]
