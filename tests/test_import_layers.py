"""The import layering the code relies on, checked from the source so that it cannot drift.

* The runtime is a stack: each module imports only modules below it (errors at the bottom, the
  graph capture at the top), at module level or inside a function alike; nothing below the capture
  imports the storage layer or the dispatcher above it.
* The ops modules write lowerings and hand kernels against the serving table
  (``torch_tpu.ops._registry``), the storage layer and the executor's public names; they never
  import the dispatcher.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "torch_tpu"
# bottom to top
RUNTIME_ORDER = ["errors", "settle", "residency", "metrics", "cache", "fused", "host_reads", "checks", "executor",
                 "profiler", "report", "graphs", "graphed_callables"]
TOP = {"graphs", "graphed_callables"}  # the capture reads and writes storages: it sits above them


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every ``torch_tpu`` module ``path`` imports, anywhere in the file, with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch_tpu"):
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("torch_tpu")]
    return found


def test_every_runtime_module_is_placed():
    on_disk = {p.stem for p in (PACKAGE / "runtime").glob("*.py")} - {"__init__"}
    assert on_disk == set(RUNTIME_ORDER), "add the new runtime module to RUNTIME_ORDER at its level"


@pytest.mark.parametrize("name", RUNTIME_ORDER)
def test_runtime_imports_only_downwards(name):
    level = RUNTIME_ORDER.index(name)
    for module, line in _imports(PACKAGE / "runtime" / f"{name}.py"):
        parts = module.split(".")
        if parts[:2] == ["torch_tpu", "runtime"] and len(parts) > 2 and parts[2] in RUNTIME_ORDER:
            other = parts[2]
            assert RUNTIME_ORDER.index(other) < level or other == name, (
                f"runtime/{name}.py:{line} imports runtime.{other}, which sits above it"
            )
        elif parts[:2] != ["torch_tpu", "runtime"] and name not in TOP:
            raise AssertionError(f"runtime/{name}.py:{line} imports {module}: below the capture, the runtime "
                                 "imports only itself")


@pytest.mark.parametrize("path", sorted((PACKAGE / "ops").glob("*.py")), ids=lambda p: p.name)
def test_ops_modules_do_not_import_the_dispatcher(path):
    for module, line in _imports(path):
        assert not module.startswith("torch_tpu._dispatch"), f"ops/{path.name}:{line} imports the dispatcher"
        leaf = module.rsplit(".", 1)[-1]
        assert not (module.startswith("torch_tpu.runtime") and leaf.startswith("_")), (
            f"ops/{path.name}:{line} imports a private runtime name {module}"
        )


def test_every_private_module_is_placed_for_dynamo():
    """Dynamo skips the modules beneath the dispatcher (their frames run inside kernels, also
    between graph breaks); a new private module must say which side it is on."""
    from torch_tpu.compile.backend import _BENEATH_THE_DISPATCHER, TRACEABLE_PRIVATE

    for path in sorted(PACKAGE.glob("_*.py")):
        if path.stem == "__init__":
            continue
        name = f"torch_tpu.{path.stem}"
        assert name in _BENEATH_THE_DISPATCHER or name in TRACEABLE_PRIVATE, (
            f"{name}: add it to torch_tpu/compile/backend.py's _BENEATH_THE_DISPATCHER (kernels, metas, checks) "
            "or TRACEABLE_PRIVATE (called by user code)"
        )
