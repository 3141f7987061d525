"""tools/test_lanes.py, which runs make test's pytest groups side by side: every group runs, each
group's output comes out whole, and one failing group fails the run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("test_lanes", Path(__file__).parent.parent / "tools" / "test_lanes.py")
lanes = importlib.util.module_from_spec(_spec)
sys.modules["test_lanes"] = lanes  # dataclasses looks the module up by name
_spec.loader.exec_module(lanes)


def test_a_group_spec_names_its_environment_interpreter_and_arguments():
    g = lanes.parse_group("fused A-L: TORCH_TPU_EAGER_MODE=fused X_Y=1 @/opt/py tests/a.py -k 'b or c'")
    assert (g.name, g.env, g.python, g.args) == (
        "fused A-L", {"TORCH_TPU_EAGER_MODE": "fused", "X_Y": "1"}, "/opt/py", ["tests/a.py", "-k", "b or c"])
    assert lanes.parse_group("x: tests/a.py").python == sys.executable


@pytest.mark.parametrize("spec", ["tests/a.py", "empty: ", "only env: A=1"])
def test_a_group_without_a_name_or_tests_is_refused(spec):
    """A Makefile variable that expands to nothing must not become a pytest of the whole folder."""
    with pytest.raises(SystemExit, match="test_lanes"):
        lanes.parse_group(spec)


def test_every_group_runs_whole_and_one_failure_fails_the_run(tmp_path, capsys):
    (tmp_path / "test_ok.py").write_text("import os\ndef test_env():\n    assert os.environ['LANE_MARK'] == 'yes'\n")
    (tmp_path / "test_bad.py").write_text("def test_bad():\n    assert 1 == 2\n")
    quiet = "-p no:cacheprovider -o addopts= -q"
    groups = [lanes.parse_group(f"bad: {quiet} {tmp_path / 'test_bad.py'}"),
              lanes.parse_group(f"ok: LANE_MARK=yes {quiet} {tmp_path / 'test_ok.py'}")]
    assert lanes.run(groups, lanes=2) == 1
    out = capsys.readouterr().out
    assert [g.rc for g in groups] == [1, 0]
    assert "1 failed" in groups[0].closing and "1 passed" in groups[1].closing
    # each group's report is one block, between its header and its end line
    for g in groups:
        block = out[out.index(f"{g.name}: exit {g.rc}"):out.index(f"end of {g.name}")]
        assert ("assert 1 == 2" in block) == (g.name == "bad")
    assert lanes.run(groups[1:], lanes=1) == 0
