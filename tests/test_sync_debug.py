"""``torch.tpu.set_sync_debug_mode``: CUDA's switch that reports every read of device values on
the host, warning or raising with CUDA's words, naming what read and the user's line; ops that
never wait for the device (uploads, index ops, fixed-shape reductions, a training step) report
nothing. Results are CPU's whatever the mode."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from tests.conftest import assert_same

HERE = re.escape(__file__)


@pytest.fixture(autouse=True)
def _default_mode():
    yield
    torch.tpu.set_sync_debug_mode("default")


def test_modes_and_their_names():
    assert torch.tpu.get_sync_debug_mode() == 0
    for name, level in (("warn", 1), ("error", 2), ("default", 0), (2, 2), (1, 1), (0, 0)):
        torch.tpu.set_sync_debug_mode(name)
        assert torch.tpu.get_sync_debug_mode() == level
    with pytest.raises(RuntimeError, match="expected one of `default`, `warn`, `error`"):
        torch.tpu.set_sync_debug_mode("loud")
    with pytest.raises(RuntimeError, match="invalid value of debug_mode"):
        torch.tpu.set_sync_debug_mode(3)
    assert torch.tpu.get_sync_debug_mode() == 0


def _inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(4, 4, generator=g)
    ind = torch.randint(0, 4, (4,), generator=g)
    mask = torch.rand(4, 4, generator=g) > 0.5
    return {"x": x, "y": x[0].clone(), "ind": ind, "mask": mask}


# what the user writes -> what the report names
SYNCING = {
    "item": (lambda t: t["x"].sum().item(), r"_local_scalar_dense"),
    "bool": (lambda t: bool(t["y"][0] > 0.5), r"_local_scalar_dense"),
    "cpu": (lambda t: t["x"].cpu(), r"\.cpu\(\)"),
    "tolist": (lambda t: t["y"].tolist(), r"_to_copy to the host"),
    "nonzero": (lambda t: t["x"].nonzero(), r"aten\.nonzero"),
    "mask index": (lambda t: t["x"][t["mask"]], r"boolean mask index"),
    # repeats computed on the device (an uploaded tensor is read from its host copy: no wait)
    "repeat_interleave": (lambda t: torch.repeat_interleave(t["ind"], t["ind"] * 1), r"repeat_interleave"),
    "one_hot": (lambda t: nn.functional.one_hot(t["ind"]), r"_local_scalar_dense"),
    "equal": (lambda t: torch.equal(t["x"], t["x"]), r"aten\.equal"),
}


def _put(x: torch.Tensor, index, value) -> torch.Tensor:
    x = x.clone()
    x[index] = value
    return x


NOT_SYNCING = {
    "matmul": lambda t: t["x"] @ t["x"],
    "index get": lambda t: t["x"][t["ind"]],
    "index put": lambda t: _put(t["x"], t["ind"], t["y"]),
    "mask put": lambda t: _put(t["x"], t["mask"], 1.0),
    "any": lambda t: torch.any(t["y"] > 0.5),
    "repeat_interleave with output_size": lambda t: torch.repeat_interleave(t["y"], 2, output_size=8),
    "upload": lambda t: t["x"] + torch.ones(4, 4).to(t["x"].device),
    "a CPU scalar": lambda t: t["x"] * torch.tensor(2.0),
    "repeats uploaded from the host": lambda t: torch.repeat_interleave(t["ind"], t["ind"]),
}


@pytest.mark.parametrize("name", list(SYNCING))
def test_a_synchronizing_op_warns_or_raises_naming_itself_and_the_line(name):
    fn, what = SYNCING[name]
    cpu = _inputs()
    tpu = {k: v.to("tpu") for k, v in cpu.items()}
    expected = fn(cpu)
    torch.tpu.synchronize()
    torch.tpu.set_sync_debug_mode("warn")
    with pytest.warns(UserWarning, match=rf"called a synchronizing tpu operation: .*{what}.*, at {HERE}:\d+"):
        got = fn(tpu)
    torch.tpu.set_sync_debug_mode("default")
    if isinstance(expected, torch.Tensor):
        assert_same(got.to("tpu") if got.device.type == "cpu" else got, expected)
    else:
        assert got == expected
    torch.tpu.set_sync_debug_mode("error")
    with pytest.raises(RuntimeError, match=rf"called a synchronizing tpu operation: .*{what}.*, at {HERE}:\d+"):
        fn(tpu)


@pytest.mark.parametrize("name", list(NOT_SYNCING))
def test_an_op_that_never_waits_reports_nothing(name):
    fn = NOT_SYNCING[name]
    cpu = _inputs()
    tpu = {k: v.to("tpu") for k, v in cpu.items()}
    expected = fn(cpu)
    torch.tpu.synchronize()
    torch.tpu.set_sync_debug_mode("error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fn(tpu)
        torch.tpu.synchronize()  # the user's own sync is not reported, as on CUDA
    torch.tpu.set_sync_debug_mode("default")
    assert_same(got, expected)


def test_a_training_loop_runs_under_error_mode_with_cpu_losses():
    """Forward, backward and an AdamW step, with an embedding whose index bounds are checked:
    nothing waits for the device until the losses are read after the loop."""
    torch.manual_seed(0)
    mc = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(24, 5))
    mt = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(24, 5))
    mt.load_state_dict(mc.state_dict())
    mt.to("tpu")
    oc, ot = torch.optim.AdamW(mc.parameters(), lr=0.05), torch.optim.AdamW(mt.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 20, (6, 3), generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(4)]
    batches = [(x.to("tpu"), y.to("tpu")) for x, y in data]
    losses = []
    torch.tpu.synchronize()
    torch.tpu.set_sync_debug_mode("error")
    for x, y in batches:
        ot.zero_grad()
        loss = nn.functional.cross_entropy(mt(x), y)
        loss.backward()
        ot.step()
        losses.append(loss.detach())
    torch.tpu.set_sync_debug_mode("default")
    for (x, y), loss in zip(data, losses):
        oc.zero_grad()
        ref = nn.functional.cross_entropy(mc(x), y)
        ref.backward()
        oc.step()
        assert_same(loss, ref.detach(), rtol=1e-5, atol=1e-6)


def _extend(ids: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids, column], dim=-1)  # one source line: its shapes grow by a column per call


def test_a_host_op_reading_a_device_result_is_reported_by_name():
    """A decoding loop's ``cat``: once its growing shapes run on the host, the new column the device
    computed is read there (the wait a decoding step makes per token); extending the ids with a
    column the host computed reads nothing from the device. Shapes no other test uses (3 rows from
    11 columns): a ``cat`` whose program an earlier test compiled runs on the device, reading nothing
    on the host, and there is then no wait to report."""
    ids_c = torch.randint(0, 50, (3, 11))
    ids = ids_c.to("tpu")
    for _ in range(5):  # from the fourth length on, the cat runs on the host
        ids = _extend(ids, ids[:, -1:] + 1)
        ids_c = _extend(ids_c, ids_c[:, -1:] + 1)
    torch.tpu.synchronize()
    step = torch.ones(3, 1, dtype=torch.long, device="tpu") * 3  # computed on the device
    torch.tpu.set_sync_debug_mode("warn")
    with pytest.warns(UserWarning, match=rf"aten\.cat\.default run on the host, reading an input the device "
                                         rf"computed \(torch\.int64 \[3, 1\]\), at {HERE}:\d+"):
        ids = _extend(ids, step)
    torch.tpu.set_sync_debug_mode("error")
    ids = _extend(ids, ids[:, -1:] + 1)  # host results only: no wait
    torch.tpu.set_sync_debug_mode("default")
    ids_c = _extend(ids_c, torch.full((3, 1), 3))
    assert_same(ids, _extend(ids_c, ids_c[:, -1:] + 1))
