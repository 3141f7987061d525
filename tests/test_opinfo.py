"""PyTorch's OpInfo database as the op-conformance suite, CPU as the reference.

CI runs every 5th OpInfo in strict mode and every 10th (another sample) in fused mode
(``TORCH_TPU_OPINFO=all`` or ``make opinfo`` runs all). Each op's verdict
(forward, gradients, no CPU fallback) must equal the committed expectation in
``tests/opinfo_expected.json``: a regression fails, and so does an op that starts passing, so that
the list (and the README's table, both refreshed by ``make coverage``) stays true.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torch_tpu.testing import opinfo

EXPECTED = json.loads((Path(__file__).parent / "opinfo_expected.json").read_text())
_ALL = opinfo.float32_ops()
if os.environ.get("TORCH_TPU_OPINFO") == "all":
    _OPS = _ALL
elif os.environ.get("TORCH_TPU_EAGER_MODE") == "fused":
    _OPS = _ALL[2::10]  # the fused-mode run: a different, smaller sample
else:
    _OPS = _ALL[::5]


@pytest.mark.opinfo
@pytest.mark.parametrize("op", _OPS, ids=opinfo.op_key)
def test_opinfo(op):
    v = opinfo.run([op])[0]
    if v.skipped:
        pytest.skip(v.skipped)
    want = EXPECTED.get(v.name)
    if want is None:
        pytest.fail(f"{v.name} has no expectation: run `make coverage` to record it")
    got = {"forward": v.forward, "grad": v.grad, "no_fallback": v.no_fallback}
    regressed = [k for k, ok in got.items() if want[k] and not ok]
    improved = [k for k, ok in got.items() if ok and not want[k]]
    assert not regressed, f"{v.name} regressed on {regressed}: {v.error} fallbacks={v.fallbacks}"
    assert not improved, f"{v.name} now passes {improved}: run `make coverage` to update the expectations"
