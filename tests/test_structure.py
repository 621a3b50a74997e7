"""The tree's shape: no import cycle among the kit's modules, no module over 400 lines.

An import cycle is looked for among the imports a module runs when it is loaded (top level, ``try``/``if`` blocks
included, ``if TYPE_CHECKING:`` left out); an edge to a package's ``__init__`` is left out too, since importing a
name a package re-exports from one of its own modules is not a cycle of the modules themselves.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folder -> the import name it is installed as (pyproject's package-dir).
PACKAGES = {"spec": "ggml_rpc.spec", "reference": "ggml_rpc.reference", "conformance": "ggml_rpc.conformance",
            "bench": "ggml_rpc.bench", "fixtures": "ggml_rpc.fixtures"}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _loaded_imports(name: str, path: Path) -> set[str]:
    """The modules ``name`` imports when it is loaded (as dotted names; a ``from`` import also names each item, in
    case the item is a module)."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.If | ast.Try):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    prefix = base[: len(base) - node.level + 1]
                    module = ".".join(prefix + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                out.add(module)
                out.update(f"{module}.{a.name}" for a in node.names)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles met by a depth-first walk of ``graph`` (each as the path that closes it)."""
    done: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path, stack = [start], {start}, [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                left = path.pop()
                on_path.discard(left)
                done.add(left)
            elif nxt in on_path:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return cycles


def test_the_cycle_walk_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_among_the_kits_modules() -> None:
    modules = _modules()
    graph = {name: {m for m in _loaded_imports(name, path) if m in modules and m != name
                    and modules[m].name != "__init__.py"}
             for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, cycles[:5]


def test_no_module_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long
