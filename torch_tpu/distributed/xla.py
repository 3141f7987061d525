"""XLA collectives for the ``tpu`` process group: the preferred path.

Each process of a ``torch.distributed`` world becomes one process of JAX's multi-controller
runtime (``jax.distributed``), with its local device. A collective is then one small XLA program
over a mesh of one device per rank: the local tensor is this process's shard of a global array,
and ``psum``/``all_gather``/``psum_scatter``/``all_to_all`` run as XLA collectives (gloo between
CPU hosts, NCCL on GPUs, ICI on TPUs), asynchronously like any other program.

``jax.distributed`` must start before JAX creates its devices, so this path is taken when the
process group is created before the first tpu tensor (the usual order: ``init_process_group``,
then ``model.to("tpu")``). Otherwise, or with ``TORCH_TPU_DIST_PATH=host``, the group stages
through gloo on host memory (``c10d.py``), and says why in ``group.path_reason``.
"""

from __future__ import annotations

import functools
import os
import socket
from typing import Any

import numpy as np
import torch.distributed as dist

from torch_tpu.runtime import executor, target

_COORDINATOR_KEY = "torch_tpu/jax_coordinator"
_state: dict[str, Any] = {"mesh": None}


def start(store: dist.Store, rank: int, size: int) -> str | None:
    """Joins this process to JAX's multi-controller runtime for a world of ``size`` ranks.

    Returns None when XLA collectives are available for this group, else the reason they are not.
    Rank 0 hosts JAX's coordinator on a free port and publishes its address in the c10d store.
    """
    import jax
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge

    if os.environ.get("TORCH_TPU_DIST_PATH", "xla") == "host":
        return "TORCH_TPU_DIST_PATH=host"
    if _state["mesh"] is not None:
        return None if len(_state["mesh"].devices) == size else "a subgroup (XLA collectives span the whole world)"
    if jax_distributed.global_state.client is None:
        if xla_bridge.backends_are_initialized():
            return ("JAX's devices existed before init_process_group (create the process group before the "
                    "first tpu tensor to use XLA collectives)")
        if size == 1:
            return "a world of one process"
        if rank == 0:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
            store.set(_COORDINATOR_KEY, f"{host}:{port}")
        address = store.get(_COORDINATOR_KEY).decode()
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, num_processes=size, process_id=rank)
    if jax.process_count() != size:
        return f"JAX's runtime has {jax.process_count()} processes, the group {size}"
    if len(jax.local_devices()) != 1:
        return f"this process has {len(jax.local_devices())} local devices (one per rank is supported)"
    from jax.sharding import Mesh

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    _state["mesh"] = Mesh(np.array(devices), ("rank",))
    return None


@functools.cache
def _program(kind: str, shape: tuple, dtype: Any, arg: Any, chip: Any) -> Any:
    """The jitted collective ``kind`` on a (ranks, *shape) global array sharded over the ranks.

    Written over the mesh's abstract shape, so that with a TPU target (``chip``, part of the cache's
    key) the same program also compiles for as many chips of the target's slice as there are
    ranks, and is reported with the rank's other programs."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    mesh = _state["mesh"]
    n = len(mesh.devices)

    def body(x: Any) -> Any:  # x: this rank's (1, *shape) block
        if kind == "allreduce":
            if arg == "sum":
                return lax.psum(x, "rank")
            if arg == "avg":
                s = lax.psum(x, "rank")
                return s / n if jnp.issubdtype(s.dtype, jnp.inexact) else s // n
            if arg == "max":
                return lax.pmax(x, "rank")
            if arg == "min":
                return lax.pmin(x, "rank")
            if arg == "product":
                return jnp.prod(lax.all_gather(x, "rank", axis=0, tiled=True), axis=0, keepdims=True).astype(x.dtype)
            if arg in ("band", "bor", "bxor"):
                every = lax.all_gather(x, "rank", axis=0, tiled=True)
                f = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[arg]
                return functools.reduce(f, [every[i : i + 1] for i in range(n)])
        if kind == "broadcast":
            return lax.all_gather(x, "rank", axis=0, tiled=True)[arg : arg + 1]
        if kind == "allgather":  # (1, *shape) -> (1, n * shape[0], ...)
            return lax.all_gather(x[0], "rank", axis=0, tiled=True)[None]
        if kind == "reduce_scatter":  # (1, n * k, ...) -> (1, k, ...)
            summed = lax.psum_scatter(x[0], "rank", scatter_dimension=0, tiled=True)
            return (summed / n if arg == "avg" else summed)[None]
        if kind == "alltoall":  # equal splits of dim 0
            return lax.all_to_all(x[0], "rank", 0, 0, tiled=True)[None]
        raise NotImplementedError(f"torch_tpu c10d: XLA collective {kind}({arg})")

    spec = P("rank")
    jitted = jax.jit(jax.shard_map(body, mesh=mesh.abstract_mesh, in_specs=spec, out_specs=spec))
    if chip is None:
        return jitted
    name = f"c10d {kind}" + (f"({arg})" if arg is not None else "") + f" over {n} ranks"
    return target.watch(jitted, kind="collective", name=name, fn=jitted, ops=[name], site=executor.user_line)


def run(kind: str, local: Any, arg: Any = None) -> Any:
    """Runs collective ``kind`` on this rank's array ``local``; returns this rank's result array
    (dispatched asynchronously, like any program)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _state["mesh"]
    n = len(mesh.devices)
    mine = jax.local_devices()[0]
    block = jax.device_put(local[None], mine)
    sharding = NamedSharding(mesh, P("rank"))
    global_array = jax.make_array_from_single_device_arrays((n, *local.shape), sharding, [block])
    out = _program(kind, tuple(local.shape), str(local.dtype), arg, target.current())(global_array)
    return out.addressable_shards[0].data[0]


def stop() -> None:
    """Leaves JAX's multi-controller runtime (with the other ranks, which stop at the same time).
    Collectives created afterwards take the host path: JAX's runtime cannot start twice."""
    import jax

    if _state["mesh"] is not None:
        _state["mesh"] = None
        _program.cache_clear()
        jax.distributed.shutdown()


def active() -> bool:
    return _state["mesh"] is not None
