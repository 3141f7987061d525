"""PyTorch's ModuleInfo database as the module-conformance gate, CPU as the reference.

Each ``nn`` module's verdicts (forward, gradients, non-contiguous inputs, memory formats, factory
kwargs, no CPU fallback: see ``torch_tpu/testing/modules.py``) must equal the committed expectation
in ``tests/moduleinfo_expected.json``: a regression fails, and so does a module that starts passing,
so that the file and the README's table (both refreshed by ``make coverage``) stay true. CI runs a
sample, as the OpInfo gate does (every 3rd module in strict mode, another every 6th in fused mode);
``TORCH_TPU_MODULEINFO=all`` runs every module. The bfloat16 forward is reported, not gated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torch_tpu.testing import modules
from torch_tpu.testing.expected import check_expected

EXPECTED = json.loads((Path(__file__).parent / "moduleinfo_expected.json").read_text())
_ALL = modules.module_infos()
if os.environ.get("TORCH_TPU_MODULEINFO") == "all":
    _INFOS = _ALL
elif os.environ.get("TORCH_TPU_EAGER_MODE") == "fused":
    _INFOS = _ALL[1::6]
else:
    _INFOS = _ALL[::3]


@pytest.mark.opinfo
@pytest.mark.parametrize("info", _INFOS, ids=modules.module_key)
def test_moduleinfo(info):
    v = modules.run([info], bf16=False)[0]
    if v.skipped:
        pytest.skip(v.skipped)
    check_expected(v.name, v.gated(), EXPECTED, f"{v.error} fallbacks={v.fallbacks}")
