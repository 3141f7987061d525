"""PyTorch's OptimizerInfo database as the optimizer-conformance gate, CPU as the reference.

Each optimizer's verdicts (the for-loop, foreach, fused and capturable implementations, state dicts,
schedulers, error inputs: see ``torch_tpu/testing/optimizers.py``) must equal the committed
expectation in ``tests/optiminfo_expected.json``: a regression fails, and so does an optimizer that
starts passing (``make coverage`` refreshes the file and the README's table). Every optimizer runs
in strict mode; fused mode runs every other one (``TORCH_TPU_OPTIMINFO=all`` runs them all).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torch_tpu.testing import optimizers

EXPECTED = json.loads((Path(__file__).parent / "optiminfo_expected.json").read_text())
_ALL = optimizers.optim_infos()
if os.environ.get("TORCH_TPU_EAGER_MODE") == "fused" and os.environ.get("TORCH_TPU_OPTIMINFO") != "all":
    _INFOS = _ALL[1::2]
else:
    _INFOS = _ALL


@pytest.mark.opinfo
@pytest.mark.parametrize("info", _INFOS, ids=optimizers.optim_key)
def test_optiminfo(info):
    v = optimizers.run([info])[0]
    if v.skipped:
        pytest.skip(v.skipped)
    want = EXPECTED.get(v.name)
    if want is None:
        pytest.fail(f"{v.name} has no expectation: run `make coverage` to record it")
    got = v.gated()
    regressed = [k for k, ok in got.items() if want[k] and not ok]
    improved = [k for k, ok in got.items() if ok and not want[k]]
    assert not regressed, f"{v.name} regressed on {regressed}: {v.error}"
    assert not improved, f"{v.name} now passes {improved}: run `make coverage` to update the expectations"
