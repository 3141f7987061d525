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


def outcome(fn, *args, **kwargs) -> tuple:
    """("ok", the result on CPU) or (exception type, message) of ``fn(*args, **kwargs)``."""
    try:
        r = fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the comparison is the test
        return type(e), str(e)
    return "ok", r.cpu() if isinstance(r, torch.Tensor) else r


def like_cpu(fn, *args, **kwargs) -> None:
    """``fn`` on CPU tensors and on tpu copies of them: CPU's values, or CPU's exception type with
    CPU's message inside ours. The copies are made first, before an in-place ``fn`` changes the
    CPU arguments."""
    moved = [a.to("tpu") if isinstance(a, torch.Tensor) else a for a in args]
    kw = {k: v.to("tpu") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    cpu = outcome(fn, *args, **kwargs)
    tpu = outcome(fn, *moved, **kw)
    if cpu[0] == "ok":
        assert tpu[0] == "ok", tpu
        torch.testing.assert_close(tpu[1], cpu[1], equal_nan=True)
    else:
        assert tpu[0] is cpu[0], f"{tpu} where CPU raised {cpu}"
        assert cpu[1] in tpu[1]


# --------------------------------------------------------------------- the TPU compile pass
@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Under ``TORCH_TPU_TARGET`` (``make test``'s target group, ``make test-tpu-target``), every
    program the tests ran was also compiled for that TPU chip: the session fails where one did not,
    and its report is printed."""
    import os

    from torch_tpu.runtime import target

    if not os.environ.get("TORCH_TPU_TARGET") or target.current() is None:
        return
    report = target.report()
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_sep("=", f"compiled for the TPU target {report['topology']}")
        for line in str(report).splitlines()[:40]:
            reporter.write_line(line)
    if report["programs"]["failed"] and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
