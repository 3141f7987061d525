"""``torch.tpu.Stream`` and ``torch.tpu.Event``: the stream API over XLA's one implicit stream.

XLA runs the programs of a process in an order consistent with their data dependencies, and every
tpu op reads its inputs only once they are computed, so there is one logical stream and a wait
between streams is satisfied by construction. These classes exist so that code written against
CUDA's stream API runs unchanged (FSDP2 overlaps its collectives with side streams): ``wait_*`` and
``stream(s)`` cost nothing, and ``synchronize`` waits for every queued computation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from torch_tpu.runtime import executor


def _sync() -> None:
    executor.synchronize()


class Stream:
    """A tpu stream: every stream is the device's one ordered queue."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.priority = priority

    @property
    def device(self) -> torch.device:
        return torch.device("tpu", 0)

    # ``torch.Stream``'s identity fields, which torch code passes to ops (FSDP2 in torch 2.15:
    # ``record_grad_output_stream(buffer, stream.stream_id, stream.device_index, stream.device_type)``)
    stream_id = 0
    device_index = 0
    device_type = int(torch._C._autograd.DeviceType.PrivateUse1)

    def wait_stream(self, stream: Stream) -> None:
        """Nothing to do: data dependencies order the work of every stream."""

    def wait_event(self, event: Event) -> None:
        """Nothing to do: see :meth:`wait_stream`."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        _sync()
        return True

    def synchronize(self) -> None:
        _sync()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream)

    def __hash__(self) -> int:
        return hash(Stream)

    def __repr__(self) -> str:
        return "torch.tpu.Stream(device=tpu:0)"


_DEFAULT = Stream()


class Event:
    """A marker in the stream. With ``enable_timing``, :meth:`record` waits for the queued work so
    that :meth:`elapsed_time` measures device time between two records."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        if self.enable_timing:
            _sync()
            self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Nothing to do: see :meth:`Stream.wait_stream`."""

    def query(self) -> bool:
        _sync()
        return True

    def synchronize(self) -> None:
        _sync()

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event's record and ``end_event``'s (both need ``enable_timing``)."""
        if self._time is None or end_event._time is None:
            raise RuntimeError("tpu Event.elapsed_time: both events must be recorded with enable_timing=True")
        return (end_event._time - self._time) * 1e3


def current_stream(device: Any = None) -> Stream:
    return _DEFAULT


def default_stream(device: Any = None) -> Stream:
    return _DEFAULT


@contextlib.contextmanager
def stream(s: Stream | None) -> Iterator[None]:
    """Work inside runs on ``s``: the same ordered queue."""
    yield


def set_stream(s: Stream) -> None:
    """Nothing to select: every stream is the same queue."""
