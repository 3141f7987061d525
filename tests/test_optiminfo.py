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
from torch_tpu.testing.expected import check_expected

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
    check_expected(v.name, v.gated(), EXPECTED, v.error)


def test_the_gates_rule_fails_a_regression_an_improvement_and_a_missing_entry():
    """The rule all three gates share (torch_tpu/testing/expected.py): equal, or a named failure."""
    want = {"SGD": {"step": True, "fused": None, "foreach": False}}
    check_expected("SGD", {"step": True, "fused": None, "foreach": False}, want)
    with pytest.raises(AssertionError, match=r"SGD regressed on \['step'\]: why"):
        check_expected("SGD", {"step": False, "fused": None, "foreach": False}, want, "why")
    with pytest.raises(AssertionError, match=r"now passes \['foreach'\]"):
        check_expected("SGD", {"step": True, "fused": None, "foreach": True}, want)
    with pytest.raises(AssertionError, match="has no expectation"):
        check_expected("Adam", {"step": True}, want)
