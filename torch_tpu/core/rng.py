"""The device's random number state.

The default state is a seed and a counter kept here (``torch.manual_seed`` and ``torch.tpu``'s
functions set it). Each random op takes ``fold_in(key(seed), counter)`` *inside* its program, with
both as runtime inputs, so drawing numbers costs no host-side jax call and never recompiles. A
``torch.Generator(device="tpu")`` (made through the C++ extension, ``extension``) is the same
pair: its seed, and its offset as the counter, so it gives the default stream's numbers for the
same seed, as a CUDA generator does.
"""

from __future__ import annotations

import os
import random
import threading

import jax
import numpy as np
import torch


def _source_from_env() -> str:
    name = os.environ.get("TORCH_TPU_RANDOM", "device").lower()
    if name not in ("device", "cpu"):
        raise ValueError(f"TORCH_TPU_RANDOM={name!r}: expected device or cpu")
    return name


# ``TORCH_TPU_RANDOM=cpu``: eager random ops draw from CPU's generator, by CPU's kernels, so a
# seed gives on tpu exactly the numbers it gives on CPU (``dispatch.fallback.cpu_stream_kernel``); read at import
SOURCE = _source_from_env()

_lock = threading.Lock()
_seed = 0
_counter = 0
_initial_seed = 0


def manual_seed(seed: int) -> None:
    global _seed, _counter, _initial_seed
    with _lock:
        _seed = _initial_seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
        _counter = 0


def seed() -> int:
    """Seeds with a non-deterministic number, as ``torch.cuda.seed`` does."""
    s = random.SystemRandom().getrandbits(63)
    manual_seed(s)
    return s


def initial_seed() -> int:
    return _initial_seed


def next_inputs() -> list[np.ndarray]:
    """The two runtime inputs of one random op: the seed and a fresh counter value."""
    global _counter
    with _lock:
        _counter += 1
        c = _counter
    pair = [np.uint32(_seed & 0xFFFF_FFFF), np.uint32(c & 0xFFFF_FFFF)]
    if capture_log is not None:
        capture_log.append(pair)
    return pair


# While a graph is captured (torch_tpu.device.graphs): the inputs handed to each random op, in
# order, so that every replay feeds the same ops fresh counters, as CUDA graphs advance Philox.
capture_log: list | None = None


def inputs_from(generator: torch.Generator) -> list[np.ndarray]:
    """The two runtime inputs of a random op given a ``torch.Generator``. A tpu generator's are its
    seed and its next offset, which the op advances. A CPU generator (where the C++ extension that
    makes tpu generators is not built) draws the pair: seeded alike, it gives the same numbers, and
    each op advances it. Either way the device's default state is left alone."""
    if capture_log is not None:
        raise NotImplementedError(
            "tpu graph capture: a random op with an explicit torch.Generator cannot be captured (its state "
            "is read on the host, so every replay would repeat the same numbers); use the default generator "
            "inside the captured region (torch.manual_seed seeds it)"
        )
    if generator.device.type == "tpu":
        with _lock:
            counter = generator.get_offset() + 1
            generator.set_offset(counter)
        return [np.uint32(generator.initial_seed() & 0xFFFF_FFFF), np.uint32(counter & 0xFFFF_FFFF)]
    seed_in, counter_in = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator,
                                        device=generator.device).tolist()
    return [np.uint32(seed_in), np.uint32(counter_in)]


def cpu_generator_from(generator: torch.Generator) -> torch.Generator:
    """A CPU generator for a CPU kernel that runs a tpu generator's random op (the CPU fallback):
    seeded from the tpu generator's seed and next offset, which the op advances."""
    seed_in, counter_in = inputs_from(generator)
    return torch.Generator().manual_seed((int(seed_in) << 32) | int(counter_in))


def key_from(seed_in, counter_in):
    """Inside a program: the PRNG key of one random op."""
    return jax.random.fold_in(jax.random.PRNGKey(seed_in), counter_in)


def get_state() -> torch.Tensor:
    """The state as a CPU uint8 tensor (seed and counter, 8 bytes each), like ``get_rng_state``."""
    arr = np.array([_seed, _counter, _initial_seed], dtype=np.uint64)
    return torch.from_numpy(arr.view(np.uint8).copy())


def set_state(state: torch.Tensor) -> None:
    global _seed, _counter, _initial_seed
    arr = state.detach().cpu().contiguous().numpy().view(np.uint64)
    if arr.size != 3:
        raise RuntimeError(f"torch.tpu.set_rng_state: expected a uint8 tensor of 24 bytes, got {state.numel()}")
    with _lock:
        _seed, _counter, _initial_seed = (int(x) for x in arr)


# (seed, offset) of a tpu generator -> the CPU generator that draws its next numbers. Keyed by the
# generator's state, not the object: torch hands a kernel a new Python wrapper of the generator at
# each call. Two tpu generators with the same seed and the same number of draws share the entry.
_streams: dict[tuple[int, int], torch.Generator] = {}
_STREAMS_KEPT = 64


def shadow_generator(generator: torch.Generator) -> torch.Generator:
    """Under ``TORCH_TPU_RANDOM=cpu``, the CPU generator that draws for tpu ``generator``: seeded
    with its seed, so ``torch.Generator("tpu").manual_seed(s)`` gives CPU's numbers for ``s``, and
    carried on from draw to draw; a tpu generator reseeded (offset 0 again) starts afresh, as a
    CPU generator does. Each draw advances the tpu generator's offset by one."""
    if generator.device.type != "tpu":
        return generator
    seed_now, offset = generator.initial_seed(), generator.get_offset()
    cpu = _streams.pop((seed_now, offset), None)
    if cpu is None:
        cpu = torch.Generator().manual_seed(seed_now)
        if offset:  # drawn before this mode saw it (a state set by hand): a stream of its own
            cpu.manual_seed((seed_now << 32 | offset) & 0xFFFF_FFFF_FFFF_FFFF)
    generator.set_offset(offset + 1)
    if len(_streams) >= _STREAMS_KEPT:
        del _streams[next(iter(_streams))]
    _streams[(seed_now, offset + 1)] = cpu
    return cpu
