"""Lowerings: nn ops."""

from __future__ import annotations

from torch_tpu.ops._registry import aten, lower  # noqa: F401
