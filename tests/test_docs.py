"""The README's environment-variable table lists exactly the TORCH_TPU_* variables the code reads."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_env_var_table_matches_the_code():
    read = set()
    for path in (ROOT / "torch_tpu").rglob("*.py"):
        read |= set(re.findall(r"environ(?:\.get)?[\(\[]\s*\"(TORCH_TPU_[A-Z_]+)\"", path.read_text()))
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(TORCH_TPU_[A-Z_]+)`", section, flags=re.M))
    assert read, "no TORCH_TPU_* variable found in the code"
    assert documented == read, f"undocumented: {sorted(read - documented)}; stale: {sorted(documented - read)}"
