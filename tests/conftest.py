"""Shared fixtures. CPU PyTorch is the reference for every numeric result."""

from __future__ import annotations

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the device)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def assert_same(tpu_value: torch.Tensor, cpu_value: torch.Tensor, **kw) -> None:
    """Values, shape and dtype of a tpu result equal the CPU reference."""
    assert tpu_value.device.type == "tpu", tpu_value.device
    torch.testing.assert_close(tpu_value.cpu(), cpu_value, **kw)


def cpu_error(fn, *args, **kwargs) -> type[BaseException]:
    """The exception type CPU PyTorch raises for ``fn(*args, **kwargs)``.

    CPU is the reference for error types too, and some changed between torch versions (``rfft`` of
    a complex input raises ``TypeError`` from 2.14, ``RuntimeError`` before), so tests compare with
    CPU's error instead of naming a type.
    """
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - whatever CPU raises is the reference
        return type(e)
    raise AssertionError(f"CPU raised nothing for {getattr(fn, '__name__', fn)}")
