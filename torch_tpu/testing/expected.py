"""The conformance gates' one rule (OpInfo, ModuleInfo, OptimizerInfo): an entry's verdicts equal
the expectation committed for it.

Why equal, not "at least": a regression fails the gate, and so does an entry that starts passing,
so that the expectation files and the README's coverage table (both written by ``make coverage``)
stay true.
"""

from __future__ import annotations


def check_expected(name: str, got: dict[str, bool | None], expected: dict[str, dict], detail: str = "") -> None:
    """Raises AssertionError where ``got`` (check -> verdict; None: the check does not apply)
    differs from ``expected[name]``, naming the checks that regressed or now pass."""
    want = expected.get(name)
    if want is None:
        raise AssertionError(f"{name} has no expectation: run `make coverage` to record it")
    regressed = [k for k, ok in got.items() if want.get(k) and not ok]
    improved = [k for k, ok in got.items() if ok and not want.get(k)]
    if regressed:
        raise AssertionError(f"{name} regressed on {regressed}: {detail}")
    if improved:
        raise AssertionError(f"{name} now passes {improved}: run `make coverage` to update the expectations")


__all__ = ["check_expected"]


def fallbacks(metrics: dict) -> tuple[str, ...]:
    """The ops of ``torch_tpu.metrics()`` that fell back to the CPU, less the calls that ran on the
    host by design because XLA has no TPU kernel for them (eig, with the platform or the TPU target
    a TPU): the gates' ``no_fallback`` verdict is the same with and without ``TORCH_TPU_TARGET``."""
    designed = metrics.get("no_tpu_kernel_counts", {})
    return tuple(sorted(op for op, n in metrics["fallback_counts"].items() if n > designed.get(op, 0)))
