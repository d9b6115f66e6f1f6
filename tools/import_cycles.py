"""Import cycles among jaxdist's modules, counting every import: module level, inside functions and under
``TYPE_CHECKING`` (import-linter's layer contracts skip the last; a cycle there is still two modules that
cannot be read apart).  Also lists the imports inside functions, each with the reason comment on its line
or the line above it (ARCHITECTURE.md: every such import says why).

    python tools/import_cycles.py            # cycles and function-level imports; exit 1 if a cycle exists

``from jaxdist.pkg import name`` counts as an import of ``jaxdist.pkg.name`` when that is a module, else of
``jaxdist.pkg`` (its ``__init__``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "jaxdist"


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _target(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, int, str, str]]]:
    """module -> the jaxdist modules it imports (anywhere); and the function-level imports
    (module, line, imported module, reason comment or "")."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    local: list[tuple[str, int, str, str]] = []
    for mod, path in mods.items():
        src = path.read_text()
        lines = src.splitlines()
        tree = ast.parse(src)
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        in_function.add(id(sub))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package
                    pkg = mod if mods[mod].name == "__init__.py" else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for n in names:
                t = _target(n, mods) if n.startswith("jaxdist") else None
                if t is not None and t != mod:
                    graph[mod].add(t)
            if id(node) in in_function:  # one row per statement
                local.append((mod, node.lineno, ", ".join(dict.fromkeys(names)), _reason(lines, node.lineno)))
    return graph, local


def _reason(lines: list[str], lineno: int) -> str:
    """The reason comment of the import at ``lineno`` (1-based): on its line, or on a line of the block of
    imports it belongs to, or on the comment line just above that block."""
    imp = ("from ", "import ")
    i = lineno - 1
    while i > 0 and (
        lines[i - 1].strip().startswith(imp)
        or (not lines[i - 1].strip() and i > 1 and lines[i - 2].strip().startswith(imp))  # isort's blank line
    ):
        i -= 1  # the first import of the block
    while not lines[i].strip():
        i += 1
    if i > 0 and lines[i - 1].strip().startswith("#"):
        return lines[i - 1].strip()[1:].strip()
    j = i
    while j < len(lines) and (j == i or lines[j].strip().startswith(("from ", "import ", ")"))):
        if "#" in lines[j]:
            return lines[j].partition("#")[2].strip()
        j += 1
    return ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(out)


def main() -> int:
    mods = modules()
    graph, local = imports(mods)
    found = cycles(graph)
    without = [x for x in local if not x[3]]
    print(f"{len(mods)} modules, {sum(len(v) for v in graph.values())} imports between them")
    print(f"import cycles (every import counted): {len(found)}")
    for c in found:
        print("  " + " <-> ".join(c))
    print(f"imports inside functions: {len(local)}, {len(without)} without a reason comment")
    for mod, line, name, why in local:
        print(f"  {mod}:{line} {name}" + (f"  # {why}" if why else "  (no reason given)"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
