"""The device's random number state.

PyTorch's Python hooks cannot hand a backend a ``torch.Generator``, so the backend keeps its own:
a seed and a counter. Each random op takes ``fold_in(key(seed), counter)`` *inside* its program,
with both as runtime inputs, so drawing numbers costs no host-side jax call and never recompiles.
"""

from __future__ import annotations

import random
import threading

import jax
import numpy as np
import torch

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


# While a graph is captured (torch_tpu.runtime.graphs): the inputs handed to each random op, in
# order, so that every replay feeds the same ops fresh counters, as CUDA graphs advance Philox.
capture_log: list | None = None


def inputs_from(generator: torch.Generator) -> list[np.ndarray]:
    """The two runtime inputs of a random op given a ``torch.Generator``, drawn from it. A tpu
    generator cannot be made (the Python hooks again), so a CPU one stands in: seeded alike, it
    gives the same numbers, and each op advances it; the device's own state is left alone."""
    if capture_log is not None:
        raise NotImplementedError(
            "tpu graph capture: a random op with an explicit torch.Generator cannot be captured (its numbers "
            "are drawn on the host, so every replay would repeat them); use the default generator inside the "
            "captured region (torch.manual_seed seeds it)"
        )
    seed_in, counter_in = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator,
                                        device=generator.device).tolist()
    return [np.uint32(seed_in), np.uint32(counter_in)]


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
