"""The tree's shape, counting every import of the kit's own modules: module-level, function-local and
``TYPE_CHECKING`` ones alike (import-linter's contract in pyproject.toml sees the same graph and checks the layers).

- no import cycle among the kit's modules;
- function-local imports of the kit's own modules only where named, each with its reason (at most ten outside the
  command line, whose sub-commands load on demand, and the executor, whose numba kernels compile on first use);
- nothing outside tests/ imports tests/;
- no class built from mixins: a class holds the objects it needs instead of inheriting from two or more of the kit's
  classes, from a ``*Mixin`` or from a class documented "``self`` is a ...".

The upper zones (checks, fuzz, upstream) are being rebuilt to the same rules: their remaining offenders are listed by
name below, and each list can only shrink (a listed item that no longer occurs fails the test, so it is removed).
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Folder -> the import name it is installed as (pyproject's package-dir).
PACKAGES = {"spec": "ggml_rpc.spec", "reference": "ggml_rpc.reference", "conformance": "ggml_rpc.conformance",
            "bench": "ggml_rpc.bench"}
#: Where function-local imports of the kit are the rule: a CLI sub-command's module is imported only when that
#: command runs, and the executor's numba kernels are compiled on first use.
LAZY_BY_DESIGN = ("ggml_rpc.conformance.cli", "ggml_rpc.reference.executor")
MAX_LOCAL = 10

#: The function-local imports of the kit's modules outside the CLI and the executor, (importer, imported): why each
#: is not at the top of its module.
LOCAL_IMPORTS: dict[tuple[str, str], str] = {
    ("ggml_rpc.conformance.pytest_plugin", "ggml_rpc.conformance.pytest_session"):
        "the plugin is loaded into every pytest run where the kit is installed; the harness behind its fixture takes "
        "about a second to import, paid only by a run that uses the fixture",
    ("ggml_rpc.reference.graph_commands", "ggml_rpc.reference.executor"):
        "the executor imports numba and reads its compiled kernels' cache (about a second), paid only by a server "
        "that computes a graph, not by one that stores tensors (the harness's, the fuzzer's oracle, a test's)",
}

#: Upper-zone cycles still to break: edges (importer, imported) which, left out, leave no cycle; each must still lie
#: on a cycle.
UPPER_CYCLE_EDGES: set[tuple[str, str]] = set()
#: Upper-zone function-local imports still to move to their module's top (or to remove).
UPPER_LOCAL_IMPORTS: set[tuple[str, str]] = set()
#: Upper-zone classes still built from mixins, as module.Class.
UPPER_MIXIN_CLASSES: set[str] = set()

@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    local: bool  # inside a function


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            found[".".join((package, *parts))] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The kit module ``name`` is, or lies in (``pkg.mod.Class`` -> ``pkg.mod``); None outside the kit."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The dotted names an import statement reaches (a ``from`` import names each item, in case it is a module)."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    if node.level:
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[: len(base) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    for alias in node.names:
        yield f"{module}.{alias.name}"


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> Iterator[Import]:
    """Every import of a kit module in ``name``'s source, wherever it stands; also the raw ``tests`` imports."""
    work: list[tuple[ast.AST, bool]] = [(parsed(path), False)]
    while work:
        node, in_function = work.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            seen = set()
            for target in _targets(name, path, node):
                if target.split(".")[0] == "tests":
                    yield Import(name, target, node.lineno, in_function)
                    continue
                owner = _owner(target, known)
                if owner is not None and owner != name and owner not in seen:
                    seen.add(owner)
                    yield Import(name, owner, node.lineno, in_function)
            continue
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        # Imports are statements: only the statement lists (bodies, branches, handlers, cases) are walked.
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            work.extend((child, inner) for child in getattr(node, field, ()) if isinstance(child, ast.AST))


@functools.cache
def all_imports() -> tuple[Import, ...]:
    known = modules()
    return tuple(i for name, path in known.items() for i in imports_of(name, path, known))


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components of more than one node (each is a set of modules in a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        # Tarjan's algorithm, iterative: (node, iterator over its successors).
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            nxt = next(successors, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _graph(imports: tuple[Import, ...], leave_out: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for i in imports:
        if not i.imported.startswith("tests") and (i.importer, i.imported) not in leave_out:
            graph.setdefault(i.importer, set()).add(i.imported)
    return graph


# ---- the counting itself ------------------------------------------------------------------------------------------


def test_every_kind_of_import_is_counted(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nfrom . import sib\nif TYPE_CHECKING:\n"
                      "    from .other import Thing\n\ndef f():\n    from ggml_rpc.spec.codec import Buffer\n"
                      "    import tests.helpers\n", encoding="utf-8")
    known = {"ggml_rpc.pkg.mod": source, "ggml_rpc.pkg.sib": source, "ggml_rpc.pkg.other": source,
             "ggml_rpc.spec": source, "ggml_rpc.spec.codec": source}
    found = {(i.imported, i.local) for i in imports_of("ggml_rpc.pkg.mod", source, known)}
    assert found == {("ggml_rpc.pkg.sib", False), ("ggml_rpc.pkg.other", False), ("ggml_rpc.spec.codec", True),
                     ("tests.helpers", True)}


def test_the_component_walk_finds_cycles() -> None:
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert strongly_connected({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


# ---- the rules ----------------------------------------------------------------------------------------------------


def test_no_import_cycle_among_the_kits_modules() -> None:
    imports = all_imports()
    cycles = strongly_connected(_graph(imports, UPPER_CYCLE_EDGES))
    assert not cycles, [sorted(c) for c in cycles]
    every = strongly_connected(_graph(imports))
    stale = {edge for edge in UPPER_CYCLE_EDGES if not any(set(edge) <= c for c in every)}
    assert not stale, f"no longer on a cycle, remove from the lists: {sorted(stale)}"


def test_function_local_imports_of_the_kit_only_where_named() -> None:
    local = {(i.importer, i.imported) for i in all_imports()
             if i.local and not i.imported.startswith("tests") and not i.importer.startswith(LAZY_BY_DESIGN)}
    assert len(LOCAL_IMPORTS) <= MAX_LOCAL
    unnamed = local - set(LOCAL_IMPORTS) - UPPER_LOCAL_IMPORTS
    assert not unnamed, f"import these at the top of the module: {sorted(unnamed)}"
    stale = (set(LOCAL_IMPORTS) | UPPER_LOCAL_IMPORTS) - local
    assert not stale, f"no longer function-local, remove from the lists: {sorted(stale)}"


def test_nothing_outside_tests_imports_tests() -> None:
    assert not [(i.importer, i.imported, i.line) for i in all_imports() if i.imported.split(".")[0] == "tests"]


_SELF_IS = re.compile(r"``self``\s+is\s+an?\b|\bself\s+is\s+an?\b")


def _kit_classes(known: dict[str, Path]) -> tuple[dict[str, ast.Module], set[str], set[str]]:
    """Every kit module's tree, the names of the kit's classes as module.Class, and those documented as a mixin."""
    trees = {name: parsed(path) for name, path in known.items()}
    classes, mixins = set(), set()
    for name, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes.add(f"{name}.{node.name}")
                if node.name.endswith("Mixin") or _SELF_IS.search(ast.get_docstring(node) or ""):
                    mixins.add(f"{name}.{node.name}")
    return trees, classes, mixins


def _bound(name: str, tree: ast.Module, path: Path) -> dict[str, str]:
    """The names a module binds by its ``from`` imports and class statements, with what they name."""
    bound: dict[str, str] = {}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.ImportFrom):
            for alias, target in zip(stmt.names, _targets(name, path, stmt), strict=True):
                bound[alias.asname or alias.name] = target
        elif isinstance(stmt, ast.ClassDef):
            bound.setdefault(stmt.name, f"{name}.{stmt.name}")
    return bound


def _bases(bound: dict[str, str], node: ast.ClassDef) -> list[str]:
    """The qualified names of ``node``'s bases as its module binds them (a base from outside the kit keeps its bare
    name)."""
    out = []
    for base in node.bases:
        text = ast.unparse(base)
        head, _, rest = text.partition(".")
        out.append(bound.get(head, head) + (f".{rest}" if rest else ""))
    return out


def _resolve(qualified: str, known: dict[str, Path], trees: dict[str, ast.Module]) -> str:
    """A re-exported class (``pkg.Class`` bound in ``pkg/__init__``) followed to the module defining it."""
    for _ in range(5):
        module, _, attr = qualified.rpartition(".")
        tree = trees.get(module)
        if tree is None or any(isinstance(n, ast.ClassDef) and n.name == attr for n in tree.body):
            return qualified
        step = None
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom):
                for alias, target in zip(stmt.names, _targets(module, known[module], stmt), strict=True):
                    if (alias.asname or alias.name) == attr:
                        step = target
        if step is None:
            return qualified
        qualified = step
    return qualified


def mixin_built_classes() -> set[str]:
    known = modules()
    trees, classes, mixins = _kit_classes(known)
    built = set()
    for name, tree in trees.items():
        bound = _bound(name, tree, known[name])
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [_resolve(b, known, trees) for b in _bases(bound, node)]
            kit = [b for b in bases if b in classes]
            if len(kit) >= 2 or any(b in mixins or b.rpartition(".")[2].endswith("Mixin") for b in bases):
                built.add(f"{name}.{node.name}")
    return built


def test_no_class_is_built_from_mixins() -> None:
    built = mixin_built_classes()
    assert not built - UPPER_MIXIN_CLASSES, f"hold these as objects instead: {sorted(built - UPPER_MIXIN_CLASSES)}"
    stale = UPPER_MIXIN_CLASSES - built
    assert not stale, f"no longer built from mixins, remove from UPPER_MIXIN_CLASSES: {sorted(stale)}"


# ---- the picture of the layers -------------------------------------------------------------------------------

#: ARCHITECTURE.md's layer section lies between these lines; :func:`layer_picture` writes it from the contract.
PICTURE_START = "<!-- layers: drawn from pyproject.toml's import-linter contract by tests/test_structure.py -->"
PICTURE_END = "<!-- /layers -->"


def contract_layers() -> list[tuple[str, str]]:
    """The contract's layers, top to bottom, each with the comment above it in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    layers = tomllib.loads(text)["tool"]["importlinter"]["contracts"][0]["layers"]
    block = text[text.index("layers = [", text.index("[[tool.importlinter.contracts]]")):]
    out, comment = [], ""
    for line in block.splitlines()[1:]:
        stripped = line.strip()
        if stripped == "]":
            break
        if stripped.startswith("#"):
            comment = (comment + " " + stripped.lstrip("# ")).strip()
        elif stripped:
            out.append((stripped.strip('",'), comment))
            comment = ""
    assert [name for name, _ in out] == layers
    return out


def layer_picture() -> str:
    """The layer section of ARCHITECTURE.md: each layer (``ggml_rpc.`` left out), top to bottom, with what it is; an
    arrow points the way imports may go."""
    rows = [(name.replace("ggml_rpc.", ""), comment) for name, comment in contract_layers()]
    lines = [PICTURE_START, "```text"]
    for i, (name, comment) in enumerate(rows):
        last = i == len(rows) - 1
        lines += [name, f"{' ' if last else '│'}  {comment}".rstrip()] + ([] if last else ["▼"])
    lines += ["```", PICTURE_END]
    return "\n".join(lines)


def test_the_architecture_page_draws_the_contract() -> None:
    page = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    start, end = page.find(PICTURE_START), page.find(PICTURE_END)
    assert start >= 0 and end > start, f"ARCHITECTURE.md lacks its layer section:\n{layer_picture()}"
    drawn = page[start : end + len(PICTURE_END)]
    assert drawn == layer_picture(), f"redraw ARCHITECTURE.md's layer section from the contract:\n{layer_picture()}"
