"""The ``tpu`` c10d backend: ``torch.distributed`` process groups for tpu tensors.

Two paths, chosen when the group is created (``group.path``, and ``group.path_reason`` says why):

- ``xla``, preferred: all_reduce, broadcast, all_gather(_into_tensor), reduce_scatter_tensor and
  all_to_all_single with equal splits run as XLA collectives through JAX's multi-controller runtime
  (``distributed/xla.py``), asynchronously. Used when the group spans the world and is created
  before the first tpu tensor.
- ``gloo-host``, the fallback (and, on the xla path, for everything else: send/recv, gather,
  scatter, uneven all_to_all, subgroups): each collective copies its tpu tensors to host memory,
  runs the same collective through a gloo process group, and copies the results back in place.

The semantics, the checks and the error messages are gloo's own. CPU tensors given to the same
group go to gloo untouched, so object collectives and barriers cost nothing extra.

``import torch_tpu`` registers the backend (a few microseconds: the group is built on first use)::

    dist.init_process_group("tpu")        # or no backend at all: "tpu" is the tpu device's default
    dist.all_reduce(torch.ones(4, device="tpu"))

Faults: the group's ``timeout`` (``init_process_group(timeout=...)``) bounds every collective. A
daemon thread publishes a heartbeat (time, collective count) per rank in the rendezvous store; when
a collective fails, the error names the ranks that stopped beating (dead) or that never reached
this collective (hung or diverged).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c

from torch_tpu.distributed import xla
from torch_tpu.tensor.storage import read_array, write

BACKEND = "tpu"
_HEARTBEAT_S = 0.5  # how often each rank publishes its heartbeat
_DEAD_AFTER_S = 3 * _HEARTBEAT_S  # a heartbeat that did not move for this long: the rank is gone
_DESC_BYTES = 256  # room for one rank's description of a mismatched collective


# ------------------------------------------------------------------------------ host staging
class _Staging:
    """Host copies of the tpu tensors of one call, and which of them to copy back afterwards."""

    def __init__(self) -> None:
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tpu tensor, host copy)

    def host(self, x: Any, *, read: bool, write: bool) -> Any:
        """``x`` (a tensor or nested lists of tensors) with each tpu tensor replaced by a contiguous host
        tensor (so views of any layout reduce correctly; they are written back through the view)."""
        if isinstance(x, (list, tuple)):
            return [self.host(v, read=read, write=write) for v in x]
        if not isinstance(x, torch.Tensor) or x.device.type == "cpu":
            return x
        if read:
            h = x.detach().cpu().contiguous()
        else:
            h = torch.empty(x.shape, dtype=x.dtype)
        if write:
            self.back.append((x, h))
        return h

    def copy_back(self) -> None:
        with torch.no_grad():
            for t, h in self.back:
                t.detach().copy_(h)
        self.back.clear()


class _Work(_c.Work):
    """A work handle. Collectives finish inside the call (their tensors are written when it returns);
    send/recv stay in flight until :meth:`wait`, which then copies a received tensor back."""

    def __init__(self, result: list[torch.Tensor], finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._result = result
        self._finish = finish
        self._lock = threading.Lock()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        with self._lock:
            if self._finish is not None:
                finish, self._finish = self._finish, None
                finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut


_REDUCE_NAMES = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product", dist.ReduceOp.BAND: "band", dist.ReduceOp.BOR: "bor",
    dist.ReduceOp.BXOR: "bxor",
}


def _op_type(op: Any) -> Any:
    """A ReduceOp (or its RedOpType) as the RedOpType key of :data:`_REDUCE_NAMES`."""
    for k in _REDUCE_NAMES:
        if op == k:
            return k
    return None


def _on_one_device(t: torch.Tensor) -> bool:
    """A dense tpu tensor whose array lives on this process's one device (not sharded by SPMD)."""
    if not isinstance(t, torch.Tensor) or t.device.type != "tpu" or t.is_sparse:
        return False
    a = read_array(t)
    return len(a.devices()) == 1


def _describe(x: Any) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in _flat(x))


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat(v)]
    return []


# ------------------------------------------------------------------------------ the group
class TPUProcessGroup(dist.ProcessGroup):
    """A c10d process group for tpu (and cpu) tensors that stages tpu tensors through a gloo group."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # c10d keeps a group's name on its backends: with gloo registered for CPU tensors the group
        # gets one (DeviceMesh and functional collectives look groups up by name)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._gloo)
        # torch 2.15 attaches a flight recorder to every group, which looks up the group's default
        # backend; gloo is the one this group owns (collectives still come to the methods below)
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        self.path_reason = xla.start(store, rank, size)
        self.path = "xla" if self.path_reason is None else "gloo-host"
        self._failed = False
        self._seq = 0  # collectives entered so far, published with the heartbeat
        self._check = os.environ.get("TORCH_TPU_DIST_CHECK", "1") != "0"
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._heartbeat, name=f"torch_tpu-c10d-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def name(self) -> str:
        return BACKEND

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        return BACKEND

    def __repr__(self) -> str:
        why = f" ({self.path_reason})" if self.path_reason else ""
        return f"TPUProcessGroup(rank={self.rank()}, size={self.size()}, path={self.path}{why})"

    # ---- the one runner
    def _run(self, op: str, outs: Any, ins: Any, *rest: Any, inout: bool = False, sig: str | None = None) -> _Work:
        """Runs gloo's ``op`` on host copies. ``outs`` are written (read first too when ``inout``),
        ``ins`` only read. Returns a finished work whose future holds the output tensors. ``sig``: what
        must agree between ranks (default: the dtypes and shapes of the inputs)."""
        self._seq += 1
        if self._check:
            self._agree(op, sig if sig is not None else _describe(outs if ins is None else ins))
        stage = _Staging()
        h_outs = stage.host(outs, read=inout, write=True)
        args = (h_outs,) if ins is None else (h_outs, stage.host(ins, read=True, write=False))
        gloo_op = getattr(self._gloo, op)
        self._finish(op, lambda: gloo_op(*args, *rest).wait())
        stage.copy_back()
        return _Work(_flat(outs))

    def _xla(self, op: str, kind: str, outs: list[torch.Tensor], ins: torch.Tensor, arg: Any = None) -> _Work | None:
        """Runs ``kind`` as an XLA collective when this group and these tensors allow it: every output
        is written from this rank's result. None: take the gloo host path."""
        if self.path != "xla" or not all(_on_one_device(t) for t in (*outs, ins)):
            return None
        self._seq += 1
        if self._check:
            self._agree(op, _describe(ins))
        result = xla.run(kind, read_array(ins), arg)
        with torch.no_grad():
            if len(outs) == 1:
                write(outs[0], result.reshape(tuple(outs[0].shape)))
            else:  # a list of outputs: equal chunks of dim 0
                for t, part in zip(outs, result.reshape(len(outs), -1)):
                    write(t, part.reshape(tuple(t.shape)))
        return _Work(list(outs))

    def _agree(self, op: str, sig: str) -> None:
        """Checks that every rank entered the same collective with matching tensors, and raises a clear
        error where gloo would abort the process ("Received data size doesn't match expected size")."""
        desc = f"{op}({sig})"
        mine = torch.tensor([zlib.crc32(desc.encode())], dtype=torch.int64)
        every = torch.empty(self.size(), dtype=torch.int64)
        self._finish(op, lambda: self._gloo._allgather_base(every, mine, _c.AllgatherOptions()).wait())
        if bool((every == mine).all()):
            return
        raw = torch.zeros(_DESC_BYTES, dtype=torch.uint8)
        data = desc.encode()[:_DESC_BYTES]
        raw[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        all_raw = torch.empty(self.size() * _DESC_BYTES, dtype=torch.uint8)
        self._finish(op, lambda: self._gloo._allgather_base(all_raw, raw, _c.AllgatherOptions()).wait())
        calls = [bytes(c.tolist()).rstrip(b"\0").decode(errors="replace") for c in all_raw.view(self.size(), -1)]
        listing = "; ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
        raise RuntimeError(
            f"torch_tpu c10d: mismatched collective #{self._seq} between ranks (rank {self.rank()} of "
            f"{self.size()}): {listing}. Every rank must call the same collective with tensors of the same "
            "dtype and shape."
        )

    def _finish(self, op: str, fn: Callable[[], Any]) -> None:
        """Runs ``fn``; a failure from gloo comes back naming this rank and the ranks to blame."""
        try:
            fn()
        except RuntimeError as e:
            if not any(k in str(e).lower() for k in ("timed out", "timeout", "connection", "closed", "peer")):
                raise  # an argument error (shape, dtype, layout): gloo's message as it is
            seq = self._seq
            self._failed = True  # a rank is gone: leaving JAX's runtime would wait for it
            raise dist.DistBackendError(
                f"torch_tpu c10d ({BACKEND} backend, gloo host path): {op} #{seq} failed on rank {self.rank()} "
                f"of {self.size()} (timeout {self._timeout}). {self._diagnose(seq)} Gloo said: {e}"
            ) from e

    # ---- collectives (the signatures are c10d's; options objects pass through to gloo)
    def allreduce(self, tensors, opts=None):  # noqa: ANN001, ANN201
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None or isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            o = _c.AllreduceOptions()
            o.reduceOp = opts if opts is not None else dist.ReduceOp.SUM
            opts = o
        name = _REDUCE_NAMES.get(_op_type(opts.reduceOp))
        if len(tensors) == 1 and name is not None:
            work = self._xla("allreduce", "allreduce", tensors, tensors[0], name)
            if work is not None:
                return work
        return self._run("allreduce", tensors, None, opts, inout=True)

    def allreduce_coalesced(self, tensors, opts=None):  # noqa: ANN001, ANN201
        return self._run("allreduce_coalesced", tensors, None, opts or _c.AllreduceCoalescedOptions(), inout=True)

    def broadcast(self, tensors, opts=None):  # noqa: ANN001, ANN201
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = opts or _c.BroadcastOptions()
        if len(tensors) == 1:
            work = self._xla("broadcast", "broadcast", tensors, tensors[0], opts.rootRank)
            if work is not None:
                return work
        return self._run("broadcast", tensors, None, opts, inout=True)

    def reduce(self, tensors, opts=None):  # noqa: ANN001, ANN201
        return self._run("reduce", tensors, None, opts or _c.ReduceOptions(), inout=True)

    def allgather(self, output_tensors, input_tensors, opts=None):  # noqa: ANN001, ANN201
        if len(input_tensors) == 1 and len(output_tensors) == 1 and input_tensors[0].dim() > 0:
            work = self._xla("allgather", "allgather", output_tensors[0], input_tensors[0])
            if work is not None:
                return work
        return self._run("allgather", output_tensors, input_tensors, opts or _c.AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):  # noqa: ANN001, ANN201, A002
        if input.dim() > 0:
            work = self._xla("_allgather_base", "allgather", [output], input)
            if work is not None:
                return work
        return self._run("_allgather_base", output, input, opts or _c.AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):  # noqa: ANN001, ANN201
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return _Work(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):  # noqa: ANN001, ANN201
        return self._run("allgather_coalesced", output_lists, input_list, opts or _c.AllgatherOptions())

    def gather(self, output_tensors, input_tensors, opts=None):  # noqa: ANN001, ANN201
        # only the root passes outputs: the ranks agree on their inputs
        return self._run("gather", output_tensors, input_tensors, opts or _c.GatherOptions(),
                         sig=_describe(input_tensors))

    def scatter(self, output_tensors, input_tensors, opts=None):  # noqa: ANN001, ANN201
        # only the root passes inputs: the ranks agree on their outputs
        return self._run("scatter", output_tensors, input_tensors, opts or _c.ScatterOptions(),
                         sig=_describe(output_tensors))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):  # noqa: ANN001, ANN201
        return self._run("reduce_scatter", output_tensors, input_tensors, opts or _c.ReduceScatterOptions())

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: ANN001, ANN201, A002
        opts = opts or _c.ReduceScatterOptions()
        name = _REDUCE_NAMES.get(_op_type(opts.reduceOp))
        if name in ("sum", "avg") and input.dim() > 0 and input.shape[0] % self.size() == 0:
            work = self._xla("_reduce_scatter_base", "reduce_scatter", [output], input, name)
            if work is not None:
                return work
        return self._run("_reduce_scatter_base", output, input, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):  # noqa: ANN001, ANN201
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _Work(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: ANN001, ANN201, A002
        opts = opts or _c.AllToAllOptions()
        if not output_split_sizes and not input_split_sizes and input.dim() > 0 and input.shape[0] % self.size() == 0:
            work = self._xla("alltoall_base", "alltoall", [output], input)
            if work is not None:
                return work
        sig = f"{input.dtype}->{output.dtype}"  # the sizes may differ between ranks (uneven splits)
        return self._run("alltoall_base", output, input, output_split_sizes, input_split_sizes, opts, sig=sig)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors, input_tensors, opts=None):  # noqa: ANN001, ANN201
        sig = ", ".join(sorted({str(t.dtype) for t in _flat(input_tensors)}))
        return self._run("alltoall", output_tensors, input_tensors, opts or _c.AllToAllOptions(), sig=sig)

    def barrier(self, opts=None):  # noqa: ANN001, ANN201
        self._seq += 1
        if self._check:
            self._agree("barrier", "")
        self._finish("barrier", lambda: self._gloo.barrier(opts or _c.BarrierOptions()).wait())
        return _Work([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):  # noqa: ANN001, ANN201
        return self._gloo.monitored_barrier(timeout or self._timeout, wait_all_ranks)

    # ---- point to point: these stay in flight, so isend/irecv pairs in either order cannot deadlock
    def send(self, tensors, dst, tag=0):  # noqa: ANN001, ANN201
        stage = _Staging()
        host = stage.host(tensors, read=True, write=False)
        work = self._gloo.send(host, dst, tag)
        return _Work(list(tensors), lambda: self._finish(f"send to rank {dst}", lambda: (host, work.wait())))

    def recv(self, tensors, src, tag=0):  # noqa: ANN001, ANN201
        return self._recv(tensors, lambda h: self._gloo.recv(h, src, tag), f"recv from rank {src}")

    def recv_anysource(self, tensors, tag=0):  # noqa: ANN001, ANN201
        return self._recv(tensors, lambda h: self._gloo.recv_anysource(h, tag), "recv from any rank")

    def _recv(self, tensors: list[torch.Tensor], post: Callable[[Any], Any], what: str) -> _Work:
        stage = _Staging()
        host = stage.host(tensors, read=False, write=True)
        work = post(host)

        def finish() -> None:
            self._finish(what, work.wait)
            stage.copy_back()

        return _Work(list(tensors), finish)

    # ---- lifetime
    def shutdown(self) -> None:
        self._stop.set()
        if self.path == "xla" and not self._failed:
            xla.stop()  # every rank is here (destroy_process_group): end JAX's runtime in step
        self._gloo.shutdown()  # its threads end now, not when the interpreter tears the object down

    def abort(self) -> None:
        self._stop.set()
        self._gloo.abort()

    # ---- fault diagnosis
    def _beat(self) -> None:
        self._store.set(f"torch_tpu_hb/{self.rank()}", f"{time.time():.3f},{self._seq}")

    def _heartbeat(self) -> None:
        while not self._stop.wait(_HEARTBEAT_S):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 (the store went away: the job is ending or rank 0 died)
                return

    def _peers(self) -> dict[int, tuple[float, int]]:
        out = {}
        for r in range(self.size()):
            key = f"torch_tpu_hb/{r}"
            if r != self.rank() and self._store.check([key]):
                t, s = self._store.get(key).decode().split(",")
                out[r] = (float(t), int(s))
        return out

    def _diagnose(self, seq: int) -> str:
        """Which ranks to blame: those whose heartbeat stopped, and those behind this collective."""
        try:
            first = self._peers()
            time.sleep(_DEAD_AFTER_S)
            now = self._peers()
        except Exception:  # noqa: BLE001
            return "The rendezvous store (hosted by rank 0) is unreachable: rank 0 has probably died."
        others = [r for r in range(self.size()) if r != self.rank()]
        dead = [r for r in others if r not in now or now[r][0] == first.get(r, (0.0, 0))[0]]
        behind = [r for r, (_, s) in now.items() if r not in dead and s < seq]
        parts = []
        if dead:
            parts.append(f"Rank(s) {dead} stopped responding (process dead or frozen).")
        if behind:
            parts.append(f"Rank(s) {behind} never reached this collective (hung or diverged elsewhere).")
        return " ".join(parts) or "Every rank is alive and reached this collective."


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> TPUProcessGroup:
    return TPUProcessGroup(store, rank, size, timeout)


def register() -> None:
    """Registers the ``tpu`` c10d backend (the default one for the ``tpu`` device). Idempotent."""
    if not dist.is_available() or BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, devices=["tpu"])


register()
