"""The import layering the code relies on, checked from the source so that it cannot drift.

Every module sits on a layer (``LAYERS``, bottom to top; docs/architecture.md says what each holds).
A module imports, at module level, only from its own layer and the layers below it. Function-local
imports of the package's own modules are the few that torch's loading order forces (the light hook
loads the package, the c10d backend and the inductor route at first use), and the estimator, which
``import torch_tpu`` loads on demand; each says why in a comment. So
the only import circle is the hook and the package's ``__init__``, which imports it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "torch_tpu"
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
graph = sys.modules["import_graph"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(graph)

# bottom to top: each entry is a layer, the packages (or modules) on it
LAYERS = [
    ("hook", ["_torch_tpu_autoload"]),  # imports nothing of the package at module level
    ("core", ["torch_tpu.core"]),
    ("runtime", ["torch_tpu.runtime"]),
    ("tensor", ["torch_tpu.tensor"]),
    ("ops", ["torch_tpu.ops"]),
    ("dispatch", ["torch_tpu.dispatch"]),
    ("device", ["torch_tpu.device"]),
    ("front ends", ["torch_tpu.compile", "torch_tpu.distributed", "torch_tpu.custom"]),
    ("applications", ["torch_tpu.estimator", "torch_tpu.integrations"]),
    ("surface", ["torch_tpu"]),  # the package's __init__: the public names, and where the layers are put together
    ("tools", ["torch_tpu.bench", "torch_tpu.testing"]),
]
# The function-local imports there are: (module, the module it imports). None works around a circle.
ALLOWED_LOCAL = {
    # torch's own loading order forces these: the hook runs inside ``import torch``, before jax may load
    ("_torch_tpu_autoload", "torch_tpu"),  # the package loads at the first tpu op
    ("_torch_tpu_autoload", "torch_tpu.distributed.c10d"),  # c10d builds a ``tpu`` group after the hook ran
    ("_torch_tpu_autoload", "torch_tpu.integrations.inductor"),  # inductor routes a tpu graph after the hook ran
    # on demand: ``import torch_tpu`` never loads the estimator's distributed, safetensors and tqdm
    ("torch_tpu", "torch_tpu.estimator"),
}
# bottom to top, inside the runtime layer (the executor's own stack)
RUNTIME_ORDER = ["errors", "settle", "residency", "metrics", "target", "cache", "fused", "host_reads", "checks",
                 "executor", "profiler", "report"]
PUBLIC_ROOT = {"torch_tpu", "torch_tpu.custom"}  # the package root holds the public surface only

EDGES = graph.edges(ROOT)
MODULES = graph.module_files(ROOT)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest package prefix that holds ``module``."""
    best, level = -1, None
    for i, (_, places) in enumerate(LAYERS):
        for place in places:
            if (module == place or module.startswith(place + ".")) and len(place) > best:
                best, level = len(place), i
    if level is None:
        raise AssertionError(f"{module} is on no layer: add it (or its package) to LAYERS")
    return level


def test_every_module_is_on_a_layer():
    for module in MODULES:
        layer_of(module)


def test_the_package_root_holds_the_public_surface_only():
    root = {name for name, path in MODULES.items() if path.parent == PACKAGE}
    assert root == PUBLIC_ROOT, "a module at the package root that is not public API belongs in a layer's package"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_level_imports_go_down(module):
    level = layer_of(module)
    for e in EDGES:
        if e.source == module and not e.local:
            assert layer_of(e.target) <= level, (
                f"{module}:{e.line} imports {e.target}, on the {LAYERS[layer_of(e.target)][0]} layer above "
                f"{LAYERS[level][0]}")


def test_function_local_imports_are_only_the_few_allowed():
    local = [e for e in EDGES if e.local]
    others = [f"{e.source}:{e.line} -> {e.target}" for e in local if (e.source, e.target) not in ALLOWED_LOCAL]
    assert not others, f"import at module level from a layer below (or move the code): {others}"
    assert len(local) <= 10
    for e in local:
        assert "#" in e.text, f"{e.source}:{e.line}: a function-local import says why in a comment on its line"


def test_the_only_import_circle_is_the_hook_and_the_package():
    found = graph.circles(EDGES)
    assert all(len(c) <= 3 for c in found), f"import circles: {found}"
    assert found == [{"_torch_tpu_autoload", "torch_tpu"}]


def test_the_circle_finder_finds_a_circle():
    """The check above must be able to fail: a made-up circle of three is found whole."""
    made = [graph.Edge("a", "b", 1, False, ""), graph.Edge("b", "c", 1, False, ""), graph.Edge("c", "a", 1, True, ""),
            graph.Edge("c", "d", 1, False, "")]
    assert graph.circles(made) == [{"a", "b", "c"}]


def test_every_runtime_module_is_placed():
    on_disk = {p.stem for p in (PACKAGE / "runtime").glob("*.py")} - {"__init__"}
    assert on_disk == set(RUNTIME_ORDER), "add the new runtime module to RUNTIME_ORDER at its level"


@pytest.mark.parametrize("name", RUNTIME_ORDER)
def test_runtime_imports_only_downwards_inside_its_layer(name):
    level = RUNTIME_ORDER.index(name)
    for e in EDGES:
        if e.source == f"torch_tpu.runtime.{name}" and e.target.startswith("torch_tpu.runtime."):
            other = e.target.split(".")[2]
            assert RUNTIME_ORDER.index(other) < level, f"runtime/{name}.py:{e.line} imports runtime.{other}, above it"


@pytest.mark.parametrize("path", sorted((PACKAGE / "ops").glob("*.py")), ids=lambda p: p.name)
def test_ops_modules_use_only_the_executors_public_names(path):
    for node_module, line in _from_imports(path):
        leaf = node_module.rsplit(".", 1)[-1]
        assert not (node_module.startswith("torch_tpu.runtime") and leaf.startswith("_")), (
            f"ops/{path.name}:{line} imports a private runtime name {node_module}")


def _from_imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch_tpu"):
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return found


def test_every_module_is_placed_for_dynamo():
    """Dynamo skips the modules beneath the dispatcher (their frames run inside kernels, also
    between graph breaks); a new module below the front ends must say which side it is on."""
    from torch_tpu.compile.backend import _BENEATH_THE_DISPATCHER, TRACEABLE_PRIVATE

    front_ends = layer_of("torch_tpu.compile")
    for name, path in MODULES.items():
        if layer_of(name) >= front_ends or not name.startswith("torch_tpu.") or path.name == "__init__.py":
            continue
        placed = [p for p in (*_BENEATH_THE_DISPATCHER, *TRACEABLE_PRIVATE) if name == p or name.startswith(p + ".")]
        assert placed, (f"{name}: add it to torch_tpu/compile/backend.py's _BENEATH_THE_DISPATCHER (kernels, metas, "
                        "checks) or TRACEABLE_PRIVATE (called by user code)")
