"""The package's import graph, read from the source: its layers, its function-local imports, its circles.

Every import statement of a ``torch_tpu`` module (or of the light hook ``_torch_tpu_autoload``) is an
edge, wherever it stands: at module level, inside a function, under ``if TYPE_CHECKING``. An edge
goes to the module named (``from torch_tpu.tensor import storage`` is an edge to
``torch_tpu.tensor.storage``; ``from torch_tpu.tensor.storage import new_tensor`` too; ``import
torch_tpu`` an edge to the package's ``__init__``). tests/test_import_layers.py asserts on what this
finds; run it as a script for the figures:

    python tools/import_graph.py          # root modules, function-local imports, the largest circle
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOOK = "_torch_tpu_autoload"


@dataclass(frozen=True)
class Edge:
    """One import statement's edge: ``source`` imports ``target`` at ``line``."""

    source: str
    target: str
    line: int
    local: bool  # inside a function (runs at call time, not at import)
    text: str  # the source line, for its comment


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the package, by dotted name, and the light hook beside it."""
    found = {}
    for path in sorted((root / "torch_tpu").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    found[HOOK] = root / f"{HOOK}.py"
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def edges(root: Path = ROOT) -> list[Edge]:
    """Every import statement between the package's modules."""
    modules = module_files(root)
    found: list[Edge] = []
    for name, path in modules.items():
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text)
        in_function = {id(sub) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for sub in ast.walk(node) if sub is not node}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: set[str | None] = set()
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] not in ("torch_tpu", HOOK):
                    continue
                for alias in node.names:
                    target = _resolve(f"{base}.{alias.name}", modules)
                    targets.add(target if target not in (None, base) else _resolve(base, modules))
            elif isinstance(node, ast.Import):
                targets = {_resolve(a.name, modules) for a in node.names if a.name.split(".")[0] in ("torch_tpu", HOOK)}
            for target in sorted(t for t in targets if t and t != name):
                found.append(Edge(name, target, node.lineno, id(node) in in_function, lines[node.lineno - 1]))
    return found


def circles(all_edges: list[Edge]) -> list[set[str]]:
    """The strongly connected components of more than one module: each is an import circle."""
    graph: dict[str, set[str]] = {}
    for e in all_edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found, key=len, reverse=True)


def main() -> int:
    modules = module_files()
    all_edges = edges()
    local = [e for e in all_edges if e.local]
    root_modules = [n for n, p in modules.items() if p.parent == ROOT / "torch_tpu"]
    found = circles(all_edges)
    print(f"modules at the package root: {len(root_modules)} ({', '.join(sorted(root_modules))})")
    print(f"function-local imports of the package's own modules: {len(local)}")
    for e in local:
        print(f"  {e.source}:{e.line} -> {e.target}")
    print(f"largest import circle: {len(found[0]) if found else 0} modules"
          + (f" ({', '.join(sorted(found[0]))})" if found else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
